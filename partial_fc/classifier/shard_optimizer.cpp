#include "partial_fc/classifier/shard_optimizer.h"

#include "partial_fc/runtime/error.h"

namespace faceshard {

ShardOptimizer::ShardOptimizer(const at::Tensor& w, const ShardOptimizerOptions& opts) : opts_(opts) {
  const auto o = w.options().requires_grad(false);
  if (opts_.kind == "sgd") {
    momentum_ = torch::zeros_like(w, o);
  } else if (opts_.kind == "adamw") {
    exp_avg_ = torch::zeros_like(w, o);
    exp_avg_sq_ = torch::zeros_like(w, o);
    row_steps_ = torch::zeros({w.size(0)}, o.dtype(torch::kLong));
  } else {
    throw option_error("optimizer", "'", opts_.kind, "' is not a classifier optimiser (sgd or adamw)");
  }
}

std::vector<std::pair<std::string, at::Tensor>> ShardOptimizer::state() const {
  if (opts_.kind == "sgd") return {{"momentum", momentum_}};
  return {{"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}, {"row_steps", row_steps_}};
}

void ShardOptimizer::step(at::Tensor& W, const at::Tensor& idx, const at::Tensor& g, double lr) {
  torch::NoGradGuard ng;
  const bool all = !idx.defined();
  // Work on the selected rows (a copy when only some move), write them back at the end.
  at::Tensor w = all ? W : W.index_select(0, idx);
  if (opts_.kind == "sgd") {
    at::Tensor m = all ? momentum_ : momentum_.index_select(0, idx);
    at::Tensor d = opts_.weight_decay != 0 ? g + w * opts_.weight_decay : g;
    m.mul_(opts_.momentum).add_(d);
    w.add_(m, -lr);
    if (!all) momentum_.index_copy_(0, idx, m);
  } else {
    at::Tensor m = all ? exp_avg_ : exp_avg_.index_select(0, idx);
    at::Tensor v = all ? exp_avg_sq_ : exp_avg_sq_.index_select(0, idx);
    at::Tensor t = all ? row_steps_ : row_steps_.index_select(0, idx);
    t.add_(1);
    w.mul_(1 - lr * opts_.weight_decay);
    m.mul_(opts_.beta1).add_(g, 1 - opts_.beta1);
    v.mul_(opts_.beta2).addcmul_(g, g, 1 - opts_.beta2);
    at::Tensor tf = t.to(w.scalar_type()).unsqueeze(1);
    at::Tensor bc1 = 1 - torch::pow(opts_.beta1, tf), bc2 = 1 - torch::pow(opts_.beta2, tf);
    w.sub_(m / bc1 / ((v / bc2).sqrt() + opts_.eps) * lr);
    if (!all) {
      exp_avg_.index_copy_(0, idx, m);
      exp_avg_sq_.index_copy_(0, idx, v);
      row_steps_.index_copy_(0, idx, t);
    }
  }
  if (!all) W.index_copy_(0, idx, w);
}

}  // namespace faceshard
