#include "app/train/backbone_optimizer.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <set>

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <c10/core/GradMode.h>

#include "models/torch_save/tensor_source.h"
#include "base/error.h"

namespace faceshard {

namespace {

// Multi-tensor kernels take their fast path only for lists of one device and dtype, so
// every step works on such groups (in practice: one group, the fp32 params on the GPU).
std::vector<std::vector<size_t>> group_by_device_dtype(const std::vector<at::Tensor>& params,
                                                       const std::vector<size_t>& idx) {
  std::map<std::pair<std::string, at::ScalarType>, std::vector<size_t>> groups;
  for (size_t i : idx) groups[{params[i].device().str(), params[i].scalar_type()}].push_back(i);
  std::vector<std::vector<size_t>> out;
  for (auto& kv : groups) out.push_back(std::move(kv.second));
  return out;
}

std::vector<at::Tensor> pick(const std::vector<at::Tensor>& v, const std::vector<size_t>& idx) {
  std::vector<at::Tensor> out;
  out.reserve(idx.size());
  for (size_t i : idx) out.push_back(v[i]);
  return out;
}

bool finite_nonneg(double x) { return std::isfinite(x) && x >= 0; }

}  // namespace

BackboneOptimizer::BackboneOptimizer(FlatParameters& flat, BackboneOptimizerOptions opts)
    : BackboneOptimizer(flat.params(), std::move(opts)) {
  flat_ = &flat;
  make_flat_state();
}

void BackboneOptimizer::make_flat_state() {
  const auto& groups = flat_->groups();
  flat_stepped_.assign(groups.size(), 0);
  for (const FlatParameters::Group& g : groups) {
    flat_lr_.push_back(at::zeros({}, g.values.options().dtype(at::kFloat)));
    flat_step_.push_back(at::zeros({}, g.values.options().dtype(at::kFloat)));
  }
  if (adamw_) {
    for (const FlatParameters::Group& g : groups) {
      flat_exp_avg_.push_back(at::zeros_like(g.values));
      flat_exp_avg_sq_.push_back(at::zeros_like(g.values));
    }
  } else if (opts_.momentum != 0) {
    for (const FlatParameters::Group& g : groups) flat_momentum_.push_back(at::zeros_like(g.values));
  }
}

BackboneOptimizer::BackboneOptimizer(std::vector<at::Tensor> params, BackboneOptimizerOptions opts)
    : params_(std::move(params)), opts_(std::move(opts)) {
  if (opts_.kind == "adamw") {
    adamw_ = true;
  } else if (opts_.kind != "sgd") {
    throw usage_error("backbone optimiser: unknown kind '", opts_.kind, "' (sgd or adamw)");
  }
  if (!finite_nonneg(opts_.weight_decay))
    throw usage_error("backbone optimiser: weight_decay must be a finite number >= 0 (got ", opts_.weight_decay, ")");
  if (!adamw_ && !finite_nonneg(opts_.momentum))
    throw usage_error("backbone optimiser: momentum must be a finite number >= 0 (got ", opts_.momentum, ")");
  if (adamw_) {
    if (!(opts_.beta1 >= 0 && opts_.beta1 < 1)) throw usage_error("backbone optimiser: beta1 must be in [0, 1) (got ", opts_.beta1, ")");
    if (!(opts_.beta2 >= 0 && opts_.beta2 < 1)) throw usage_error("backbone optimiser: beta2 must be in [0, 1) (got ", opts_.beta2, ")");
    if (!(opts_.eps > 0) || !std::isfinite(opts_.eps)) throw usage_error("backbone optimiser: eps must be > 0 (got ", opts_.eps, ")");
  }
  std::set<const void*> seen;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    if (!p.defined()) throw usage_error("backbone optimiser: param ", i, " is undefined");
    if (!p.is_floating_point()) throw usage_error("backbone optimiser: param ", i, " is not a floating-point tensor");
    // The same tensor twice would be updated twice per step.
    if (!seen.insert(p.unsafeGetTensorImpl()).second) throw usage_error("backbone optimiser: param ", i, " is listed twice");
  }
  momentum_.resize(params_.size());
  exp_avg_.resize(params_.size());
  exp_avg_sq_.resize(params_.size());
  steps_.resize(params_.size());
}

void BackboneOptimizer::zero_grad() {
  if (flat_) return flat_->zero_grad();
  for (at::Tensor& p : params_)
    if (p.grad().defined()) p.mutable_grad().reset();
}

