#include "partial_fc/classifier/tensor_hash.h"

namespace faceshard::tensor_hash {
namespace {

at::Tensor xorshift(const at::Tensor& x, int64_t s) { return at::bitwise_xor(x, at::bitwise_right_shift(x, s)); }

}  // namespace

at::Tensor mul32(const at::Tensor& x, uint32_t c) {
  const int64_t lo = c & 0xffffU, hi = c >> 16;
  return (x * lo + at::bitwise_left_shift(at::bitwise_and(x * hi, 0xffff), 16)).bitwise_and_(kMask32);
}

at::Tensor mix32(const at::Tensor& x) {
  at::Tensor y = mul32(xorshift(x, 16), 0x7feb352dU);
  y = mul32(xorshift(y, 15), 0x846ca68bU);
  return xorshift(y, 16);
}

}  // namespace faceshard::tensor_hash
