#include "partial_fc/all_gather.h"

#include <torch/csrc/autograd/custom_function.h>

namespace faceshard {
namespace {

struct AllGatherFn : public torch::autograd::Function<AllGatherFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t dist_handle,
                            int64_t mode, double grad_scale) {
    auto* dist = reinterpret_cast<Distributed*>(dist_handle);
    std::vector<int64_t> counts;
    at::Tensor out = dist->all_gather(x, &counts);
    ctx->saved_data["dist"] = dist_handle;
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["scale"] = grad_scale;
    ctx->saved_data["counts"] = c10::IValue(counts);
    // The gathered rows are a new tensor even on one rank (never alias the input).
    return dist->world_size() == 1 ? out.clone() : out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* dist = reinterpret_cast<Distributed*>(ctx->saved_data["dist"].toInt());
    const auto mode = static_cast<GatherGrad>(ctx->saved_data["mode"].toInt());
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    at::Tensor g = grads[0].contiguous();
    at::Tensor gx;
    if (mode == GatherGrad::ReduceScatterSum) {
      gx = dist->reduce_scatter(g, counts);
    } else {
      int64_t off = 0;
      for (int r = 0; r < dist->rank(); ++r) off += counts[r];
      gx = g.narrow(0, off, counts[dist->rank()]).clone();
    }
    const double scale = ctx->saved_data["scale"].toDouble();
    if (scale != 1.0) gx = gx * scale;
    return {gx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor all_gather_with_grad(Distributed& dist, const at::Tensor& x, GatherGrad mode, double grad_scale) {
  return AllGatherFn::apply(x, reinterpret_cast<int64_t>(&dist), static_cast<int64_t>(mode), grad_scale);
}

}  // namespace faceshard
