#include "partial_fc/shard_optimizer.h"

#include "partial_fc/error.h"

namespace faceshard {

ShardOptimizer::ShardOptimizer(PartialFC& fc, const ShardOptimizerOptions& opts) : fc_(fc), opts_(opts) {
  const at::Tensor& w = fc_.weight();
  if (opts_.kind == "sgd") {
    momentum_ = torch::zeros_like(w, w.options().requires_grad(false));
  } else if (opts_.kind == "adamw") {
    exp_avg_ = torch::zeros_like(w, w.options().requires_grad(false));
    exp_avg_sq_ = torch::zeros_like(w, w.options().requires_grad(false));
    row_steps_ = torch::zeros({w.size(0)}, w.options().dtype(torch::kLong).requires_grad(false));
  } else {
    throw usage_error("optim.fc_optimizer: unknown optimiser '", opts_.kind, "' (sgd or adamw)");
  }
}

std::map<std::string, at::Tensor> ShardOptimizer::state() {
  if (opts_.kind == "sgd") return {{"momentum", momentum_}};
  return {{"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}, {"row_steps", row_steps_}};
}

void ShardOptimizer::zero_grad() {
  at::Tensor& sub = fc_.sampled_weight();
  if (sub.defined() && sub.grad().defined()) sub.mutable_grad().reset();
  pending_index_.clear();
  pending_grad_.clear();
}

void ShardOptimizer::accumulate() {
  at::Tensor& sub = fc_.sampled_weight();
  if (!fc_.samples() || !sub.defined() || !sub.grad().defined()) return;
  pending_index_.push_back(fc_.sampled_index());
  pending_grad_.push_back(sub.grad());
  sub.mutable_grad().reset();
}

void ShardOptimizer::merge_accumulated() {
  if (pending_index_.empty()) return;
  torch::NoGradGuard ng;
  accumulate();  // the last micro-batch's gradient joins the others
  at::Tensor index = torch::cat(pending_index_), grad = torch::cat(pending_grad_);
  auto uniq = at::_unique(index, /*sorted=*/true, /*return_inverse=*/true);
  at::Tensor rows = std::get<0>(uniq);
  at::Tensor sum = torch::zeros({rows.size(0), grad.size(1)}, grad.options()).index_add_(0, std::get<1>(uniq), grad);
  pending_index_.clear();
  pending_grad_.clear();
  fc_.set_sampled(rows, sum);
}

void ShardOptimizer::step(double lr, double grad_scale) {
  merge_accumulated();
  torch::NoGradGuard ng;
  at::Tensor& sub = fc_.sampled_weight();
  if (!sub.defined() || !sub.grad().defined()) return;  // no classifier gradient this step
  at::Tensor g = sub.grad();
  if (grad_scale != 1.0) g = g * grad_scale;
  const bool all = !fc_.samples();
  at::Tensor& W = fc_.weight();
  const at::Tensor& idx = fc_.sampled_index();
  // Work on the selected rows (a copy when sampling), write them back at the end.
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
  zero_grad();
}

}  // namespace faceshard
