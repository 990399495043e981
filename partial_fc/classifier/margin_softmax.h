// Distributed margin softmax cross-entropy. Each rank holds the cosines of every row of
// the global batch against ITS classes; the softmax runs across ranks with two small
// all-reduces (row max; row sum of exponentials with the target logit) and the backward pass
// is entirely local (softmax minus one-hot, scaled).
#pragma once
#include <torch/torch.h>

#include "partial_fc/runtime/distributed.h"
#include "partial_fc/classifier/margin.h"

namespace faceshard {

// cos: [N, S] cosines (computed in fp32 whatever the backbone's precision), N = global
// batch, S = this rank's (sampled) classes. target: [N] int64, the column of the row's
// class when this rank owns it, else -1. Returns the loss, the mean over the N rows of
// -log softmax(margin(logits))[target]; `accuracy` (optional) receives the global top-1
// accuracy of the batch over the classes taking part (a 0-dim tensor, no host sync).
// Backward may run once (the saved probabilities become the gradient in place).
at::Tensor margin_softmax_cross_entropy(const at::Tensor& cos, const at::Tensor& target, const CombinedMargin& margin,
                                        Distributed& dist, at::Tensor* accuracy = nullptr);

}  // namespace faceshard
