// PReLU's backward as one CUDA pass: dx = x > 0 ? dy : a_c * dy, and the slopes' gradient
// dw_c = sum of dy * x where x <= 0, summed in registers and shared memory into one partial
// sum per plane (NCHW) or per block and channel (channels-last), instead of ATen's
// input-sized slope-gradient temporary and its reduction. A second, small kernel adds the
// partial sums of each channel in a fixed order: no atomics, so dw is the same bits on every
// run. Plain CUDA on raw pointers (the tensors stay on the C++ side, models/prelu.cpp), so
// that nvcc sees none of LibTorch's flags. Checked against ATen by PReLUCuda.* on a GPU.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace faceshard {

enum class PReLUCudaType { Float, BFloat16, Half };

// Both launchers queue their work on `stream` (a cudaStream_t) and return the first failed
// CUDA call's status (a launch's included), cudaSuccess otherwise; the caller raises it.
// `workspace`: device floats for the partial sums, as many as the *_workspace function says.

// x, dy, dx: `planes` x `plane_len` elements of `type`, contiguous, where plane p's slope is
// a[p % channels] (NCHW: planes = N*C, plane_len = H*W; one slope: channels = 1, any
// split); planes is a multiple of channels. dw: `channels` floats, written.
int64_t prelu_backward_planes_workspace(int64_t planes);
[[nodiscard]] cudaError_t prelu_backward_planes_cuda(PReLUCudaType type, const void* x, const void* dy, void* dx,
                                                     const float* a, float* dw, float* workspace, int64_t planes,
                                                     int64_t plane_len, int64_t channels, void* stream);
// Channels-last: `rows` x `channels` elements, element (r, c)'s slope a[c]. channels <= 2048.
int64_t prelu_backward_rows_workspace(int64_t rows, int64_t channels);
[[nodiscard]] cudaError_t prelu_backward_rows_cuda(PReLUCudaType type, const void* x, const void* dy, void* dx,
                                                   const float* a, float* dw, float* workspace, int64_t rows,
                                                   int64_t channels, void* stream);
constexpr int64_t kPReLUCudaMaxRowChannels = 2048;

}  // namespace faceshard
