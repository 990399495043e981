#include "partial_fc/classifier/margin_softmax.h"

#include "partial_fc/parallel/saved_value.h"

namespace faceshard {
namespace {

struct MarginSoftmaxFn : public torch::autograd::Function<MarginSoftmaxFn> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& cos_in,
                                                const at::Tensor& target, const CombinedMargin& m, Distributed& dist_ref) {
    Distributed* dist = &dist_ref;
    const double filter = m.interclass_filter, s = m.scale;
    at::Tensor cos = cos_in.to(torch::kFloat).contiguous();
    const int64_t N = cos.size(0);
    at::Tensor rows = (target >= 0).nonzero().view({-1});
    at::Tensor cols = target.index_select(0, rows);
    at::Tensor tc = cos.index({rows, cols});  // cos of the target entries this rank owns

    // One MAX all-reduce for the softmax shift and for the accuracy (plain cosines).
    at::Tensor logits = cos.clone();
    at::Tensor mask;
    if (filter > 0) {
      mask = logits > filter;
      mask.index_put_({rows, cols}, false);
      logits.masked_fill_(mask, 0.0);
    }
    logits.index_put_({rows, cols}, m.target(tc));
    logits.mul_(s);
    at::Tensor maxes = torch::cat({std::get<0>(logits.max(1)), std::get<0>(cos.max(1))});
    dist->all_reduce(maxes, ReduceOp::Max);
    at::Tensor row_max = maxes.narrow(0, 0, N), best_cos = maxes.narrow(0, N, N);

    // One SUM all-reduce for the softmax denominator, the target logit (from its owner)
    // and the number of rows whose target is the best cosine. The loss is computed in the
    // log domain, log(sum exp) + max - target: exact even where the target probability
    // underflows fp32 (a clamped log(p) would cap the loss at 69.08).
    at::Tensor sums = torch::zeros({2 * N + 1}, cos.options());
    sums.narrow(0, N, N).index_put_({rows}, logits.index({rows, cols}));
    sums[2 * N] = (tc >= best_cos.index_select(0, rows)).sum().to(torch::kFloat);
    logits.sub_(row_max.unsqueeze(1)).exp_();
    sums.narrow(0, 0, N).copy_(logits.sum(1));
    dist->all_reduce(sums);
    at::Tensor sum_exp = sums.narrow(0, 0, N);
    logits.div_(sum_exp.unsqueeze(1));  // global softmax, this rank's columns
    at::Tensor loss = (sum_exp.log() + row_max - sums.narrow(0, N, N)).mean();
    at::Tensor acc = sums[2 * N] / static_cast<double>(N);

    ctx->save_for_backward({logits, rows, cols, tc, mask.defined() ? mask : at::Tensor()});
    save_value(ctx, "margin", m);
    ctx->saved_data["dtype"] = static_cast<int64_t>(cos_in.scalar_type());
    ctx->mark_non_differentiable({acc});
    return {loss, acc};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0];  // the probabilities, turned into the gradient in place
    at::Tensor rows = saved[1], cols = saved[2], tc = saved[3], mask = saved[4];
    const CombinedMargin& m = saved_value<CombinedMargin>(ctx, "margin");
    const int64_t N = grad.size(0);
    // d loss / d logit = (p - onehot) / N; d logit / d cos = s (target: s * dt/dc).
    grad.index_put_({rows, cols}, grad.index({rows, cols}) - 1.0);
    grad.mul_(grads[0] * (m.scale / static_cast<double>(N)));
    if (!m.is_identity()) grad.index_put_({rows, cols}, grad.index({rows, cols}) * m.target_grad(tc));
    if (mask.defined()) grad.masked_fill_(mask, 0.0);
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor margin_softmax_cross_entropy(const at::Tensor& cos, const at::Tensor& target, const CombinedMargin& margin,
                                        Distributed& dist, at::Tensor* accuracy) {
  auto out = MarginSoftmaxFn::apply(cos, target, margin, dist);
  if (accuracy) *accuracy = out[1];
  return out[0];
}

}  // namespace faceshard
