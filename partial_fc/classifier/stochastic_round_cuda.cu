#include "partial_fc/classifier/stochastic_round_cuda.h"

#include <cuda_runtime.h>

#include "partial_fc/classifier/sr_hash.h"

namespace faceshard {
namespace {

__global__ void round_rows(const float* __restrict__ rows, const int64_t* __restrict__ keys, uint16_t* __restrict__ out,
                           int64_t n, int64_t d) {
  const int64_t total = n * d;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / d;
    const uint32_t element = static_cast<uint32_t>(i - row * d);
    const uint32_t key = static_cast<uint32_t>(keys[row]);
    const uint32_t r = sr_detail::element_bits(key, element);
    uint32_t bits = __float_as_uint(rows[i]);
    if ((bits & 0x7f800000U) == 0x7f800000U) {
      // inf keeps its bits; every NaN, of either sign and any payload, becomes 0x7fc0: the
      // CPU's (c10::BFloat16, stochastic_round_bf16), not a conversion's that keeps the sign.
      out[i] = (bits & 0x007fffffU) ? static_cast<uint16_t>(0x7fc0U) : static_cast<uint16_t>(bits >> 16);
      continue;
    }
    bits = (bits + r) & 0xffff0000U;
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
}

}  // namespace

cudaError_t stochastic_round_bf16_cuda(const float* rows, const int64_t* keys, uint16_t* out, int64_t n, int64_t d,
                                       void* stream) {
  const int64_t total = n * d;
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8);
  round_rows<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(rows, keys, out, n, d);
  return cudaGetLastError();
}

}  // namespace faceshard
