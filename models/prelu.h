// PReLU as the backbones run it: y = x where x > 0, a_c * x elsewhere (one slope per
// channel, dimension 1), forward with ATen's kernel. Its backward on the CPU is one pass over
// x and dy per channel plane (NCHW) or per pixel row (channels-last) that writes dx and sums
// the slopes' gradient, in fp32 with fp64 sums across planes; ATen's CPU backward (a scalar
// kernel writing a full-size slope-gradient tensor that a reduction then sums) costs a sixth
// of a MobileFaceNet step. On a GPU (fp32, bf16, fp16; NCHW or channels-last) the backward is
// one CUDA pass (prelu_cuda.h) that writes dx and sums the slopes' gradient in registers
// and shared memory. Other cases take ATen's backward, which the tests compare both with.
#pragma once
#include <torch/torch.h>

namespace faceshard {

// x [N, C, ...] (any memory format), weight [C] or [1]: the module's parameter.
torch::Tensor prelu(const torch::Tensor& x, const torch::Tensor& weight);

// Whether PReLU's backward takes faceshard's own passes (default) or always ATen's, for the
// whole process (model.prelu_kernel; the comparison).
void set_prelu_own_pass(bool on);

// The backward alone: (dx, dweight) for upstream dy. `own_pass` false forces ATen's
// backward (tests and benchmarks compare the two).
std::tuple<torch::Tensor, torch::Tensor> prelu_backward(const torch::Tensor& dy, const torch::Tensor& x,
                                                        const torch::Tensor& weight, bool own_pass = true);

}  // namespace faceshard
