// sr_hash.h's mix32 as tensor operations, on whatever device the tensor lives: int64 tensors
// holding uint32 values, the arithmetic modulo 2^32 without a signed overflow (a 32 x 32-bit
// product does not fit an int64, so each constant multiplies in two 16-bit halves). The
// stochastic rounding's keys and ElasticFace's margin draws hash with it, so that the CPU and
// a GPU give the same bits.
#pragma once
#include <cstdint>

#include <torch/torch.h>

namespace faceshard::tensor_hash {

constexpr int64_t kMask32 = 0xffffffffLL;

// x * c modulo 2^32 for x in [0, 2^32).
at::Tensor mul32(const at::Tensor& x, uint32_t c);
// sr_detail::mix32 of every element.
at::Tensor mix32(const at::Tensor& x);

}  // namespace faceshard::tensor_hash
