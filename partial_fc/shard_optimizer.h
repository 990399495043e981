// Optimiser of a classifier shard. Only the rows that took part in a step (the sampled
// centres) change: their weights, momentum and AdamW moments are updated; every other
// row and its optimiser state stay bit-identical (the Partial FC paper's behaviour;
// arcface_torch's V2 lets unsampled rows drift under weight decay and momentum). AdamW
// keeps a step count per row, so the bias correction of a row counts its own updates.
#pragma once
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "partial_fc/partial_fc.h"

namespace faceshard {

struct ShardOptimizerOptions {
  std::string kind = "sgd";  // sgd | adamw
  double momentum = 0.9;
  double weight_decay = 5e-4;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
};

class ShardOptimizer {
 public:
  ShardOptimizer(PartialFC& fc, const ShardOptimizerOptions& opts);
  // Applies the gradient held by fc.sampled_weight() to the rows fc.sampled_index().
  // grad_scale multiplies the gradient first (1 / loss scale under fp16).
  void step(double lr, double grad_scale = 1.0);
  // Drops the gradient of the last step (and any set aside by accumulate()).
  void zero_grad();

  // Gradient accumulation over micro-batches. With sampling every forward selects its own
  // rows (a new leaf), so after each micro-batch's backward but the last, accumulate() sets
  // that gradient aside; merge_accumulated() sums everything set aside and the last
  // micro-batch's gradient per row over the union of the rows and makes that the sampled
  // leaf: one step then applies the exact gradient of the summed micro-batch losses. Both
  // are no-ops without sampling (autograd accumulates into the whole-shard leaf). step()
  // merges by itself; the fp16 path merges first so that unscaling sees the sum.
  void accumulate();
  void merge_accumulated();

  // Optimiser state rows, for checkpoints (same row order as the weight shard).
  std::map<std::string, at::Tensor> state();
  const ShardOptimizerOptions& options() const { return opts_; }

 private:
  PartialFC& fc_;
  ShardOptimizerOptions opts_;
  at::Tensor momentum_;             // sgd
  at::Tensor exp_avg_, exp_avg_sq_; // adamw
  at::Tensor row_steps_;            // adamw, int64 per row
  std::vector<at::Tensor> pending_index_, pending_grad_;  // accumulate()
};

}  // namespace faceshard
