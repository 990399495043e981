// What the two margin softmax passes (margin_softmax.h: the logits in one buffer;
// streamed_softmax.h: chunk by chunk, never held) share: the columns of a step read from the
// shard a chunk at a time, in fp32 whatever the weight's storage, and the GEMMs in the body's
// precision with an fp32 result.
#pragma once
#include <algorithm>

#include <torch/torch.h>

namespace faceshard::softmax_columns {

// A low-precision GEMM for an fp32 destination: CUDA computes an fp32 result directly (mm's
// out_dtype); the CPU backend returns the input type, which the caller converts.
inline at::Tensor mm_low(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_cuda()) return at::mm(a, b, at::kFloat);
  return at::mm(a, b);
}

// Columns [j, j + n) of the step in fp32: rows of w (fp32 or bf16 storage), through `rows`
// (sorted local indices) when sampled.
inline at::Tensor columns(const at::Tensor& w, const at::Tensor& rows, int64_t j, int64_t n) {
  at::Tensor c = rows.defined() ? w.index_select(0, rows.narrow(0, j, n)) : w.narrow(0, j, n);
  return c.scalar_type() == at::kFloat ? c : c.to(at::kFloat);
}

// Row-wise dot products of two [S, d] tensors: on the CPU in chunks of rows small enough for
// the product to stay in cache (no [S, d] temporary); on a GPU in one pass (chunks would be
// a kernel launch per 256 rows).
inline at::Tensor row_dot(const at::Tensor& x, const at::Tensor& y) {
  if (!x.device().is_cpu()) return (x * y).sum(1);
  constexpr int64_t kRows = 256;
  at::Tensor out = at::empty({x.size(0)}, x.options());
  for (int64_t j = 0; j < x.size(0); j += kRows) {
    const int64_t n = std::min(kRows, x.size(0) - j);
    at::Tensor dst = out.narrow(0, j, n);
    at::sum_out(dst, x.narrow(0, j, n) * y.narrow(0, j, n), {1});
  }
  return out;
}

}  // namespace faceshard::softmax_columns
