// What one rank of a training job takes in device memory, part by part, from the job's
// settings alone: the backbone (parameters, gradients, optimiser state, half-precision
// copies of the weights, activations from the measured table, the input batch), the
// classifier shard (classifier_memory_plan(): rows, optimiser state, gradient, logits), and
// the communication buffers (DataParallel's gradient buckets, the all-gather of the
// embeddings). faceshard-plan prints it, says whether it fits a device and finds the largest
// number of classes that does (the same formulas, bisected on the class count).
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "app/plan/activation_table.h"
#include "partial_fc/classifier/partial_fc.h"

namespace faceshard {

struct Config;

struct JobPlanInputs {
  std::string network = "r50";
  int64_t batch_per_rank = 128;
  std::string precision = "fp32";      // fp32 | bf16 | fp16
  std::optional<bool> checkpointing;   // unset: the network's default
  int64_t num_classes = 0;
  int world_size = 1;
  double sample_rate = 1.0;
  int64_t subcenters = 1;              // loss.subcenters: centres (rows) per class
  std::string optimizer = "sgd";       // backbone: sgd | adamw
  std::string fc_optimizer;            // classifier: sgd | adamw; empty: the backbone's
  double momentum = 0.9;               // SGD keeps no momentum buffer at 0
  bool fc_update_all = false;          // optim.fc_update: all
  std::string fc_state_dtype = "fp32"; // optim.fc_state_dtype: fp32 | bf16
  std::string fc_weight_dtype = "fp32"; // optim.fc_weight_dtype: fp32 | bf16
  std::string logits = "auto";          // loss.logits: auto | buffer | streamed
  int64_t grad_accumulation = 1;       // micro-batches per step (batch_per_rank is one micro-batch)
  bool cuda_graph = false;             // train.cuda_graph: the backbone's graphs keep static tensors
  int64_t embedding_size = 512;
  int64_t image_size = 112;
  std::string head = "combined";       // loss.head (AdaFace and CurricularFace keep 2 bits a logit)
  std::map<std::string, double> head_params;  // its parameters (loss.<head>.*)
  bool precision_auto = false;         // train.precision auto, resolved as on a GPU (bf16)
};

// The settings of a training config (data.global_batch_size split over `world_size` ranks
// and optim.grad_accumulation micro-batches, as the trainer does).
JobPlanInputs job_plan_inputs(const Config& cfg, int world_size);

struct PlanPart {
  std::string group;  // backbone | classifier | communication
  std::string name;
  double bytes = 0;
  std::string how;    // the formula, in words and numbers
};

struct JobMemoryPlan {
  JobPlanInputs inputs;
  bool checkpointing = false;  // resolved
  int64_t parameters = 0;
  double activation_bytes_per_image = 0;
  ClassifierMemoryPlan classifier;  // rank 0's (the largest shard)
  std::vector<PlanPart> parts;
  double total_bytes() const;
  double group_bytes(const std::string& group) const;
};

// Option errors (usage) name the flag's option: network, precision, checkpointing, batch,
// ranks, classes, sample_rate, optimizer.
JobMemoryPlan plan_job_memory(const JobPlanInputs& in, const ActivationTable& table);

// The largest class count (>= world_size) whose plan needs at most `budget_bytes`, or 0
// when even world_size classes do not fit. Bisection on the class count (at most 2^40).
// A plan figure as its parts and messages print it (12 significant digits).
std::string plan_number(double v);

int64_t max_classes_that_fit(JobPlanInputs in, const ActivationTable& table, double budget_bytes);

// The largest batch per rank (per micro-batch, >= 2) whose plan needs at most
// `budget_bytes`, or 0 when even 2 images do not fit. Every part grows with the batch except
// where loss.logits auto turns to streamed logits (the buffer would outgrow the centres and
// their state): there the plan drops, so each side of that batch is bisected on its own.
int64_t max_batch_that_fits(JobPlanInputs in, const ActivationTable& table, double budget_bytes);

}  // namespace faceshard
