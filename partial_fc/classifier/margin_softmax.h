// The classifier's loss on one shard, as one autograd function that owns the big GEMM:
// from the normalised embeddings of the global batch E [N, d] and this rank's raw centres
// W [S, d] to the margin softmax cross-entropy across all ranks. Memory is one fp32
// [N, S] buffer: the GEMM E W^T is written into it, scaled in one pass to s * cos (the
// column factor s / ||w_j||), given the margin on the target entries, shifted by the global
// row max, exponentiated and normalised in place (the probabilities), and in backward the
// same buffer becomes the gradient in place. Neither pass makes a normalised copy of W:
// with G' = dL/dcos / ||W|| (per column),
//   dL/dE = G' W,   dL/dw_j = M_j - (w_j . M_j) w_j / ||w_j||^2,  M = G'^T E
// (the second term removes the radial part: the loss does not depend on ||w_j||).
// The softmax runs across ranks with two small all-reduces (row max; row sum of exponentials
// with the target logit), the loss is computed in the log domain, and the margin's gradient
// is the head's (margin_head.h). Heads that change non-target logits keep a 2-bit code per
// entry (1/16 of the buffer) so that backward can correct those entries from the
// probabilities alone. Nothing in either pass reads a device value on the host.
#pragma once
#include <torch/torch.h>

#include "partial_fc/classifier/margin_head.h"
#include "partial_fc/runtime/distributed.h"

namespace faceshard {

struct MarginSoftmaxOptions {
  // The head (margin_head.h), owned by the caller and alive until backward has run; its
  // state advances once per forward.
  MarginHead* head = nullptr;
  // Seed and forward count for heads that draw per step (ElasticFace).
  uint64_t seed = 0;
  int64_t forward = 0;
  // The type E and W enter the GEMMs in: kFloat, or kBFloat16 / kHalf to run them in the
  // body's precision (the backend accumulates in fp32); the [N, S] buffer and everything
  // after the GEMM stay fp32.
  at::ScalarType gemm_dtype = at::kFloat;
  // Reduced-precision GEMMs convert W and the buffer in chunks of this many classes, so no
  // full-size low-precision copy exists at any time.
  int64_t chunk_classes = 2048;
};

// emb: [N, d] fp32, rows L2-normalised (differentiable); weight: [S, d] fp32, this rank's
// (sampled) centres, not normalised (differentiable); target: [N] int64 on the same
// device, the row's class column in `weight` when this rank owns it, else -1. Returns the
// mean over the N rows of -log softmax(margin(logits))[target]; `accuracy` (optional)
// receives the global top-1 accuracy over the classes taking part (0-dim, no host sync).
// Backward may run once (the saved probabilities become the gradient in place).
at::Tensor margin_softmax_loss(const at::Tensor& emb, const at::Tensor& weight, const at::Tensor& target,
                               const at::Tensor& norms, const MarginSoftmaxOptions& options, Distributed& dist,
                               at::Tensor* accuracy = nullptr);

}  // namespace faceshard
