// A training job's settings as everything that sizes or builds it reads them: the trainer,
// faceshard-plan (from a config or its own flags), faceshard-config and faceshard-head. One
// copy from the config (job_settings) and one road from the settings to the classifier's
// options (classifier_options), so that the planner's figures, the config check's and the
// shard the trainer builds come from the same options.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "partial_fc/classifier/partial_fc.h"

namespace faceshard {

struct Config;

struct JobSettings {
  std::string network = "r50";
  int64_t batch_per_rank = 128;        // one micro-batch on one rank
  std::string precision = "fp32";      // fp32 | bf16 | fp16 (the body's; the classifier's GEMMs follow it)
  std::optional<bool> checkpointing;   // unset: the network's default
  int64_t num_classes = 0;
  int world_size = 1;
  double sample_rate = 1.0;
  int64_t subcenters = 1;              // loss.subcenters: centres (rows) per class
  std::string optimizer = "sgd";       // backbone: sgd | adamw
  std::string fc_optimizer;            // classifier: sgd | adamw; empty: the backbone's
  double momentum = 0.9;               // SGD keeps no momentum buffer at 0
  double fc_weight_decay = 5e-4;       // optim.fc_weight_decay (else optim.weight_decay)
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // AdamW's
  bool fc_update_all = false;          // optim.fc_update: all
  std::string fc_state_dtype = "fp32"; // optim.fc_state_dtype: fp32 | bf16
  std::string fc_weight_dtype = "fp32"; // optim.fc_weight_dtype: fp32 | bf16
  std::string fc_weight_rounding = "stochastic";  // optim.fc_weight_rounding: stochastic | nearest
  std::string logits = "auto";          // loss.logits: auto | buffer | streamed
  int64_t grad_accumulation = 1;       // micro-batches per step (batch_per_rank is one micro-batch)
  bool cuda_graph = false;             // train.cuda_graph: the backbone's graphs keep static tensors
  int64_t embedding_size = 512;
  int64_t image_size = 112;
  std::string head = "combined";       // loss.head (AdaFace and CurricularFace keep 2 bits a logit)
  std::map<std::string, double> head_params;  // its parameters (loss.<head>.*)
  CombinedMargin margin;               // loss.margin, scale, margin_mode, interclass_filtering_threshold
  uint64_t seed = 2048;
  bool precision_auto = false;         // train.precision auto, resolved as on a GPU (bf16)
};

// The images per rank and micro-batch: data.global_batch_size split over `world_size` ranks x
// optim.grad_accumulation micro-batches (a config error naming the key when it cannot be), or
// data.batch_size when the global batch is not set.
int64_t batch_per_rank(const Config& cfg, int world_size);

// The settings of a training config: data.global_batch_size split over `world_size` ranks and
// optim.grad_accumulation micro-batches as the trainer splits it (a config error naming the
// key when it cannot be), train.precision auto taken as on a GPU (bf16; the trainer puts its
// device's choice in `precision`), data.num_classes 0 while it is counted from the data.
JobSettings job_settings(const Config& cfg, int world_size);

// "fp32" -> kFloat, "bf16" -> kBFloat16; anything else an option error naming `option`.
at::ScalarType classifier_dtype(const std::string& name, const char* option);

// The classifier's options for these settings: its size, sampling, sub-centres, head and
// margin, optimiser and its state's type, the centres' type and rounding, the GEMMs' type (the
// body's precision), which rows a step moves, and loss.logits auto resolved for this world
// size and batch (streamed_logits_pay). Option errors name the setting (optimizer,
// fc_state_dtype, fc_weight_dtype, fc_weight_rounding, logits, grad_accumulation, precision).
// What only a running job knows (initialise_rows, the chunking) stays at its default.
PartialFCOptions classifier_options(const JobSettings& s);

}  // namespace faceshard
