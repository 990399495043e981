#include "partial_fc/classifier/shard_optimizer.h"

#include <algorithm>

#include "partial_fc/runtime/error.h"

namespace faceshard {

namespace {
constexpr int64_t kChunkRows = 8192;
}  // namespace

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
  const int64_t rows = all ? W.size(0) : idx.size(0);
  // Rows in chunks: every temporary of the update is a chunk's size, never the shard's.
  for (int64_t j = 0; j < rows; j += kChunkRows) {
    const int64_t n = std::min(kChunkRows, rows - j);
    const at::Tensor ix = all ? at::Tensor() : idx.narrow(0, j, n);
    // Views of the rows when all move; copies of the selected rows, written back, when not.
    auto rows_of = [&](const at::Tensor& t) { return all ? t.narrow(0, j, n) : t.index_select(0, ix); };
    auto write_back = [&](at::Tensor& t, const at::Tensor& v) {
      if (!all) t.index_copy_(0, ix, v);
    };
    at::Tensor w = rows_of(W);
    const at::Tensor gc = g.narrow(0, j, n);
    if (opts_.kind == "sgd") {
      at::Tensor m = rows_of(momentum_);
      const at::Tensor d = opts_.weight_decay != 0 ? gc + w * opts_.weight_decay : gc;
      m.mul_(opts_.momentum).add_(d);
      w.add_(m, -lr);
      write_back(momentum_, m);
    } else {
      at::Tensor m = rows_of(exp_avg_), v = rows_of(exp_avg_sq_), t = rows_of(row_steps_);
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
    }
    write_back(W, w);
  }
}

}  // namespace faceshard
