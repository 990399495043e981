#include "partial_fc/classifier/subcenter.h"

#include <algorithm>
#include <utility>

#include "partial_fc/classifier/softmax_columns.h"

namespace faceshard::subcenter {

using softmax_columns::columns;
using softmax_columns::mm_low;

at::Tensor class_rows(const at::Tensor& classes, int64_t K) {
  const at::Tensor k = at::arange(K, classes.options().dtype(at::kLong));
  return (classes.to(at::kLong).unsqueeze(1) * K + k.unsqueeze(0)).reshape({-1});
}

void reduce_max(const at::Tensor& cos, int64_t K, at::Tensor out, at::Tensor arg) {
  const int64_t N = cos.size(0), n = cos.size(1) / K;
  auto [best, which] = cos.reshape({N, n, K}).max(2);
  out.copy_(best);
  arg.copy_(which);
}

at::Tensor spread(const at::Tensor& g, const at::Tensor& arg, int64_t K) {
  const int64_t N = g.size(0), n = g.size(1);
  at::Tensor out = at::zeros({N, n, K}, g.options());
  out.scatter_(2, arg.to(at::kLong).unsqueeze(2), g.unsqueeze(2));
  return out.view({N, n * K});
}

namespace {
// Classes per chunk: the chunk's rows are o.chunk_classes, as a single-centre pass reads.
int64_t classes_per_chunk(const MarginSoftmaxOptions& o) { return std::max<int64_t>(1, o.chunk_classes / o.subcenters); }

// G' of classes [c, c + m) in rows: g spread to the arg-max rows, times 1 / ||w_r||.
at::Tensor g_rows(const at::Tensor& g, const at::Tensor& arg, const at::Tensor& inv_norm, int64_t K, int64_t c,
                  int64_t m) {
  return spread(g.narrow(1, c, m), arg.narrow(1, c, m), K).mul_(inv_norm.narrow(0, c * K, m * K).unsqueeze(0));
}
}  // namespace

at::Tensor class_cosines(const at::Tensor& e, const at::Tensor& w, const MarginSoftmaxOptions& o, double s,
                         at::Tensor& buf, at::Tensor& arg) {
  const int64_t K = o.subcenters, S = buf.size(1), C = classes_per_chunk(o);
  at::Tensor inv_norm = at::empty({S * K}, e.options().dtype(at::kFloat));
  const at::Tensor e_low = o.gemm_dtype == at::kFloat ? e : e.to(o.gemm_dtype);
  for (int64_t j = 0; j < S; j += C) {
    const int64_t n = std::min(C, S - j);
    const at::Tensor wc = columns(w, o.rows, j * K, n * K);
    at::Tensor inv = inv_norm.narrow(0, j * K, n * K);
    at::linalg_vector_norm_out(inv, wc, 2, {1});
    inv.clamp_min_(1e-12).reciprocal_();  // 1/max(||w||, eps), as torch's normalize divides
    at::Tensor cos = o.gemm_dtype == at::kFloat ? at::mm(e, wc.t()) : mm_low(e_low, wc.to(o.gemm_dtype).t());
    if (cos.scalar_type() != at::kFloat) cos = cos.to(at::kFloat);
    cos.mul_(inv.unsqueeze(0));
    reduce_max(cos, K, buf.narrow(1, j, n), arg.narrow(1, j, n));
  }
  buf.mul_(s);
  return inv_norm;
}

std::pair<at::Tensor, at::Tensor> backward(const at::Tensor& g, const at::Tensor& arg, const at::Tensor& e,
                                           const at::Tensor& w, const at::Tensor& inv_norm,
                                           const MarginSoftmaxOptions& o) {
  torch::NoGradGuard ng;
  const int64_t K = o.subcenters, S = g.size(1), C = classes_per_chunk(o);
  const bool low = o.gemm_dtype != at::kFloat;
  at::Tensor ge = at::zeros({e.size(0), e.size(1)}, e.options().dtype(at::kFloat));
  for (int64_t j = 0; j < S; j += C) {
    const int64_t n = std::min(C, S - j);
    const at::Tensor gc = g_rows(g, arg, inv_norm, K, j, n);
    const at::Tensor wc = columns(w, o.rows, j * K, n * K);
    if (low) ge.add_(mm_low(gc.to(o.gemm_dtype), wc.to(o.gemm_dtype)));
    else ge.addmm_(gc, wc);
  }
  DeferredWeightGrad d;
  d.e = e;
  d.inv_norm = inv_norm;
  d.gemm_dtype = o.gemm_dtype;
  d.row_terms = g;  // finite exactly where G' is (given finite centres)
  d.recompute = [g, arg, inv_norm, K](int64_t first, int64_t n) {
    return row_columns(first, n, K, [&](int64_t c, int64_t m) { return g_rows(g, arg, inv_norm, K, c, m); });
  };
  if (o.deferred) {
    *o.deferred = std::move(d);
    return {ge, at::Tensor()};
  }
  return {ge, d.rows(0, S * K, w.to(at::kFloat))};
}

}  // namespace faceshard::subcenter
