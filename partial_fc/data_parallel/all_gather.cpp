#include "partial_fc/data_parallel/all_gather.h"

#include "partial_fc/data_parallel/saved_value.h"

namespace faceshard {
namespace {

struct AllGatherFn : public torch::autograd::Function<AllGatherFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, Distributed& dist,
                            GatherGrad mode, double grad_scale) {
    std::vector<int64_t> counts;
    at::Tensor out = dist.all_gather(x, &counts);
    save_value<Distributed*>(ctx, "dist", &dist);
    save_value(ctx, "mode", mode);
    ctx->saved_data["scale"] = grad_scale;
    ctx->saved_data["counts"] = c10::IValue(counts);
    // The gathered rows are a new tensor even on one rank (never alias the input).
    return dist.world_size() == 1 ? out.clone() : out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    Distributed* dist = saved_value<Distributed*>(ctx, "dist");
    const GatherGrad mode = saved_value<GatherGrad>(ctx, "mode");
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
  return AllGatherFn::apply(x, dist, mode, grad_scale);
}

}  // namespace faceshard
