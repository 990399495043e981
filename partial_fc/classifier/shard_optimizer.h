// The optimiser state of a classifier shard, row by row: SGD momentum, or AdamW moments
// with a step count per row (so the bias correction of a row counts its own updates). A
// step updates only the rows it is given; every other row and its state stay
// bit-identical (the Partial FC paper's behaviour; arcface_torch's V2 lets unsampled rows
// drift under weight decay and momentum, which PartialFC's step_all_rows reproduces by
// stepping every row). PartialFC owns one and decides which rows move.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "partial_fc/classifier/stochastic_round.h"

namespace faceshard {

struct ShardOptimizerOptions {
  std::string kind = "sgd";  // sgd | adamw
  double momentum = 0.9;
  double weight_decay = 5e-4;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  // The dtype of momentum / exp_avg / exp_avg_sq: kFloat or kBFloat16 (row_steps stays
  // int64). Anything else is an option error naming "fc_state_dtype".
  at::ScalarType state_dtype = at::kFloat;
  // SGD: update_projected_rows runs (one pass per row: row_update_cpu.h on the CPU, one
  // kernel per chunk on a GPU, row_update_cuda.h). false: it declines, and the caller takes
  // the generic path (gather, update, scatter; tests run both).
  bool fused_cpu_rows = true;
};

class ShardOptimizer {
 public:
  // State rows shaped like `weight` [rows, d] (option errors name "optimizer"): zero, or
  // with initialise = false allocated only (a checkpoint is about to be read into them).
  ShardOptimizer(const at::Tensor& weight, const ShardOptimizerOptions& opts, bool initialise = true);

  // Updates rows `index` (sorted, unique; undefined = every row) of `weight` with `grad`
  // [index.size(0) or rows, d], in chunks of kChunkRows rows. A bf16 weight is updated in
  // fp32 copies of the rows, written back rounded by `rounding` (stochastic_round.h).
  void step(at::Tensor& weight, const at::Tensor& index, const at::Tensor& grad, double lr,
            const RowRounding& rounding = RowRounding{});

  // One chunk of an update: `rows` [n, d] fp32 are weight rows (a view of the weight,
  // updated in place, or a copy the caller writes back), `grad` [n, d] their gradient;
  // their state is rows [first, first + n) or, with `index` defined ([n], sorted, unique),
  // rows `index`. PartialFC's chunked step calls this with the gradient of one chunk.
  void update_rows(const at::Tensor& rows, const at::Tensor& grad, int64_t first, const at::Tensor& index, double lr);

  // One chunk of the classifier's deferred update in one pass per row: the gradient of rows
  // `index` (or [first, first + n)) of `weight` is formed from `raw` [n, d] = G'^T E and the
  // rows themselves (less the radial part, with `inv_norm` [n] = 1 / ||w_j||), and applied
  // where the rows live. Returns false, having done nothing, where that pass does not exist
  // (AdamW, a weight on another device, fused_cpu_rows off): the caller forms the gradient
  // and calls update_rows.
  // A bf16 weight's rows are written back rounded by `rounding`.
  bool update_projected_rows(at::Tensor& weight, const at::Tensor& raw, const at::Tensor& inv_norm, int64_t first,
                             const at::Tensor& index, double lr, const RowRounding& rounding = RowRounding{});

  static constexpr int64_t kChunkRows = 4096;

  // Per-row state tensors, same row order as the weight: "momentum" (sgd) or "exp_avg",
  // "exp_avg_sq", "row_steps" (adamw). The live tensors, not copies.
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  const ShardOptimizerOptions& options() const { return opts_; }

 private:
  ShardOptimizerOptions opts_;
  at::Tensor momentum_;              // sgd
  at::Tensor exp_avg_, exp_avg_sq_;  // adamw
  at::Tensor row_steps_;             // adamw, int64 per row
};

}  // namespace faceshard
