#include "partial_fc/classifier/stochastic_round.h"

#include "partial_fc/classifier/tensor_hash.h"

#ifdef FACESHARD_WITH_CUDA
#include <c10/cuda/CUDAStream.h>

#include "partial_fc/classifier/stochastic_round_cuda.h"
#include "base/cuda_kernel_check.h"
#endif

namespace faceshard {
namespace {

using tensor_hash::kMask32;
using tensor_hash::mix32;

at::Tensor mix_in(const at::Tensor& k, const at::Tensor& v) { return mix32(at::bitwise_xor(k, v)); }

}  // namespace

at::Tensor sr_row_keys(uint64_t seed, int64_t step, const at::Tensor& classes) {
  torch::NoGradGuard ng;
  // The part that does not depend on the class, as sr_row_key computes it.
  using sr_detail::mix32;
  const auto st = static_cast<uint64_t>(step);
  uint32_t k = mix32(static_cast<uint32_t>(seed) ^ sr_detail::kGolden);
  k = mix32(k ^ static_cast<uint32_t>(seed >> 32));
  k = mix32(k ^ static_cast<uint32_t>(st));
  k = mix32(k ^ static_cast<uint32_t>(st >> 32));
  const at::Tensor c = classes.to(at::kLong);
  const at::Tensor lo = c.bitwise_and(kMask32), hi = at::bitwise_right_shift(c, 32).bitwise_and_(kMask32);
  return mix_in(mix_in(at::full_like(c, static_cast<int64_t>(k)), lo), hi);
}

at::Tensor stochastic_round_bf16(const at::Tensor& rows, const at::Tensor& keys) {
  torch::NoGradGuard ng;
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && keys.dim() == 1 && keys.size(0) == rows.size(0),
              "stochastic_round_bf16: fp32 rows [n, d] and one key per row, got ", rows.sizes(), " and ", keys.sizes());
  const int64_t d = rows.size(1);
#ifdef FACESHARD_WITH_CUDA
  if (rows.is_cuda()) {  // one pass (stochastic_round_cuda.h)
    const at::Tensor x = rows.contiguous(), k = keys.to(rows.device(), at::kLong).contiguous();
    at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
    check_cuda_kernel(stochastic_round_bf16_cuda(x.data_ptr<float>(), k.data_ptr<int64_t>(),
                                                 reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), x.size(0),
                                                 d, c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
                      "stochastic_round_bf16 (partial_fc/classifier/stochastic_round_cuda.cu)");
    return out;
  }
#endif
  const at::Tensor element =
      (at::arange(d, keys.options()) * static_cast<int64_t>(sr_detail::kGolden)).bitwise_and_(kMask32);
  const at::Tensor r = at::bitwise_right_shift(mix32(at::bitwise_xor(keys.unsqueeze(1), element.unsqueeze(0))), 16);
  const at::Tensor x = rows.contiguous();
  // The fp32 bits as int64 (sign-extended: adding to them and clearing the low half is the
  // same on the two's complement as on the bit pattern), plus r, the low 16 bits cut.
  at::Tensor bits = x.view(at::kInt).to(at::kLong).add_(r).bitwise_and_(~int64_t(0xffff));
  at::Tensor rounded = bits.to(at::kInt).view(at::kFloat).to(at::kBFloat16);
  // inf rounds to nearest (its low bits are not a fraction to round); NaN becomes 0x7fc0,
  // sr_round's (c10::BFloat16's scalar conversion): ATen's vectorised conversion gives 0xffff
  // on AVX2/AVX-512 CPUs, its scalar one 0x7fc0.
  const at::Tensor nan = at::full({}, int64_t(0x7fc0), rounded.options().dtype(at::kShort)).view(at::kBFloat16);
  return at::where(x.isfinite(), rounded, at::where(x.isnan(), nan, x.to(at::kBFloat16)));
}

at::Tensor RowRounding::round(const at::Tensor& rows, const at::Tensor& index, int64_t first,
                              at::ScalarType dtype) const {
  if (dtype == rows.scalar_type()) return rows;
  TORCH_CHECK(dtype == at::kBFloat16, "RowRounding: rows are stored in fp32 or bf16, not ", dtype);
  if (nearest) return rows.to(dtype);
  const at::Tensor local =
      index.defined() ? index : at::arange(first, first + rows.size(0), rows.options().dtype(at::kLong));
  return stochastic_round_bf16(rows, sr_row_keys(seed, step, local.to(at::kLong) + class_start));
}

void RowRounding::count(const at::Tensor& old, const at::Tensor& rows, const at::Tensor& stored) const {
  if (!lost.defined()) return;
  torch::NoGradGuard ng;
  const at::Tensor moved = rows != old.to(at::kFloat);
  at::Tensor(lost).narrow(0, 0, 1).add_((moved & (stored == old)).sum().reshape({1}));
  at::Tensor(lost).narrow(0, 1, 1).add_(moved.sum().reshape({1}));
}

}  // namespace faceshard
