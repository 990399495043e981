// The stochastic rounding of stochastic_round.h as one CUDA kernel: the tensor operations
// take some twenty passes over int64 temporaries of the rows' size; this takes one read of
// the fp32 rows and one write of the bf16 result. The same bits (sr_row_key's keys,
// sr_bits, sr_round), checked against the CPU by StochasticRoundCuda.SameBitsAsTheCpu.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace faceshard {

// rows [n, d] fp32 contiguous, keys [n] int64 holding uint32 values, out [n, d] bf16 bits;
// device pointers, queued on `stream` (a cudaStream_t). Returns the launch's status (the
// caller raises it). NaN becomes 0x7fc0 whatever its sign, as on the CPU.
[[nodiscard]] cudaError_t stochastic_round_bf16_cuda(const float* rows, const int64_t* keys, uint16_t* out, int64_t n,
                                                     int64_t d, void* stream);

}  // namespace faceshard