void BackboneOptimizer::step(double lr) {
  if (!std::isfinite(lr)) throw usage_error("backbone optimiser: lr must be finite (got ", lr, ")");
  at::NoGradGuard no_grad;
  if (flat_) return step_flat(lr);
  std::vector<size_t> idx;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].grad();
    if (!g.defined() || !params_[i].requires_grad()) continue;
    if (g.is_sparse()) throw usage_error("backbone optimiser: param ", i, " has a sparse gradient (not supported)");
    idx.push_back(i);
  }
  for (const std::vector<size_t>& group : group_by_device_dtype(params_, idx)) {
    if (adamw_) {
      step_adamw(group, lr);
    } else {
      step_sgd(group, lr);
    }
  }
}

void BackboneOptimizer::step_sgd(const std::vector<size_t>& idx, double lr) {
  std::vector<at::Tensor> ps = pick(params_, idx), grads;
  for (const at::Tensor& p : ps) grads.push_back(p.grad());
  // d = g + wd * p, a new list (the grads themselves stay untouched, as in torch).
  std::vector<at::Tensor> d = opts_.weight_decay != 0 ? at::_foreach_add(grads, ps, opts_.weight_decay) : grads;
  if (opts_.momentum != 0) {
    std::vector<at::Tensor> old_bufs, old_d;
    for (size_t k = 0; k < idx.size(); ++k) {
      at::Tensor& buf = momentum_[idx[k]];
      if (!buf.defined()) {
        // torch's first step: buf = clone(d) (no momentum applied to a zero buffer).
        buf = d[k].clone().detach();
      } else {
        old_bufs.push_back(buf);
        old_d.push_back(d[k]);
      }
    }
    if (!old_bufs.empty()) {
      at::_foreach_mul_(old_bufs, opts_.momentum);
      at::_foreach_add_(old_bufs, old_d);  // dampening 0
    }
    d = pick(momentum_, idx);
  }
  at::_foreach_add_(ps, d, -lr);
}

void BackboneOptimizer::step_adamw(const std::vector<size_t>& idx, double lr) {
  for (size_t i : idx) {
    if (exp_avg_[i].defined()) continue;
    const at::Tensor& p = params_[i];
    exp_avg_[i] = at::zeros_like(p, at::MemoryFormat::Preserve);
    exp_avg_sq_[i] = at::zeros_like(p, at::MemoryFormat::Preserve);
    // fp32 on the param's device: what torch's fused AdamW keeps, and what its kernel reads.
    steps_[i] = at::zeros({}, p.options().dtype(at::kFloat));
  }
  std::vector<at::Tensor> ps = pick(params_, idx), grads, steps = pick(steps_, idx);
  for (const at::Tensor& p : ps) grads.push_back(p.grad());
  // The fused kernel reads the step count (for the bias corrections) but does not advance it.
  at::_foreach_add_(steps, 1);
  at::_fused_adamw_(ps, grads, pick(exp_avg_, idx), pick(exp_avg_sq_, idx), /*max_exp_avg_sqs=*/{}, steps, lr,
                    opts_.beta1, opts_.beta2, opts_.weight_decay, opts_.eps, /*amsgrad=*/false, /*maximize=*/false);
}

void BackboneOptimizer::step_flat(double lr) {
  flat_->check_intact("backbone optimiser");
  const auto& groups = flat_->groups();
  for (size_t k = 0; k < groups.size(); ++k) {
    const FlatParameters::Group& g = groups[k];
    // A frozen group (fine-tuning) takes no step: no weight decay, no momentum, no AdamW
    // step count, as a param without a gradient in torch.optim.
    size_t trained = 0;
    for (int i : g.params) trained += params_[i].requires_grad() ? 1 : 0;
    if (trained == 0) continue;
    if (trained != g.params.size())
      throw runtime_error("backbone optimiser: flat group ", k, " holds ", g.params.size() - trained, " frozen and ",
                          trained, " trained parameters; make the flat buffers with the freeze's partition");
    // The learning rate lives on the device: a kernel that reads it needs no new launch
    // arguments when it changes (what a replayed CUDA graph needs).
    flat_lr_[k].fill_(lr);
    if (adamw_) {
      at::_foreach_add_(at::TensorList(flat_step_[k]), 1);
      at::_fused_adamw_({g.values}, {g.grads}, {flat_exp_avg_[k]}, {flat_exp_avg_sq_[k]}, {}, {flat_step_[k]}, flat_lr_[k],
                        opts_.beta1, opts_.beta2, opts_.weight_decay, opts_.eps, /*amsgrad=*/false, /*maximize=*/false);
    } else if (opts_.momentum != 0) {
      // A zero buffer makes the first step's buf = d exactly, as torch's clone of d does.
      at::_fused_sgd_({g.values}, {g.grads}, {flat_momentum_[k]}, opts_.weight_decay, opts_.momentum, flat_lr_[k],
                      /*dampening=*/0.0, /*nesterov=*/false, /*maximize=*/false, /*is_first_step=*/false);
    } else {
      at::_fused_sgd_({g.values}, {g.grads}, {}, opts_.weight_decay, 0.0, flat_lr_[k], 0.0, false, false, false);
    }
    flat_stepped_[k] = 1;
  }
}

