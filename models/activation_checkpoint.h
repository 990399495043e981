// Activation checkpointing: a segment of a network (a ViT block, a run of iresnet blocks)
// runs without keeping its intermediate activations, and backward reruns it (with the RNG
// and autocast state of the first run) to differentiate it. Deep models trade about one
// extra forward for most of their activation memory.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <vector>

namespace faceshard {

using SegmentFn = std::function<torch::Tensor(const torch::Tensor&)>;

// body(x), keeping only x for backward. `params` are the parameters body uses: their
// gradients leave through this node like any other graph leaf's, so DataParallel's
// gradient hooks and its unused-parameter walk see them (no re-entrant backward).
// body must be a pure function of x, its parameters and the RNG: it runs again in backward.
// Without grad mode, or when neither x nor a parameter requires grad, it is plain body(x).
torch::Tensor checkpointed(const SegmentFn& body, const torch::Tensor& x, const std::vector<torch::Tensor>& params);

// True on this thread while a checkpointed segment reruns in backward: layers with training
// side effects (BatchNorm's running statistics) must not apply them a second time.
bool recomputing();

}  // namespace faceshard
