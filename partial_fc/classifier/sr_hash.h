// The counter-based hash of the classifier's stochastic rounding (stochastic_round.h), in one
// place for the host and for CUDA (stochastic_round_cuda.cu): the same bits everywhere.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define FACESHARD_HD __host__ __device__ __forceinline__
#else
#define FACESHARD_HD inline
#endif

namespace faceshard::sr_detail {

// A 32-bit integer hash with full avalanche (two multiply-xorshift rounds).
FACESHARD_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}
constexpr uint32_t kGolden = 0x9e3779b9U;

// The 16 random bits of element `element` of a row keyed `row_key`.
FACESHARD_HD uint32_t element_bits(uint32_t row_key, uint32_t element) { return mix32(row_key ^ (element * kGolden)) >> 16; }

}  // namespace faceshard::sr_detail

#undef FACESHARD_HD
