// AllGather with gradient: gathers a tensor from every rank along dim 0 (ranks may
// contribute different numbers of rows) and, unlike a plain all_gather, propagates
// gradients back to each rank's own rows.
#pragma once
#include <torch/torch.h>

#include "partial_fc/distributed/distributed.h"

namespace faceshard {

// How the backward pass turns the gradient of the gathered tensor into the gradient of
// this rank's rows.
enum class GatherGrad {
  // Every rank's loss depends on all gathered rows and the ranks' losses are SUMMED:
  // d(sum_q L_q)/dx_r = sum_q (dL_q/dX)[rows of r] -> a reduce-scatter (SUM). This is the
  // mode of the sharded classifier, where each rank computes the loss terms of its own
  // class columns.
  ReduceScatterSum,
  // Each rank keeps the gradient of its OWN copy of the loss: dL_r/dx_r = (dL_r/dX)[rows
  // of r], no communication in backward.
  OwnSlice,
};

// Returns cat(x_0, ..., x_{W-1}) on every rank; differentiable w.r.t. x. The gradient
// reaching x is multiplied by grad_scale (the sharded classifier passes W, see
// partial_fc.h for why).
at::Tensor all_gather_with_grad(Distributed& dist, const at::Tensor& x, GatherGrad mode, double grad_scale = 1.0);

}  // namespace faceshard
