#include "partial_fc/classifier/margin_softmax.h"

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

// out [N, S] = a [N, d] . b [S, d]^T
void gemm_forward(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, const MarginSoftmaxOptions& o) {
  if (o.gemm_dtype == at::kFloat) {
    at::mm_out(out, a, b.t());
    return;
  }
  const at::Tensor a_low = a.to(o.gemm_dtype);
  for (int64_t j = 0; j < b.size(0); j += o.chunk_classes) {
    const int64_t n = std::min(o.chunk_classes, b.size(0) - j);
    out.narrow(1, j, n).copy_(mm_low(a_low, b.narrow(0, j, n).to(o.gemm_dtype).t()));
  }
}

// Both backward GEMMs from the same gradient g [N, S]: g^T a [S, d] and g b [N, d] (b is
// [S, d]); in reduced precision each chunk of g is converted once for both.
std::pair<at::Tensor, at::Tensor> gemm_backward(const at::Tensor& g, const at::Tensor& a, const at::Tensor& b,
                                                const MarginSoftmaxOptions& o) {
  if (o.gemm_dtype == at::kFloat) return {at::mm(g.t(), a), at::mm(g, b)};
  at::Tensor gt_a = at::empty({g.size(1), a.size(1)}, a.options().dtype(at::kFloat));
  at::Tensor g_b = at::zeros({g.size(0), b.size(1)}, b.options().dtype(at::kFloat));
  const at::Tensor a_low = a.to(o.gemm_dtype);
  for (int64_t j = 0; j < g.size(1); j += o.chunk_classes) {
    const int64_t n = std::min(o.chunk_classes, g.size(1) - j);
    const at::Tensor g_low = g.narrow(1, j, n).to(o.gemm_dtype);  // [N, n], rows contiguous
    gt_a.narrow(0, j, n).copy_(mm_low(g_low.t(), a_low));
    g_b.add_(mm_low(g_low, b.narrow(0, j, n).to(o.gemm_dtype)));
  }
  return {gt_a, g_b};
}

// dL/dE = g [N, S] . W [S, d] (W = the columns o.rows of w when sampled, read in chunks).
at::Tensor gemm_emb_grad(const at::Tensor& g, const at::Tensor& w, const MarginSoftmaxOptions& o) {
  if (o.gemm_dtype == at::kFloat && !o.rows.defined() && w.scalar_type() == at::kFloat) return at::mm(g, w);
  at::Tensor out = at::zeros({g.size(0), w.size(1)}, w.options().dtype(at::kFloat));
  for (int64_t j = 0; j < g.size(1); j += o.chunk_classes) {
    const int64_t n = std::min(o.chunk_classes, g.size(1) - j);
    const at::Tensor wc = columns(w, o.rows, j, n);
    if (o.gemm_dtype == at::kFloat) out.addmm_(g.narrow(1, j, n), wc);
    else out.add_(mm_low(g.narrow(1, j, n).to(o.gemm_dtype), wc.to(o.gemm_dtype)));
  }
  return out;
}

// Row maxima of a [N, S] buffer into dst [N] (-inf for an empty shard).
void row_max_into(const at::Tensor& buf, at::Tensor dst) {
  if (buf.size(1) == 0) {
    dst.fill_(-INFINITY);
    return;
  }
  at::Tensor indices = at::empty({buf.size(0)}, buf.options().dtype(at::kLong));
  at::max_out(dst, indices, buf, 1);
}

