// Fine-tuning a released model: the backbone (or its stem and first stages) frozen for the
// first optim.freeze_backbone_steps steps while the new classifier learns, then the whole
// network trains. Frozen parameters stop requiring gradients, so backward never reaches
// them (nor, for a frozen stem and first stages, anything before the first trained layer),
// their optimiser takes no step (no weight decay, no momentum or AdamW state accumulated),
// DataParallel counts them as ready without an all-reduce, and the frozen BatchNorm layers
// run in eval mode so their running statistics stay the released model's.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "app/config/config.h"
#include "models/backbone.h"

namespace faceshard {

class BackboneFreeze {
 public:
  BackboneFreeze() = default;  // freezes nothing
  // `params`: the backbone's trainable parameters (what the optimiser and DataParallel
  // hold). `stages` unset: the whole backbone; K: the stem and stages 1..K
  // (backbone_stage_prefixes). Throws a usage error when the network has fewer stages.
  BackboneFreeze(Backbone& backbone, const std::vector<at::Tensor>& params, int64_t steps,
                 std::optional<int64_t> stages);

  bool active() const { return steps_ > 0; }
  int64_t steps() const { return steps_; }
  bool frozen() const { return frozen_; }
  // Per entry of `params`: 1 when freezing covers it (the partition of the flat buffers,
  // so that the optimiser steps the frozen part or not as a whole).
  const std::vector<int>& partition() const { return partition_; }
  size_t covered() const { return covered_; }
  size_t trainable() const { return params_.size(); }

  // Before step `step` (0-based): steps 0..steps-1 are frozen, later ones are not. Freezes
  // or thaws when the state changes (one log line on rank 0 each), and while frozen puts
  // the frozen modules back in eval mode (a verification's train() sets them training).
  void apply(int64_t step);

  // "the stem and stages 1-2 of r50 (48 of 161 tensors)".
  std::string describe() const;

 private:
  Backbone* backbone_ = nullptr;
  std::vector<at::Tensor> params_;
  std::vector<int> partition_;
  std::vector<torch::nn::Module*> modules_;  // the outermost frozen modules
  std::string what_;
  int64_t steps_ = 0;
  size_t covered_ = 0;
  bool frozen_ = false;
};

// The backbone's learning rate factor at step `step` (0-based) for optim.thaw_warmup_steps:
// (step - S + 1) / N over the N steps from the thaw S = optim.freeze_backbone_steps, 1
// otherwise (and 1 while frozen: nothing of the frozen part steps then).
double thaw_warmup_factor(const OptimConfig& o, int64_t step);

// The stages optim.freeze_stages may name for `backbone` (its stage count): a config error
// naming the key when the network has fewer.
void check_freeze_config(const Config& cfg);

// The start-up line of the learning rates: "learning rates: backbone 0.01 (sgd, momentum
// 0.9, weight decay 0.0005), classifier 0.1 (sgd, ..., optim.fc_lr)".
std::string describe_learning_rates(const OptimConfig& optim);

}  // namespace faceshard