std::vector<std::pair<std::string, at::Tensor>> BackboneOptimizer::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  out.emplace_back("num_params", at::full({1}, static_cast<int64_t>(params_.size()), at::kLong));
  if (flat_) {
    for (size_t i = 0; i < params_.size(); ++i) {
      const int g = flat_->group_of(static_cast<int>(i));
      if (!flat_stepped_[g]) continue;
      const std::string n = std::to_string(i);
      if (adamw_) {
        out.emplace_back("exp_avg." + n, flat_->view(static_cast<int>(i), flat_exp_avg_[g]));
        out.emplace_back("exp_avg_sq." + n, flat_->view(static_cast<int>(i), flat_exp_avg_sq_[g]));
        out.emplace_back("step." + n, flat_step_[g]);
      } else if (opts_.momentum != 0) {
        out.emplace_back("momentum." + n, flat_->view(static_cast<int>(i), flat_momentum_[g]));
      }
    }
    return out;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string n = std::to_string(i);
    if (momentum_[i].defined()) out.emplace_back("momentum." + n, momentum_[i]);
    if (exp_avg_[i].defined()) {
      out.emplace_back("exp_avg." + n, exp_avg_[i]);
      out.emplace_back("exp_avg_sq." + n, exp_avg_sq_[i]);
      out.emplace_back("step." + n, steps_[i]);
    }
  }
  return out;
}

void BackboneOptimizer::load_state(const std::vector<std::pair<std::string, at::Tensor>>& state,
                                   const std::string& source) {
  load_state(TensorListSource(state), source);
}

void BackboneOptimizer::load_state(const TensorSource& state, const std::string& source) {
  // Everything is checked from the names and shapes first (what a file says before any
  // value is read); then each value is read straight into new state laid out like its
  // param, on its device.
  constexpr size_t kNone = SIZE_MAX;
  const size_t n = params_.size();
  std::vector<size_t> mom(n, kNone), ea(n, kNone), eas(n, kNone), st(n, kNone);
  bool have_count = false;
  std::set<std::string> seen;
  for (size_t e = 0; e < state.size(); ++e) {
    const std::string& key = state.name(e);
    auto bad = [&](const auto&... why) { return usage_error(source, ": optimiser state '", key, "': ", why...); };
    if (!seen.insert(key).second) throw bad("appears twice");
    const std::vector<int64_t> sizes = state.sizes(e);
    const int64_t numel = state.numel(e);
    if (key == "num_params") {
      const at::ScalarType type = state.dtype(e);
      if (numel != 1 || at::isFloatingType(type) || at::isComplexType(type)) throw bad("expected one integer");
      const int64_t count = state.read(e).reshape({}).item<int64_t>();
      if (count != static_cast<int64_t>(n))
        throw bad("the checkpoint has ", count, " params, this backbone has ", n, " (a different model?)");
      have_count = true;
      continue;
    }
    const size_t dot = key.rfind('.');
    const std::string prefix = dot == std::string::npos ? key : key.substr(0, dot);
    const std::string digits = dot == std::string::npos ? "" : key.substr(dot + 1);
    if (digits.empty() || digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }))
      throw bad("unknown key (expected <name>.<param index>)");
    const size_t i = std::stoul(digits);
    if (i >= n) throw bad("param index ", i, " is out of range (", n, " params)");
    std::vector<size_t>* slot = nullptr;
    if (!adamw_ && prefix == "momentum" && opts_.momentum != 0) slot = &mom;
    if (adamw_ && prefix == "exp_avg") slot = &ea;
    if (adamw_ && prefix == "exp_avg_sq") slot = &eas;
    if (adamw_ && prefix == "step") slot = &st;
    if (!slot) throw bad("not a state of this optimiser (", opts_.kind, opts_.kind == "sgd" && opts_.momentum == 0 ? " without momentum" : "", ")");
    const at::ScalarType type = state.dtype(e);
    if (at::isComplexType(type) || type == at::kBool || (slot != &st && !at::isFloatingType(type)))
      throw bad("is ", type, ", expected ", slot == &st ? "a number" : "floating-point values");
    if (slot == &st) {
      if (numel != 1) throw bad("expected one number, got shape ", c10::IntArrayRef(sizes));
    } else if (c10::IntArrayRef(sizes) != params_[i].sizes()) {
      throw bad("shape ", c10::IntArrayRef(sizes), " does not match param ", i, " of shape ", params_[i].sizes());
    }
    (*slot)[i] = e;
  }
  if (!have_count) throw usage_error(source, ": optimiser state 'num_params' is missing");
  if (adamw_) {
    for (size_t i = 0; i < n; ++i) {
      const int present = (ea[i] != kNone) + (eas[i] != kNone) + (st[i] != kNone);
      if (present != 0 && present != 3) {
        const char* missing = ea[i] == kNone ? "exp_avg." : eas[i] == kNone ? "exp_avg_sq." : "step.";
        throw usage_error(source, ": optimiser state '", missing, i, "' is missing (its other AdamW state is present)");
      }
    }
  }
  // Everything checked: read the new state (laid out like the params), then replace the
  // old one, so a read error leaves the optimiser as it was.
  at::NoGradGuard no_grad;
  auto like_param = [&](size_t e, size_t i) {
    if (e == kNone) return at::Tensor();
    at::Tensor t = at::empty_like(params_[i], at::MemoryFormat::Preserve);
    state.read_into(e, t);
    return t;
  };
  std::vector<at::Tensor> new_mom(n), new_ea(n), new_eas(n), new_st(n);
  for (size_t i = 0; i < n; ++i) {
    new_mom[i] = like_param(mom[i], i);
    new_ea[i] = like_param(ea[i], i);
    new_eas[i] = like_param(eas[i], i);
    if (st[i] != kNone) new_st[i] = state.read(st[i]).reshape({}).to(params_[i].device(), at::kFloat);
  }
  if (flat_) return load_flat_state(new_mom, new_ea, new_eas, new_st, source);
  momentum_ = std::move(new_mom);
  exp_avg_ = std::move(new_ea);
  exp_avg_sq_ = std::move(new_eas);
  steps_ = std::move(new_st);
}

