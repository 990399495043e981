// PReLU as the backbones run it: y = x where x > 0, a_c * x elsewhere (one slope per
// channel, dimension 1), forward with ATen's kernel. Its backward on the CPU is one pass over
// x and dy per channel plane (NCHW) or per pixel row (channels-last) that writes dx and sums
// the slopes' gradient, in fp32 with fp64 sums across planes; ATen's CPU backward (a scalar
// kernel writing a full-size slope-gradient tensor that a reduction then sums) costs a sixth
// of a MobileFaceNet step. Other devices and types take ATen's backward (the path a GPU
// runs), which the tests compare the CPU pass with.
#pragma once
#include <torch/torch.h>

namespace faceshard {

// x [N, C, ...] (any memory format), weight [C] or [1]: the module's parameter.
torch::Tensor prelu(const torch::Tensor& x, const torch::Tensor& weight);

// The backward alone: (dx, dweight) for upstream dy. `cpu_pass` false forces ATen's
// backward (tests compare the two).
std::tuple<torch::Tensor, torch::Tensor> prelu_backward(const torch::Tensor& dy, const torch::Tensor& x,
                                                        const torch::Tensor& weight, bool cpu_pass = true);

}  // namespace faceshard
