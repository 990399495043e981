// PReLU's backward as one CUDA pass: dx = x > 0 ? dy : a_c * dy, and the slopes' gradient
// dw_c = sum of dy * x where x <= 0, summed in registers and shared memory and added once
// per block, instead of ATen's input-sized slope-gradient temporary and its reduction.
// Plain CUDA on raw pointers (the tensors stay on the C++ side, models/prelu.cpp), so that
// nvcc sees none of LibTorch's flags. Checked against ATen by PReLUCuda.* on a GPU.
#pragma once
#include <cstdint>

namespace faceshard {

enum class PReLUCudaType { Float, BFloat16, Half };

// x, dy, dx: `planes` x `plane_len` elements of `type`, contiguous, where plane p's slope is
// a[p % channels] (NCHW: planes = N*C, plane_len = H*W; one slope: channels = 1, any
// split). dw: `channels` floats, zeroed here, then the sums added.
void prelu_backward_planes_cuda(PReLUCudaType type, const void* x, const void* dy, void* dx, const float* a, float* dw,
                                int64_t planes, int64_t plane_len, int64_t channels, void* stream);
// Channels-last: `rows` x `channels` elements, element (r, c)'s slope a[c]. channels <= 2048.
void prelu_backward_rows_cuda(PReLUCudaType type, const void* x, const void* dy, void* dx, const float* a, float* dw,
                              int64_t rows, int64_t channels, void* stream);
constexpr int64_t kPReLUCudaMaxRowChannels = 2048;

}  // namespace faceshard
