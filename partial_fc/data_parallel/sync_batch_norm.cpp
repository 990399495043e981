#include "partial_fc/data_parallel/sync_batch_norm.h"

#include "partial_fc/data_parallel/saved_value.h"

namespace faceshard {
namespace {

std::vector<int64_t> reduce_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

std::vector<int64_t> channel_shape(const at::Tensor& x) {
  std::vector<int64_t> s(x.dim(), 1);
  s[1] = x.size(1);
  return s;
}

struct SyncBatchNormFn : public torch::autograd::Function<SyncBatchNormFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& weight,
                            const at::Tensor& bias, at::Tensor running_mean, at::Tensor running_var, double momentum,
                            double eps, Distributed& dist_ref) {
    Distributed* dist = &dist_ref;
    const int64_t C = x_in.size(1);
    const bool cuda = x_in.is_cuda();
    at::Tensor x = x_in.is_contiguous(at::MemoryFormat::ChannelsLast) ? x_in : x_in.contiguous();
    const int64_t n_local = C > 0 ? x.numel() / C : 0;
    at::Tensor mean, invstd, count_all;
    int64_t n_total = 0;
    if (cuda) {
      // ATen's fused kernels: per-rank mean/invstd, gathered with counts, merged on device.
      at::Tensor m, is;
      if (n_local > 0) {
        std::tie(m, is) = at::batch_norm_stats(x, eps);
      } else {
        m = torch::zeros({C}, x.options().dtype(torch::kFloat));
        is = torch::zeros({C}, x.options().dtype(torch::kFloat));
      }
      at::Tensor combined = torch::cat({m.to(torch::kFloat), is.to(torch::kFloat),
                                        torch::full({1}, static_cast<float>(n_local), m.options().dtype(torch::kFloat))});
      at::Tensor all = dist->all_gather(combined.unsqueeze(0));  // [W, 2C+1]
      at::Tensor counts = all.select(1, 2 * C);
      at::Tensor keep = counts >= 1;  // ranks without rows contribute nothing
      all = all.index({keep});
      count_all = all.select(1, 2 * C);
      n_total = static_cast<int64_t>(count_all.sum().item<double>());
      std::tie(mean, invstd) = at::batch_norm_gather_stats_with_counts(
          x, all.narrow(1, 0, C), all.narrow(1, C, C), running_mean, running_var, momentum, eps, count_all);
    } else {
      // Per-rank mean and sum of squared deviations in float64, merged exactly (Chan et
      // al.), and the normalisation in float64: BatchNorm's backward cancels most of the
      // gradient that reaches it (the batch mean of dy and its projection on x - mean), so
      // its fp32 rounding, amplified, would depend on how the batch is split over the ranks.
      // In float64 a step computes the same on any number of ranks to fp32 rounding of its
      // result (e2e.elastic_invariance).
      at::Tensor xd = x.to(torch::kDouble);
      auto dims = reduce_dims(x);
      at::Tensor m = n_local > 0 ? xd.mean(dims) : torch::zeros({C}, torch::kDouble);
      at::Tensor m2 = n_local > 0 ? (xd - m.view(channel_shape(x))).pow(2).sum(dims) : torch::zeros({C}, torch::kDouble);
      at::Tensor packed =
          torch::cat({m, m2, torch::full({1}, static_cast<double>(n_local), torch::kDouble)}).unsqueeze(0);
      at::Tensor all = dist->world_size() > 1 ? dist->all_gather(packed) : packed;  // [W, 2C+1]
      at::Tensor n_r = all.select(1, 2 * C).unsqueeze(1);                           // [W,1]
      const double N = n_r.sum().item<double>();
      n_total = static_cast<int64_t>(N);
      TORCH_CHECK(N > 0, "SyncBatchNorm: no rank has any rows in this batch");
      at::Tensor mean_r = all.narrow(1, 0, C), m2_r = all.narrow(1, C, C);
      at::Tensor gmean = (mean_r * n_r).sum(0) / N;
      at::Tensor gm2 = (m2_r + n_r * (mean_r - gmean).pow(2)).sum(0);
      at::Tensor var = gm2 / N;
      mean = gmean;                   // float64 on the CPU path
      invstd = (var + eps).rsqrt();
      if (running_mean.defined()) {
        torch::NoGradGuard ng;
        running_mean.mul_(1 - momentum).add_(gmean.to(running_mean.scalar_type()), momentum);
        at::Tensor unbiased = N > 1 ? var * (N / (N - 1)) : var;
        running_var.mul_(1 - momentum).add_(unbiased.to(running_var.scalar_type()), momentum);
      }
      count_all = torch::full({1}, N, torch::kDouble);
    }
    at::Tensor out;
    if (cuda) {
      out = at::batch_norm_elemt(x, weight, bias, mean, invstd, eps);
    } else {
      auto cs = channel_shape(x);
      at::Tensor scale = invstd.view(cs);
      if (weight.defined()) scale = scale * weight.view(cs).to(torch::kDouble);
      at::Tensor y = (x.to(torch::kDouble) - mean.view(cs)) * scale;
      if (bias.defined()) y = y + bias.view(cs).to(torch::kDouble);
      out = y.to(x.scalar_type());
    }
    ctx->save_for_backward({x, weight, mean, invstd, count_all});
    save_value(ctx, "dist", dist);
    ctx->saved_data["n_total"] = n_total;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor x = saved[0], weight = saved[1], mean = saved[2], invstd = saved[3], count_all = saved[4];
    Distributed* dist = saved_value<Distributed*>(ctx, "dist");
    const double N = static_cast<double>(ctx->saved_data["n_total"].toInt());
    const int64_t C = x.size(1);
    at::Tensor dy = grads[0].is_contiguous(at::MemoryFormat::ChannelsLast) ? grads[0] : grads[0].contiguous();
    const bool need_x = ctx->needs_input_grad(0);
    const bool need_w = weight.defined() && ctx->needs_input_grad(1);
    const bool need_b = ctx->needs_input_grad(2);
    at::Tensor gx, gw, gb;
    if (x.is_cuda()) {
      at::Tensor sum_dy, sum_dy_xmu;
      if (x.numel() > 0) {
        std::tie(sum_dy, sum_dy_xmu, gw, gb) =
            at::batch_norm_backward_reduce(dy, x, mean, invstd, weight, need_x, need_w, need_b);
      } else {
        sum_dy = torch::zeros({C}, mean.options());
        sum_dy_xmu = torch::zeros({C}, mean.options());
        if (need_w) gw = torch::zeros_like(weight);
        if (need_b) gb = torch::zeros({C}, weight.defined() ? weight.options() : mean.options());
      }
      if (need_x) {
        at::Tensor both = torch::cat({sum_dy, sum_dy_xmu});
        dist->all_reduce(both);
        if (x.numel() > 0)
          gx = at::batch_norm_backward_elemt(dy, x, mean, invstd, weight, both.narrow(0, 0, C), both.narrow(0, C, C),
                                             count_all.to(torch::kInt));
        else
          gx = torch::zeros_like(x);
      }
    } else {
      // float64, as the forward (see there).
      auto dims = reduce_dims(x);
      auto cs = channel_shape(x);
      at::Tensor dyd = dy.to(torch::kDouble);
      at::Tensor xmu = x.to(torch::kDouble) - mean.view(cs);
      at::Tensor sum_dy = x.numel() > 0 ? dyd.sum(dims) : torch::zeros({C}, torch::kDouble);
      at::Tensor sum_dy_xmu = x.numel() > 0 ? (dyd * xmu).sum(dims) : torch::zeros({C}, torch::kDouble);
      if (need_w) gw = (sum_dy_xmu * invstd).to(weight.scalar_type());
      if (need_b) gb = sum_dy.to(weight.defined() ? weight.scalar_type() : torch::kFloat);
      if (need_x) {
        at::Tensor both = torch::cat({sum_dy, sum_dy_xmu});
        if (dist->world_size() > 1) dist->all_reduce(both);
        at::Tensor mean_dy = both.narrow(0, 0, C) / N;
        at::Tensor mean_dy_xmu = both.narrow(0, C, C) / N;
        at::Tensor scale = invstd;
        if (weight.defined()) scale = scale * weight.to(torch::kDouble);
        gx = ((dyd - mean_dy.view(cs) - xmu * (invstd * invstd * mean_dy_xmu).view(cs)) * scale.view(cs))
                 .to(x.scalar_type());
      }
    }
    return {gx, gw, gb, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor sync_batch_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           at::Tensor& running_mean, at::Tensor& running_var, at::Tensor& num_batches_tracked,
                           bool training, double momentum, double eps, Distributed& dist) {
  if (!training) {
    return torch::batch_norm(x, weight, bias, running_mean, running_var, false, momentum, eps,
                             at::globalContext().userEnabledCuDNN());
  }
  if (num_batches_tracked.defined()) {
    torch::NoGradGuard ng;
    num_batches_tracked.add_(1);
  }
  // One rank on a GPU: ATen's own kernels. On the CPU the same float64 path as several
  // ranks, so that a run computes the same on any number of ranks.
  if (dist.world_size() == 1 && x.is_cuda()) {
    return torch::batch_norm(x, weight, bias, running_mean, running_var, true, momentum, eps,
                             at::globalContext().userEnabledCuDNN());
  }
  return SyncBatchNormFn::apply(x, weight, bias, running_mean, running_var, momentum, eps, dist);
}

SyncBatchNormImpl::SyncBatchNormImpl(int64_t num_features, Distributed& dist, double eps_, double momentum_)
    : eps(eps_), momentum(momentum_), dist_(&dist) {
  weight = register_parameter("weight", torch::ones({num_features}));
  bias = register_parameter("bias", torch::zeros({num_features}));
  running_mean = register_buffer("running_mean", torch::zeros({num_features}));
  running_var = register_buffer("running_var", torch::ones({num_features}));
  num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& x) {
  return sync_batch_norm(x, weight, bias, running_mean, running_var, num_batches_tracked, is_training(), momentum, eps,
                         *dist_);
}

void SyncBatchNormImpl::load_from(const torch::nn::Module& bn) {
  torch::NoGradGuard ng;
  auto params = bn.named_parameters(false);
  auto buffers = bn.named_buffers(false);
  if (params.contains("weight")) weight.copy_(params["weight"]);
  if (params.contains("bias")) bias.copy_(params["bias"]);
  if (buffers.contains("running_mean")) running_mean.copy_(buffers["running_mean"]);
  if (buffers.contains("running_var")) running_var.copy_(buffers["running_var"]);
  if (buffers.contains("num_batches_tracked")) num_batches_tracked.copy_(buffers["num_batches_tracked"]);
}

}  // namespace faceshard