void BackboneOptimizer::load_flat_state(std::vector<at::Tensor>& mom, std::vector<at::Tensor>& ea,
                                        std::vector<at::Tensor>& eas, std::vector<at::Tensor>& st,
                                        const std::string& source) {
  // One buffer per group: a group's params all have state or none has (a fresh param's
  // momentum may be zero, which is where torch starts it; AdamW's step count is one per
  // group, so its params must agree on it).
  const auto& groups = flat_->groups();
  std::vector<char> stepped(groups.size(), 0);
  std::vector<double> steps(groups.size(), -1);
  for (size_t k = 0; k < groups.size(); ++k) {
    for (int i : groups[k].params) {
      if (!adamw_) {
        if (mom[i].defined()) stepped[k] = 1;
        continue;
      }
      const bool has = st[i].defined();
      const double s = has ? st[i].to(at::kCPU, at::kDouble).item<double>() : 0.0;
      if (i == groups[k].params.front()) {
        steps[k] = s;
        stepped[k] = has;
      } else if (has != static_cast<bool>(stepped[k]) || s != steps[k]) {
        throw usage_error(source, ": optimiser state 'step.", i, "' (",
                          has ? std::to_string(static_cast<int64_t>(s)) : std::string("absent"), ") differs from 'step.",
                          groups[k].params.front(), "' (",
                          stepped[k] ? std::to_string(static_cast<int64_t>(steps[k])) : std::string("absent"),
                          "): the fused optimiser keeps one step count for all parameters; set optim.fused: false "
                          "to resume this checkpoint");
      }
    }
  }
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < groups.size(); ++k) {
    if (adamw_) {
      flat_exp_avg_[k].zero_();
      flat_exp_avg_sq_[k].zero_();
      flat_step_[k].fill_(stepped[k] ? steps[k] : 0.0);
    } else if (opts_.momentum != 0) {
      flat_momentum_[k].zero_();
    }
    for (int i : groups[k].params) {
      if (adamw_ && ea[i].defined()) {
        flat_->view(i, flat_exp_avg_[k]).copy_(ea[i]);
        flat_->view(i, flat_exp_avg_sq_[k]).copy_(eas[i]);
      }
      if (!adamw_ && mom[i].defined()) flat_->view(i, flat_momentum_[k]).copy_(mom[i]);
    }
    flat_stepped_[k] = stepped[k];
  }
}

}  // namespace faceshard
