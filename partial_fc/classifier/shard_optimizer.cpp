#include "partial_fc/classifier/shard_optimizer.h"

#include <algorithm>

#include <ATen/ops/_fused_sgd.h>

#include "partial_fc/runtime/error.h"

namespace faceshard {

namespace {
constexpr int64_t kChunkRows = 256;
}  // namespace

ShardOptimizer::ShardOptimizer(const at::Tensor& w, const ShardOptimizerOptions& opts, bool initialise) : opts_(opts) {
  const auto o = w.options().requires_grad(false);
  auto alloc = [&](c10::IntArrayRef sizes, const at::TensorOptions& to) {
    return initialise ? torch::zeros(sizes, to) : torch::empty(sizes, to);
  };
  if (opts_.kind == "sgd") {
    momentum_ = alloc(w.sizes(), o);
  } else if (opts_.kind == "adamw") {
    exp_avg_ = alloc(w.sizes(), o);
    exp_avg_sq_ = alloc(w.sizes(), o);
    row_steps_ = alloc({w.size(0)}, o.dtype(torch::kLong));
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
  if (opts_.kind == "sgd") {
    // torch's fused SGD: one pass over weight, gradient and momentum (dampening 0, no
    // Nesterov, like torch.optim.SGD with arcface_torch's settings). The momentum buffers
    // start at zero, so every step is momentum * buf + (g + wd * w), the first one included.
    // With momentum 0 the fused kernel takes no buffers (they stay zero, as saved).
    const bool plain = opts_.momentum == 0;
    if (all) {
      at::_fused_sgd_({W}, {g}, plain ? at::TensorList{} : at::TensorList{momentum_}, opts_.weight_decay,
                      opts_.momentum, lr, 0.0, false, false, false);
      return;
    }
    at::Tensor w = W.index_select(0, idx);
    if (plain) {
      at::_fused_sgd_({w}, {g}, {}, opts_.weight_decay, 0.0, lr, 0.0, false, false, false);
    } else {
      at::Tensor m = momentum_.index_select(0, idx);
      at::_fused_sgd_({w}, {g}, {m}, opts_.weight_decay, opts_.momentum, lr, 0.0, false, false, false);
      momentum_.index_copy_(0, idx, m);
    }
    W.index_copy_(0, idx, w);
    return;
  }
  // AdamW with a step count per row (torch's fused AdamW takes one count per tensor), in
  // chunks of rows small enough for the temporaries to stay in cache.
  const int64_t rows = all ? W.size(0) : idx.size(0);
  for (int64_t j = 0; j < rows; j += kChunkRows) {
    const int64_t n = std::min(kChunkRows, rows - j);
    const at::Tensor ix = all ? at::Tensor() : idx.narrow(0, j, n);
    // Views of the rows when all move; copies of the selected rows, written back, when not.
    auto rows_of = [&](const at::Tensor& t) { return all ? t.narrow(0, j, n) : t.index_select(0, ix); };
    auto write_back = [&](at::Tensor& t, const at::Tensor& v) {
      if (!all) t.index_copy_(0, ix, v);
    };
    at::Tensor w = rows_of(W), m = rows_of(exp_avg_), v = rows_of(exp_avg_sq_), t = rows_of(row_steps_);
    const at::Tensor gc = g.narrow(0, j, n);
    t.add_(1);
    w.mul_(1 - lr * opts_.weight_decay);
    m.mul_(opts_.beta1).add_(gc, 1 - opts_.beta1);
    v.mul_(opts_.beta2).addcmul_(gc, gc, 1 - opts_.beta2);
    const at::Tensor tf = t.to(w.scalar_type()).unsqueeze(1);
    const at::Tensor bc1 = 1 - torch::pow(opts_.beta1, tf), bc2 = 1 - torch::pow(opts_.beta2, tf);
    w.sub_(m / bc1 / ((v / bc2).sqrt() + opts_.eps) * lr);
    write_back(exp_avg_, m);
    write_back(exp_avg_sq_, v);
    write_back(row_steps_, t);
    write_back(W, w);
  }
}

}  // namespace faceshard