// 2-bit codes of a [N, n] chunk (values 0..3, n a multiple of 4 except in the last chunk)
// packed four to a byte into dst [N, ceil(n / 4)], and back.
void pack_codes(const at::Tensor& codes, at::Tensor dst) {
  const int64_t N = codes.size(0), n = codes.size(1), n4 = dst.size(1);
  at::Tensor padded = codes;
  if (n4 * 4 != n) {
    padded = at::zeros({N, n4 * 4}, codes.options());
    padded.narrow(1, 0, n).copy_(codes);
  }
  const at::Tensor v = padded.view({N, n4, 4});
  dst.copy_(v.select(2, 0) + v.select(2, 1) * 4 + v.select(2, 2) * 16 + v.select(2, 3) * 64);
}
at::Tensor unpack_codes(const at::Tensor& packed, int64_t n) {
  // The shifts made where the codes are (a host-made tensor would be a copy, and on a GPU a
  // wait, in every chunk of every backward).
  const at::Tensor shifts = at::arange(0, 8, 2, packed.options());
  return at::bitwise_and(at::bitwise_right_shift(packed.unsqueeze(2), shifts), 3)
      .reshape({packed.size(0), packed.size(1) * 4})
      .narrow(1, 0, n);
}

struct MarginSoftmaxFn : public torch::autograd::Function<MarginSoftmaxFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& emb, const at::Tensor& weight,
                               const at::Tensor& target, const at::Tensor& norms, const MarginSoftmaxOptions& o,
                               Distributed& dist) {
    MarginHead& head = *o.head;
    const double s = head.scale();
    const int64_t N = emb.size(0), S = (o.rows.defined() ? o.rows.size(0) : weight.size(0)) / o.subcenters;
    const at::Tensor e = emb.detach(), w = weight.detach();
    at::Tensor buf = at::empty({N, S}, e.options().dtype(at::kFloat));
    at::Tensor inv_norm, sub_arg;  // sub_arg: the arg-max sub-centre of each entry (K > 1)
    if (o.subcenters > 1) {
      // Each class's best sub-centre, already scaled to s * cos (inv_norm is per row).
      sub_arg = at::empty({N, S}, e.options().dtype(at::kByte));
      inv_norm = subcenter::class_cosines(e, w, o, s, buf, sub_arg);
    } else if (!o.rows.defined() && w.scalar_type() == at::kFloat) {
      // 1/max(||w_j||, eps), as torch's normalize divides.
      inv_norm = w.norm(2, {1}).clamp_min(1e-12).reciprocal();
      gemm_forward(e, w, buf, o);
    } else {
      // The sampled columns (or those of a bf16 weight) a chunk at a time, in fp32: no copy
      // of them exists whole.
      inv_norm = at::empty({S}, w.options().dtype(at::kFloat));
      const at::Tensor e_low = o.gemm_dtype == at::kFloat ? e : e.to(o.gemm_dtype);
      for (int64_t j = 0; j < S; j += o.chunk_classes) {
        const int64_t n = std::min(o.chunk_classes, S - j);
        const at::Tensor wc = columns(w, o.rows, j, n);
        at::Tensor norms_dst = inv_norm.narrow(0, j, n);
        at::linalg_vector_norm_out(norms_dst, wc, 2, {1});
        at::Tensor dst = buf.narrow(1, j, n);
        if (o.gemm_dtype == at::kFloat) at::mm_out(dst, e, wc.t());
        else dst.copy_(mm_low(e_low, wc.to(o.gemm_dtype).t()));
      }
      inv_norm.clamp_min_(1e-12).reciprocal_();  // once for all chunks
    }
    // One pass makes the scaled cosines s * cos: from here on the buffer holds logits, and
    // what is said of cosines is said at that scale.
    if (o.subcenters == 1) buf.mul_((inv_norm * s).unsqueeze(0));

    // Rows whose class this rank owns: their column, read and written through gather and
    // scatter with the column clamped to 0 for the others, whose values are written back.
    const at::Tensor valid = target >= 0;
    const at::Tensor col = target.clamp_min(0).unsqueeze(1);
    const at::Tensor plain_t = S > 0 ? buf.gather(1, col).squeeze(1) : torch::zeros({N}, buf.options());
    const at::Tensor tc = plain_t.div(s).clamp(-1, 1);
    at::Tensor maxes = at::empty({2 * N}, buf.options());
    // A head that changes only the target logit needs one pass for both row maxima: the best
    // of the other columns (the targets hidden), then the best plain logit (the accuracy's)
    // and the final row maximum are each that or the row's own target value. A head that
    // filters or changes negatives takes the maximum again after its changes.
    const bool target_only = head.interclass_filter() <= 0 && !head.modifies_negatives() && S > 0;
    at::Tensor other_max;
    const at::Tensor no_target = torch::full_like(plain_t, -INFINITY);
    if (target_only) {
      buf.scatter_(1, col, torch::where(valid, no_target, plain_t).unsqueeze(1));
      other_max = at::empty({N}, buf.options());
      row_max_into(buf, other_max);
      at::Tensor best_dst = maxes.narrow(0, N, N);
      at::maximum_out(best_dst, other_max, torch::where(valid, plain_t, no_target));
    } else {
      row_max_into(buf, maxes.narrow(0, N, N));  // s * the best plain cosine: the accuracy
    }

    // The head's view of the whole batch: the same on every rank.
    HeadInputs in;
    in.rows = N;
    in.options = buf.options();
    in.seed = o.seed;
    in.forward = o.forward;
    if (head.needs_norms()) in.norms = norms.detach();
    if (head.needs_target_cosines()) {
      // Each row's target cosine from the rank that owns its column (one [N] all-reduce).
      in.target_cos = torch::where(valid, tc, torch::full_like(tc, -INFINITY));
      dist.all_reduce(in.target_cos, ReduceOp::Max);
    }
    const HeadRows rows = head.begin_forward(in);

    at::Tensor mask;
    if (head.interclass_filter() > 0 && S > 0) {
      mask = buf > head.interclass_filter() * s;
      mask.scatter_(1, col, mask.gather(1, col) & ~valid.unsqueeze(1));  // never the target
      buf.masked_fill_(mask, 0.0);
    }
    at::Tensor codes;  // 2 bits per entry, for the head's backward of non-target entries
    if (head.modifies_negatives() && S > 0) {
      codes = at::empty({N, (S + 3) / 4}, buf.options().dtype(at::kByte));
      for (int64_t j = 0; j < S; j += o.chunk_classes) {
        const int64_t n = std::min(o.chunk_classes, S - j);
        at::Tensor c8 = at::zeros({N, n}, codes.options());
        head.negatives_forward(buf.narrow(1, j, n), c8, rows);
        // The target entries are the target's business (set below): no code.
        const at::Tensor here = valid & (target >= j) & (target < j + n);
        const at::Tensor local = (target - j).clamp(0, n - 1).unsqueeze(1);
        c8.scatter_(1, local, torch::where(here.unsqueeze(1), torch::zeros_like(local, c8.options()), c8.gather(1, local)));
        pack_codes(c8, codes.narrow(1, j / 4, (n + 3) / 4));
      }
    }
    const at::Tensor t = head.target(tc, rows) * s;
    if (S > 0)
      buf.scatter_(1, col, torch::where(valid, t, target_only ? plain_t : buf.gather(1, col).squeeze(1)).unsqueeze(1));
    if (target_only) {
      at::Tensor dst = maxes.narrow(0, 0, N);
      at::maximum_out(dst, other_max, torch::where(valid, t, no_target));
    } else {
      row_max_into(buf, maxes.narrow(0, 0, N));
    }
    dist.all_reduce(maxes, ReduceOp::Max);
    const at::Tensor row_max = maxes.narrow(0, 0, N), best = maxes.narrow(0, N, N);

    // One SUM all-reduce: the softmax denominators, the target logits (from their owners)
    // and the rows whose target is the best cosine. The loss in the log domain,
    // log(sum exp) + max - target, is exact where the target probability underflows fp32.
    at::Tensor sums = torch::zeros({2 * N + 1}, buf.options());
    sums.narrow(0, N, N).copy_(torch::where(valid, t, torch::zeros_like(t)));
    sums.narrow(0, 2 * N, 1).copy_((valid & (tc * s >= best)).sum().to(at::kFloat).reshape({1}));
    buf.sub_(row_max.unsqueeze(1)).exp_();
    if (S > 0) {
      at::Tensor dst = sums.narrow(0, 0, N);
      at::sum_out(dst, buf, {1});
    }
    dist.all_reduce(sums);
    const at::Tensor sum_exp = sums.narrow(0, 0, N);
    buf.div_(sum_exp.unsqueeze(1));  // the global softmax over this rank's columns
    const at::Tensor lse = sum_exp.log() + row_max;  // logit = log(p) + lse
    at::Tensor row_loss = lse - sums.narrow(0, N, N);
    if (std::isfinite(head.row_loss_cap())) row_loss.clamp_max_(head.row_loss_cap());
    at::Tensor loss = row_loss.mean();
    at::Tensor acc = sums[2 * N] / static_cast<double>(N);

    ctx->save_for_backward({buf, e, w, inv_norm, col, valid, tc, mask.defined() ? mask : at::Tensor(),
                            codes.defined() ? codes : at::Tensor(), codes.defined() ? lse : at::Tensor(), sub_arg});
    save_value(ctx, "options", o);
    save_value(ctx, "rows", rows);
    ctx->mark_non_differentiable({acc});
    return {loss, acc};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor g = saved[0];  // the probabilities, turned into the gradient in place
    const at::Tensor &e = saved[1], &w = saved[2], &inv_norm = saved[3], &col = saved[4], &valid = saved[5],
                     &tc = saved[6], &mask = saved[7], &codes = saved[8], &lse = saved[9], &sub_arg = saved[10];
    const MarginSoftmaxOptions& o = saved_value<MarginSoftmaxOptions>(ctx, "options");
    const HeadRows& rows = saved_value<HeadRows>(ctx, "rows");
    const MarginHead& head = *o.head;
    const double s = head.scale();
    const int64_t N = g.size(0), S = g.size(1);
    if (S == 0) {
      if (o.deferred) *o.deferred = DeferredWeightGrad{g, e, inv_norm, o.gemm_dtype, {}, {}, {}, {}, false};
      return {torch::zeros_like(e), o.deferred ? at::Tensor() : torch::zeros_like(w), at::Tensor(), at::Tensor(),
              at::Tensor(), at::Tensor()};
    }
    // Non-target entries the head changed: d(new)/d(old) from the final logits, which the
    // probabilities give back (log p + the row's log-sum-exp).
    if (codes.defined()) {
      for (int64_t j = 0; j < S; j += o.chunk_classes) {
        const int64_t n = std::min(o.chunk_classes, S - j);
        at::Tensor gc = g.narrow(1, j, n);
        head.negatives_backward(gc, gc.log() + lse.unsqueeze(1), unpack_codes(codes.narrow(1, j / 4, (n + 3) / 4), n),
                                rows);
      }
    }
    // d loss / d logit = (p - onehot) / N; d logit / d cos = s (target: s * dt/dc).
    g.scatter_add_(1, col, -valid.to(at::kFloat).unsqueeze(1));
    const at::Tensor coef = (grads[0].defined() ? grads[0] : torch::zeros({}, g.options())) * (s / static_cast<double>(N));
    at::Tensor grad_norms;
    if (head.norm_gradient()) {
      const at::Tensor gt = g.gather(1, col).squeeze(1);  // dL/dlogit at the target, times N
      grad_norms = torch::where(valid, gt * head.target_grad_norm(tc, rows), torch::zeros_like(gt)) * coef;
    }
    if (!head.unit_gradient())
      g.scatter_(1, col, g.gather(1, col) * torch::where(valid, head.target_grad(tc, rows), torch::ones_like(tc)).unsqueeze(1));
    if (mask.defined()) g.masked_fill_(mask, 0.0);
    // One pass: times grad * s / N (the scalar) and 1 / ||w_j|| (per column). Then
    // g' = dL/dcos_ij / ||w_j||, and through cos_ij = (e_i . w_j) / ||w_j||:
    //   dL/de = g' W,   dL/dw_j = M_j - (w_j . M_j) w_j / ||w_j||^2  with M = g'^T E.
    if (o.subcenters > 1) {
      // dL/dcos per class, routed to each entry's arg-max sub-centre (subcenter.h).
      g.mul_(coef);
      auto [ge, gw] = subcenter::backward(g, sub_arg, e, w, inv_norm, o);
      return {ge, gw, at::Tensor(), grad_norms, at::Tensor(), at::Tensor()};
    }
    g.mul_((inv_norm * coef).unsqueeze(0));
    if (o.deferred) {
      // dL/dW is the caller's (DeferredWeightGrad::rows, chunk by chunk): keep G', E and
      // the norms; only dL/dE = G' W flows on.
      *o.deferred = DeferredWeightGrad{g, e, inv_norm, o.gemm_dtype, {}, {}, {}, {}, false};
      return {gemm_emb_grad(g, w, o), at::Tensor(), at::Tensor(), grad_norms, at::Tensor(), at::Tensor()};
    }
    auto [gw, ge] = gemm_backward(g, e, w, o);
    gw.addcmul_(w, (row_dot(w, gw) * inv_norm.pow(2)).unsqueeze(1), -1.0);
    return {ge, gw, at::Tensor(), grad_norms, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor DeferredWeightGrad::raw_rows(int64_t first, int64_t n) const { return raw_of(g_columns(first, n)); }

at::Tensor DeferredWeightGrad::raw_of(const at::Tensor& gc) const {
  torch::NoGradGuard ng;
  if (gemm_dtype == at::kFloat) return at::mm(gc.t(), e);
  at::Tensor gw = mm_low(gc.to(gemm_dtype).t(), e_low.defined() ? e_low : e.to(gemm_dtype));
  return gw.scalar_type() == at::kFloat ? gw : gw.to(at::kFloat);
}

at::Tensor DeferredWeightGrad::rows(int64_t first, int64_t n, const at::Tensor& w) const {
  torch::NoGradGuard ng;
  at::Tensor gw = raw_rows(first, n);
  remove_radial(gw, first, w);
  return gw;
}

void DeferredWeightGrad::remove_radial(at::Tensor& raw, int64_t first, const at::Tensor& w) const {
  torch::NoGradGuard ng;
  raw.addcmul_(w, (row_dot(w, raw) * inv_norm.narrow(0, first, raw.size(0)).pow(2)).unsqueeze(1), -1.0);
}

void check_margin_softmax_inputs(const char* who, const at::Tensor& emb, const at::Tensor& weight,
                                 const at::Tensor& norms, const MarginSoftmaxOptions& options) {
  TORCH_CHECK(emb.dim() == 2 && weight.dim() == 2 && emb.size(1) == weight.size(1), who, ": embeddings ", emb.sizes(),
              " and centres ", weight.sizes(), " do not match");
  TORCH_CHECK(options.chunk_classes > 0 && options.chunk_classes % 4 == 0, who,
              ": chunk_classes must be a positive multiple of 4");
  TORCH_CHECK(options.head != nullptr, who, ": no head");
  TORCH_CHECK(options.subcenters >= 1 &&
                  (options.rows.defined() ? options.rows.size(0) : weight.size(0)) % options.subcenters == 0,
              who, ": the centres are not ", options.subcenters, " per class");
  TORCH_CHECK(!options.rows.defined() || options.deferred, who, ": sampled rows need a deferred gradient");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || options.deferred, who, ": centres stored in ", weight.scalar_type(),
              " need a deferred gradient");
  TORCH_CHECK(!options.head->needs_norms() || (norms.defined() && norms.size(0) == emb.size(0)), who, ": the ",
              options.head->name(), " head needs the rows' feature norms");
}

at::Tensor margin_softmax_loss(const at::Tensor& emb, const at::Tensor& weight, const at::Tensor& target,
                               const at::Tensor& norms, const MarginSoftmaxOptions& options, Distributed& dist,
                               at::Tensor* accuracy) {
  check_margin_softmax_inputs("margin_softmax_loss", emb, weight, norms, options);
  // An autograd input must be a tensor: heads without norms get an empty one.
  auto out = MarginSoftmaxFn::apply(emb, weight, target, norms.defined() ? norms : at::empty({0}, emb.options()),
                                    options, dist);
  if (accuracy) *accuracy = out[1];
  return out[0];
}

}  // namespace faceshard
