#include "partial_fc/classifier/shard_optimizer.h"

#include <algorithm>

#include <ATen/ops/_fused_sgd.h>

#include "partial_fc/classifier/row_update_cpu.h"
#include "partial_fc/classifier/row_update_cuda.h"
#include "base/error.h"

namespace faceshard {

namespace {
// AdamW's arithmetic runs on sub-chunks of rows small enough for its temporaries to stay in
// cache.
constexpr int64_t kAdamRows = 256;
}  // namespace

ShardOptimizer::ShardOptimizer(const at::Tensor& w, const ShardOptimizerOptions& opts, bool initialise) : opts_(opts) {
  const auto o = w.options().requires_grad(false);
  auto alloc = [&](c10::IntArrayRef sizes, const at::TensorOptions& to) {
    return initialise ? torch::zeros(sizes, to) : torch::empty(sizes, to);
  };
  if (opts_.state_dtype != at::kFloat && opts_.state_dtype != at::kBFloat16)
    throw option_error("fc_state_dtype", "the classifier's optimiser state must be fp32 or bf16, got ",
                       opts_.state_dtype);
  const auto so = o.dtype(opts_.state_dtype);
  if (opts_.kind == "sgd") {
    momentum_ = alloc(w.sizes(), so);
  } else if (opts_.kind == "adamw") {
    exp_avg_ = alloc(w.sizes(), so);
    exp_avg_sq_ = alloc(w.sizes(), so);
    row_steps_ = alloc({w.size(0)}, o.dtype(torch::kLong));
  } else {
    throw option_error("optimizer", "'", opts_.kind, "' is not a classifier optimiser (sgd or adamw)");
  }
}

std::vector<std::pair<std::string, at::Tensor>> ShardOptimizer::state() const {
  if (opts_.kind == "sgd") return {{"momentum", momentum_}};
  return {{"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}, {"row_steps", row_steps_}};
}

void ShardOptimizer::step(at::Tensor& W, const at::Tensor& idx, const at::Tensor& g, double lr,
                          const RowRounding& rounding) {
  torch::NoGradGuard ng;
  const bool all = !idx.defined(), fp32 = W.scalar_type() == at::kFloat;
  const int64_t rows = all ? W.size(0) : idx.size(0);
  for (int64_t j = 0; j < rows; j += kChunkRows) {
    const int64_t n = std::min(kChunkRows, rows - j);
    const at::Tensor ix = all ? at::Tensor() : idx.narrow(0, j, n);
    // A view of fp32 rows when all move; otherwise an fp32 copy of the rows, written back.
    at::Tensor w = all ? W.narrow(0, j, n) : W.index_select(0, ix);
    if (!fp32) w = w.to(at::kFloat);
    update_rows(w, g.narrow(0, j, n), all ? j : 0, ix, lr);
    if (all && fp32) continue;
    const at::Tensor stored = rounding.round(w, ix, j, W.scalar_type());
    if (all) W.narrow(0, j, n).copy_(stored);
    else W.index_copy_(0, ix, stored);
  }
}

bool ShardOptimizer::update_projected_rows(at::Tensor& weight, const at::Tensor& raw, const at::Tensor& inv_norm,
                                           int64_t first, const at::Tensor& index, double lr,
                                           const RowRounding& rounding) {
  if (opts_.kind != "sgd" || !opts_.fused_cpu_rows || !weight.is_contiguous()) return false;
  torch::NoGradGuard ng;
  if (weight.is_cuda() && sgd_projected_rows_cuda_available()) {  // the same pass as one kernel
    sgd_projected_rows_cuda(weight, momentum_, raw, inv_norm, first, index, RowSgd{lr, opts_.momentum, opts_.weight_decay},
                            rounding);
    return true;
  }
  if (!weight.device().is_cpu()) return false;
  sgd_projected_rows_cpu(weight, momentum_, raw.contiguous(), inv_norm.contiguous(), first, index,
                         RowSgd{lr, opts_.momentum, opts_.weight_decay}, rounding);
  return true;
}

void ShardOptimizer::update_rows(const at::Tensor& w, const at::Tensor& g, int64_t first, const at::Tensor& ix,
                                 double lr) {
  torch::NoGradGuard ng;
  const int64_t n = w.size(0);
  if (n == 0) return;
  // The state rows in fp32: views of fp32 state without an index (updated in place), else
  // copies (gathered, or converted from bf16) that store() writes back, rounded to the
  // state's dtype.
  auto load = [&](const at::Tensor& t) {
    at::Tensor r = ix.defined() ? t.index_select(0, ix) : t.narrow(0, first, n);
    return r.scalar_type() == at::kBFloat16 ? r.to(at::kFloat) : r;
  };
  auto store = [&](const at::Tensor& t, const at::Tensor& v) {
    if (ix.defined()) {
      at::Tensor(t).index_copy_(0, ix, v.scalar_type() == t.scalar_type() ? v : v.to(t.scalar_type()));
    } else if (t.scalar_type() != v.scalar_type()) {
      t.narrow(0, first, n).copy_(v);
    }
  };
  if (opts_.kind == "sgd") {
    // torch's fused SGD: one pass over weight, gradient and momentum (dampening 0, no
    // Nesterov, like torch.optim.SGD with arcface_torch's settings). The momentum buffers
    // start at zero, so every step is momentum * buf + (g + wd * w), the first one included.
    // With momentum 0 the fused kernel takes no buffers (they stay zero, as saved).
    if (opts_.momentum == 0) {
      at::_fused_sgd_({w}, {g}, {}, opts_.weight_decay, 0.0, lr, 0.0, false, false, false);
      return;
    }
    at::Tensor m = load(momentum_);
    at::_fused_sgd_({w}, {g}, {m}, opts_.weight_decay, opts_.momentum, lr, 0.0, false, false, false);
    store(momentum_, m);
    return;
  }
  // AdamW with a step count per row (torch's fused AdamW takes one count per tensor).
  at::Tensor m_all = load(exp_avg_), v_all = load(exp_avg_sq_), t_all = load(row_steps_);
  for (int64_t j = 0; j < n; j += kAdamRows) {
    const int64_t k = std::min(kAdamRows, n - j);
    at::Tensor wc = w.narrow(0, j, k), m = m_all.narrow(0, j, k), v = v_all.narrow(0, j, k), t = t_all.narrow(0, j, k);
    const at::Tensor gc = g.narrow(0, j, k);
    t.add_(1);
    wc.mul_(1 - lr * opts_.weight_decay);
    m.mul_(opts_.beta1).add_(gc, 1 - opts_.beta1);
    v.mul_(opts_.beta2).addcmul_(gc, gc, 1 - opts_.beta2);
    const at::Tensor tf = t.to(wc.scalar_type()).unsqueeze(1);
    const at::Tensor bc1 = 1 - torch::pow(opts_.beta1, tf), bc2 = 1 - torch::pow(opts_.beta2, tf);
    wc.sub_(m / bc1 / ((v / bc2).sqrt() + opts_.eps) * lr);
  }
  store(exp_avg_, m_all);
  store(exp_avg_sq_, v_all);
  store(row_steps_, t_all);
}

}  // namespace faceshard
