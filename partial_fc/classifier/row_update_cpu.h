// The classifier step's update of one chunk of rows on the CPU, in one pass over each row:
// the row's gradient is formed from the raw product M_j = (G'^T E)_j and the row itself,
//   dL/dw_j = M_j - (w_j . M_j) / ||w_j||^2 * w_j,
// and SGD (momentum, weight decay, dampening 0, no Nesterov: torch.optim.SGD's update as
// arcface_torch configures it) is applied to w_j and its momentum row where they live in
// the shard, through the sampled index. The generic path (ShardOptimizer::update_rows on
// gathered rows, the one a GPU takes) reads and writes every row and its momentum twice
// more: a gather, the update, a scatter; on the CPU those copies cost as much as the GEMMs
// of a sampled step.
#pragma once
#include <torch/torch.h>

#include "partial_fc/classifier/stochastic_round.h"

namespace faceshard {

struct RowSgd {
  double lr = 0, momentum = 0.9, weight_decay = 0;
};

// weight [rows, d] fp32 or bf16 (optim.fc_weight_dtype; a bf16 row is updated in fp32 and
// written back stochastically rounded with `rounding`'s keys, stochastic_round.h) and momentum [rows, d] fp32 or bf16 (undefined when momentum is
// 0), contiguous CPU tensors; raw [n, d] fp32 contiguous: M of the chunk's rows, which are
// index [n] (int64, unique) or, with index undefined, rows [first, first + n); inv_norm
// [n] fp32: 1 / ||w_j|| of the forward. A bf16 momentum is updated in fp32 and stored
// rounded to bf16.
void sgd_projected_rows_cpu(at::Tensor& weight, at::Tensor& momentum, const at::Tensor& raw, const at::Tensor& inv_norm,
                            int64_t first, const at::Tensor& index, const RowSgd& sgd,
                            const RowRounding& rounding = RowRounding{});

}  // namespace faceshard
