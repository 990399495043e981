// The margin softmax without the logits (loss.logits: streamed). margin_softmax.h holds the
// [N, S] logits of the global batch against the shard's (sampled) centres in one fp32
// buffer: sample_rate x N x 4 bytes per local class, with N = the batch per rank x the
// ranks, so that the classifier's memory per class grows with the number of ranks. This pass
// holds none of it:
//   forward   the columns a chunk at a time: the GEMM, the scale, the head's margin on the
//             target entries (and its changes to the negatives), and per row only a running
//             max and sum of exponentials (rescaled as the max grows), the best plain cosine
//             and the target logit; then the same cross-rank MAX and SUM all-reduces as the
//             buffered pass, and the loss in the log domain;
//   backward  each chunk's logits recomputed with one GEMM, the chunk's gradient
//             G' = dL/dcos / ||w_j|| formed from them and the row's log-sum-exp, and
//             dL/dE = sum over chunks of G'_chunk W_chunk.
// The weight's gradient is deferred as in the buffered pass (DeferredWeightGrad), but
// recomputed: the step's chunked update asks for G' of a chunk of columns and gets it from
// one more GEMM. Memory beyond the centres: E and a few values per row, one chunk of
// logits, and 1 / ||w_j|| (4 bytes per taking-part class), whatever the number of ranks.
// The options, the heads, the accuracy and the gradient conventions are margin_softmax.h's,
// and both give the same loss and gradients to fp32 rounding.
#pragma once
#include <torch/torch.h>

#include "partial_fc/classifier/margin_softmax.h"

namespace faceshard {

// margin_softmax_loss's contract (arguments, loss, accuracy, gradients), computed
// without the [N, S] buffer. The columns are read options.chunk_classes at a time in both
// passes (and in each recomputation of a deferred gradient).
at::Tensor streamed_margin_softmax_loss(const at::Tensor& emb, const at::Tensor& weight, const at::Tensor& target,
                                        const at::Tensor& norms, const MarginSoftmaxOptions& options, Distributed& dist,
                                        at::Tensor* accuracy = nullptr);

}  // namespace faceshard
