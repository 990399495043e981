#include "partial_fc/classifier/streamed_softmax.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "partial_fc/classifier/softmax_columns.h"
#include "partial_fc/classifier/subcenter.h"
#include "partial_fc/data_parallel/saved_value.h"

namespace faceshard {
namespace {

using softmax_columns::columns;
using softmax_columns::mm_low;
using softmax_columns::row_dot;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Everything a chunk's logits are made from, the same in forward and in each recomputation.
struct Stream {
  MarginSoftmaxOptions o;  // without `deferred` (the gradient holds a Stream: no cycle)
  HeadRows rows;
  at::Tensor e, e_low;     // [N, d] fp32, and in the GEMMs' type
  at::Tensor w;            // the shard's centres (fp32 or bf16 storage)
  at::Tensor inv_norm;     // [S] fp32 (per row: [S * K] with K sub-centres per class)
  at::Tensor target;       // [N] the row's column, -1 where another rank owns it
  at::Tensor valid;        // [N] target >= 0
  at::Tensor tc;           // [N] the target cosines
  at::Tensor t;            // [N] the head's target logits (s * t(c))
  double s = 1;

  // The centres' rows, and the columns (classes: K rows each).
  int64_t row_count() const { return o.rows.defined() ? o.rows.size(0) : w.size(0); }
  int64_t columns_count() const { return row_count() / o.subcenters; }

  // s * cos of columns [j, j + n) [N, n] fp32; with sub-centres the best of each class's
  // K, and (`arg`) which one it was.
  at::Tensor plain(int64_t j, int64_t n, at::Tensor* arg = nullptr) const {
    const int64_t K = o.subcenters;
    const at::Tensor wc = columns(w, o.rows, j * K, n * K);
    at::Tensor out = o.gemm_dtype == at::kFloat ? at::mm(e, wc.t()) : mm_low(e_low, wc.to(o.gemm_dtype).t());
    if (out.scalar_type() != at::kFloat) out = out.to(at::kFloat);
    if (K == 1) return out.mul_((inv_norm.narrow(0, j, n) * s).unsqueeze(0));
    out.mul_(inv_norm.narrow(0, j * K, n * K).unsqueeze(0));
    at::Tensor best = at::empty({out.size(0), n}, out.options());
    at::Tensor which = at::empty({out.size(0), n}, out.options().dtype(at::kByte));
    subcenter::reduce_max(out, K, best, which);
    if (arg) *arg = which;
    return best.mul_(s);
  }

  // Rows whose target lies in [j, j + n), and each row's column there (clamped for the
  // others, whose entries are written back unchanged).
  std::pair<at::Tensor, at::Tensor> targets_in(int64_t j, int64_t n) const {
    const at::Tensor here = valid & (target >= j) & (target < j + n);
    return {here, (target - j).clamp(0, n - 1).unsqueeze(1)};
  }

  // The final logits of a chunk, as margin_softmax's buffer holds them: the inter-class
  // filter (`mask`), the head's changes to the negatives (`codes`), the target logits.
  at::Tensor final_logits(at::Tensor logits, int64_t j, int64_t n, at::Tensor* mask, at::Tensor* codes) const {
    MarginHead& head = *o.head;
    const auto [here, local] = targets_in(j, n);
    if (head.interclass_filter() > 0) {
      at::Tensor m = logits > head.interclass_filter() * s;
      m.scatter_(1, local, m.gather(1, local) & ~here.unsqueeze(1));  // never the target
      logits.masked_fill_(m, 0.0);
      if (mask) *mask = m;
    }
    if (head.modifies_negatives()) {
      at::Tensor c8 = at::zeros({logits.size(0), n}, logits.options().dtype(at::kByte));
      head.negatives_forward(logits, c8, rows);
      c8.scatter_(1, local,
                  torch::where(here.unsqueeze(1), torch::zeros_like(local, c8.options()), c8.gather(1, local)));
      if (codes) *codes = c8;
    }
    logits.scatter_(1, local, torch::where(here, t, logits.gather(1, local).squeeze(1)).unsqueeze(1));
    return logits;
  }

