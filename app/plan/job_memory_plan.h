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

#include "app/config/job_settings.h"
#include "app/plan/activation_table.h"
#include "partial_fc/classifier/partial_fc.h"

namespace faceshard {


struct PlanPart {
  std::string group;  // backbone | classifier | communication
  std::string name;
  double bytes = 0;
  std::string how;    // the formula, in words and numbers
};

struct JobMemoryPlan {
  JobSettings inputs;
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
JobMemoryPlan plan_job_memory(const JobSettings& in, const ActivationTable& table);

// The largest class count (>= world_size) whose plan needs at most `budget_bytes`, or 0
// when even world_size classes do not fit. Bisection on the class count (at most 2^40).
// A plan figure as its parts and messages print it (12 significant digits).
std::string plan_number(double v);

int64_t max_classes_that_fit(JobSettings in, const ActivationTable& table, double budget_bytes);

// The largest batch per rank (per micro-batch, >= 2) whose plan needs at most
// `budget_bytes`, or 0 when even 2 images do not fit. Every part grows with the batch except
// where loss.logits auto turns to streamed logits (the buffer would outgrow the centres and
// their state): there the plan drops, so each side of that batch is bisected on its own.
int64_t max_batch_that_fits(JobSettings in, const ActivationTable& table, double budget_bytes);

}  // namespace faceshard
