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

// The key of one row's rounding at one step (stochastic_round.h's sr_row_key).
FACESHARD_HD uint32_t row_key(uint64_t seed, int64_t step, int64_t global_class) {
  const auto st = static_cast<uint64_t>(step), cl = static_cast<uint64_t>(global_class);
  uint32_t k = mix32(static_cast<uint32_t>(seed) ^ kGolden);
  k = mix32(k ^ static_cast<uint32_t>(seed >> 32));
  k = mix32(k ^ static_cast<uint32_t>(st));
  k = mix32(k ^ static_cast<uint32_t>(st >> 32));
  k = mix32(k ^ static_cast<uint32_t>(cl));
  return mix32(k ^ static_cast<uint32_t>(cl >> 32));
}

}  // namespace faceshard::sr_detail

#undef FACESHARD_HD