  // G' of columns [j, j + n): (p - onehot) with the head's corrections, times coef (the
  // loss's gradient times s / N) and 1 / ||w_j||. p = exp(logit - row max) / sum, as the
  // buffered pass forms it: near 1 (a well-classified row's target, where p - 1 is all that
  // is left) that is exact to fp32's rounding of 1, where exp(logit - log-sum-exp) would
  // carry the rounding of two numbers of the logits' size (s = 64: 4e-6 each).
  at::Tensor gradient(int64_t j, int64_t n, const at::Tensor& row_max, const at::Tensor& sum_exp,
                      const at::Tensor& coef) const {
    const MarginHead& head = *o.head;
    at::Tensor mask, codes, arg;
    const at::Tensor logits = final_logits(plain(j, n, &arg), j, n, &mask, &codes);
    at::Tensor g = (logits - row_max.unsqueeze(1)).exp_().div_(sum_exp.unsqueeze(1));
    if (codes.defined()) head.negatives_backward(g, logits, codes, rows);
    const auto [here, local] = targets_in(j, n);
    g.scatter_add_(1, local, -here.to(at::kFloat).unsqueeze(1));
    if (!head.unit_gradient())
      g.scatter_(1, local,
                 g.gather(1, local) * torch::where(here, head.target_grad(tc, rows), torch::ones_like(tc)).unsqueeze(1));
    if (mask.defined()) g.masked_fill_(mask, 0.0);
    if (o.subcenters == 1) return g.mul_((inv_norm.narrow(0, j, n) * coef).unsqueeze(0));
    // Per row (K per class): the class's dL/dcos at its arg-max sub-centre (subcenter.h).
    const int64_t K = o.subcenters;
    return subcenter::spread(g.mul_(coef), arg, K).mul_(inv_norm.narrow(0, j * K, n * K).unsqueeze(0));
  }
};

struct StreamedSoftmaxFn : public torch::autograd::Function<StreamedSoftmaxFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& emb, const at::Tensor& weight,
                               const at::Tensor& target, const at::Tensor& norms, const MarginSoftmaxOptions& o,
                               Distributed& dist) {
    MarginHead& head = *o.head;
    Stream st;
    st.o = o;
    st.o.deferred.reset();
    st.s = head.scale();
    st.e = emb.detach();
    st.e_low = o.gemm_dtype == at::kFloat ? st.e : st.e.to(o.gemm_dtype);
    st.w = weight.detach();
    st.target = target;
    st.valid = target >= 0;
    const double s = st.s;
    const int64_t K = o.subcenters, R = st.row_count();
    // Classes per chunk: with sub-centres a chunk's rows are still chunk_classes.
    const int64_t N = st.e.size(0), S = st.columns_count();
    const int64_t C = K == 1 ? o.chunk_classes : std::max<int64_t>(1, o.chunk_classes / K);
    st.o.chunk_classes = C;
    const auto fo = st.e.options().dtype(at::kFloat);

    // 1/max(||w_j||, eps) of every row, as torch's normalize divides.
    st.inv_norm = at::empty({R}, fo);
    for (int64_t j = 0; j < R; j += o.chunk_classes) {
      const int64_t n = std::min(o.chunk_classes, R - j);
      st.inv_norm.narrow(0, j, n).copy_(columns(st.w, o.rows, j, n).norm(2, {1}).clamp_min(1e-12).reciprocal());
    }
    // The target cosines from the targets' own columns, in the GEMMs' precision (with
    // sub-centres the best of the target class's K rows).
    const at::Tensor col = target.clamp_min(0);
    if (S > 0) {
      const at::Tensor el = st.e_low.to(at::kFloat);
      for (int64_t k = 0; k < K; ++k) {
        const at::Tensor r = K == 1 ? col : col * K + k;
        const at::Tensor wt = columns(st.w, o.rows.defined() ? o.rows.index_select(0, r) : r, 0, N);
        const at::Tensor wl = wt.to(o.gemm_dtype).to(at::kFloat);
        const at::Tensor c = (el * wl).sum(1).mul_(st.inv_norm.index_select(0, r)).clamp_(-1, 1);
        st.tc = k == 0 ? c : at::maximum(st.tc, c);
      }
    } else {
      st.tc = torch::zeros({N}, fo);
    }
    HeadInputs in;
    in.rows = N;
    in.options = fo;
    in.seed = o.seed;
    in.forward = o.forward;
    if (head.needs_norms()) in.norms = norms.detach();
    if (head.needs_target_cosines()) {
      in.target_cos = torch::where(st.valid, st.tc, torch::full_like(st.tc, -INFINITY));
      dist.all_reduce(in.target_cos, ReduceOp::Max);
    }
    st.rows = head.begin_forward(in);
    st.t = head.target(st.tc, st.rows) * s;

    // One pass over the columns: the running max and sum of exponentials of each row, and
    // its best plain cosine (the accuracy).
    at::Tensor maxes = torch::full({2 * N}, -INFINITY, fo);
    at::Tensor run_max = maxes.narrow(0, 0, N), best = maxes.narrow(0, N, N);
    at::Tensor run_sum = torch::zeros({N}, fo);
    // Each row's plain target logit as the pass computes it, for the accuracy: compared with
    // the best of the same values, a target that is the best counts exactly.
    at::Tensor plain_target = torch::full({N}, -INFINITY, fo);
    // A head that changes only the target logit needs one maximum per chunk (of the other
    // columns, the targets hidden): the best plain logit and the chunk's final maximum are
    // each that or the row's own target value (margin_softmax.cpp does the same).
    const bool target_only = head.interclass_filter() <= 0 && !head.modifies_negatives();
    const at::Tensor none = torch::full({N}, -INFINITY, fo);
    for (int64_t j = 0; j < S; j += C) {
      const int64_t n = std::min(C, S - j);
      at::Tensor logits = st.plain(j, n);
      const auto [here, local] = st.targets_in(j, n);
      const at::Tensor pt = logits.gather(1, local).squeeze(1);
      plain_target = torch::where(here, pt, plain_target);
      at::Tensor chunk_max;
      if (target_only) {
        logits.scatter_(1, local, torch::where(here, none, pt).unsqueeze(1));
        const at::Tensor other = std::get<0>(logits.max(1));
        at::maximum_out(best, best, at::maximum(other, torch::where(here, pt, none)));
        logits.scatter_(1, local, torch::where(here, st.t, pt).unsqueeze(1));
        chunk_max = at::maximum(other, torch::where(here, st.t, none));
      } else {
        at::maximum_out(best, best, std::get<0>(logits.max(1)));
        st.final_logits(logits, j, n, nullptr, nullptr);
        chunk_max = std::get<0>(logits.max(1));
      }
      const at::Tensor m = at::maximum(run_max, chunk_max);
      run_sum.mul_((run_max - m).exp_()).add_(logits.sub_(m.unsqueeze(1)).exp_().sum(1));
      run_max.copy_(m);
    }
    const at::Tensor local_max = run_max.clone();
    dist.all_reduce(maxes, ReduceOp::Max);
    const at::Tensor row_max = maxes.narrow(0, 0, N);
    best = maxes.narrow(0, N, N);

    // The SUM all-reduce of the buffered pass: the denominators (each rank's rescaled to the
    // global max), the target logits from their owners, the rows whose target is best.
    at::Tensor sums = torch::zeros({2 * N + 1}, fo);
    if (S > 0) sums.narrow(0, 0, N).copy_(run_sum * (local_max - row_max).exp_());
    sums.narrow(0, N, N).copy_(torch::where(st.valid, st.t, torch::zeros_like(st.t)));
    sums.narrow(0, 2 * N, 1).copy_((st.valid & (plain_target >= best)).sum().to(at::kFloat).reshape({1}));
    dist.all_reduce(sums);
    const at::Tensor sum_exp = sums.narrow(0, 0, N);
    const at::Tensor lse = sum_exp.log() + row_max;
    at::Tensor row_loss = lse - sums.narrow(0, N, N);
    if (std::isfinite(head.row_loss_cap())) row_loss.clamp_max_(head.row_loss_cap());
    at::Tensor loss = row_loss.mean();
    at::Tensor acc = sums[2 * N] / static_cast<double>(N);

    ctx->save_for_backward({row_max, sum_exp});
    save_value(ctx, "stream", std::move(st));
    save_value(ctx, "deferred", o.deferred);
    ctx->mark_non_differentiable({acc});
    return {loss, acc};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &row_max = saved[0], &sum_exp = saved[1];
    const Stream& st = saved_value<Stream>(ctx, "stream");
    const std::shared_ptr<DeferredWeightGrad> deferred =
        saved_value<std::shared_ptr<DeferredWeightGrad>>(ctx, "deferred");
    const MarginHead& head = *st.o.head;
    const int64_t N = st.e.size(0), S = st.columns_count(), C = st.o.chunk_classes, K = st.o.subcenters;
    const at::Tensor coef =
        (grads[0].defined() ? grads[0] : torch::zeros({}, row_max.options())) * (st.s / static_cast<double>(N));
    at::Tensor grad_norms;
    if (head.norm_gradient()) {
      // dL/dlogit at the target, times N: p_target - 1.
      const at::Tensor gt = (st.t - row_max).exp().div_(sum_exp) - 1;
      grad_norms =
          torch::where(st.valid, gt * head.target_grad_norm(st.tc, st.rows), torch::zeros_like(gt)) * coef;
    }
    if (deferred) {
      // dL/dW is the caller's, a chunk of columns at a time: each chunk's G' recomputed, or
      // handed to the caller's update as it is formed here (on_chunk).
      auto stream = std::make_shared<Stream>(st);
      deferred->g = at::Tensor();
      deferred->e = st.e;
      deferred->e_low = st.e_low;
      deferred->inv_norm = st.inv_norm;
      deferred->gemm_dtype = st.o.gemm_dtype;
      // G' of rows [first, first + n): with sub-centres those of the classes that cover them.
      deferred->recompute = [stream, row_max, sum_exp, coef, K](int64_t first, int64_t n) {
        if (K == 1) return stream->gradient(first, n, row_max, sum_exp, coef);
        return subcenter::row_columns(first, n, K, [&](int64_t c, int64_t m) {
          return stream->gradient(c, m, row_max, sum_exp, coef);
        });
      };
      deferred->row_terms = torch::cat({row_max, sum_exp, coef.reshape({1})});
    }
    at::Tensor ge = torch::zeros_like(st.e);
    at::Tensor gw;
    if (!deferred) gw = torch::zeros({S * K, st.e.size(1)}, st.e.options());
    const bool low = st.o.gemm_dtype != at::kFloat;
    for (int64_t j = 0; j < S; j += C) {
      const int64_t n = std::min(C, S - j);
      const at::Tensor g = st.gradient(j, n, row_max, sum_exp, coef);  // [N, n * K]: rows
      const at::Tensor wc = columns(st.w, st.o.rows, j * K, n * K);
      const at::Tensor g_low = low ? g.to(st.o.gemm_dtype) : g;
      if (low) ge.add_(mm_low(g_low, wc.to(st.o.gemm_dtype)));
      else ge.addmm_(g, wc);
      if (gw.defined()) {
        at::Tensor gwc = gw.narrow(0, j * K, n * K);
        if (low) gwc.copy_(mm_low(g_low.t(), st.e_low));
        else at::mm_out(gwc, g.t(), st.e);
        gwc.addcmul_(wc, (row_dot(wc, gwc) * st.inv_norm.narrow(0, j * K, n * K).pow(2)).unsqueeze(1), -1.0);
      }
      // The chunk's rows are not read again in this backward: the caller may move them.
      if (deferred && deferred->on_chunk) deferred->on_chunk(j * K, n * K, g);
    }
    if (deferred && deferred->on_chunk) deferred->applied = true;
    return {ge, gw, at::Tensor(), grad_norms, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor streamed_margin_softmax_loss(const at::Tensor& emb, const at::Tensor& weight, const at::Tensor& target,
                                        const at::Tensor& norms, const MarginSoftmaxOptions& options, Distributed& dist,
                                        at::Tensor* accuracy) {
  check_margin_softmax_inputs("streamed_margin_softmax_loss", emb, weight, norms, options);
  auto out = StreamedSoftmaxFn::apply(emb, weight, target, norms.defined() ? norms : at::empty({0}, emb.options()),
                                      options, dist);
  if (accuracy) *accuracy = out[1];
  return out[0];
}

}  // namespace faceshard
