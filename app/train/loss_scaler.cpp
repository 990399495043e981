#include "app/train/loss_scaler.h"

#include <cmath>
#include <map>

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <c10/core/GradMode.h>

#include "base/error.h"
#include "base/designed_host_sync.h"

namespace faceshard {

LossScaler::LossScaler(LossScalerOptions opts, c10::Device device)
    : opts_(opts), device_(device), host_scale_(opts.init_scale) {
  if (!(opts_.init_scale > 0) || !std::isfinite(opts_.init_scale))
    throw usage_error("loss scaler: init_scale must be a finite number > 0 (got ", opts_.init_scale, ")");
  if (!(opts_.growth_factor > 1) || !std::isfinite(opts_.growth_factor))
    throw usage_error("loss scaler: growth_factor must be > 1 (got ", opts_.growth_factor, ")");
  if (!(opts_.backoff_factor > 0 && opts_.backoff_factor < 1))
    throw usage_error("loss scaler: backoff_factor must be in (0, 1) (got ", opts_.backoff_factor, ")");
  if (opts_.growth_interval < 1)
    throw usage_error("loss scaler: growth_interval must be >= 1 (got ", opts_.growth_interval, ")");
  scale_ = at::full({1}, opts_.init_scale, at::TensorOptions().dtype(at::kFloat).device(device_));
  growth_tracker_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device_));
  // What the device holds (the scale is fp32 there).
  host_scale_ = static_cast<double>(static_cast<float>(opts_.init_scale));
}

at::Tensor LossScaler::scale(const at::Tensor& loss) const {
  if (!opts_.enabled) return loss;
  // A 0-dim view keeps the loss's shape (a scalar loss stays a scalar for backward()).
  // (squeeze, not view({}): that braced list would pick the view(dtype) overload.)
  return loss * scale_.to(loss.device()).squeeze(0);
}

at::Tensor LossScaler::unscale_(const std::vector<at::Tensor>& params) {
  at::Tensor found_inf = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device_));
  if (!opts_.enabled) return found_inf;
  at::NoGradGuard no_grad;
  const at::Tensor inv_scale = this->inv_scale();
  // The kernel needs one device and dtype per call; found_inf is per device (it only ever
  // sets it to 1, so the dtype groups of a device can share it).
  std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> groups;
  std::map<std::string, std::pair<at::Tensor, at::Tensor>> per_device;  // found_inf, inv_scale
  for (const at::Tensor& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (g.is_sparse()) throw usage_error("loss scaler: sparse gradients are not supported");
    groups[{g.device().str(), g.scalar_type()}].push_back(g);
  }
  for (auto& kv : groups) {
    const at::Device dev = kv.second.front().device();
    auto it = per_device.find(kv.first.first);
    if (it == per_device.end()) {
      at::Tensor f = dev == device_ ? found_inf : at::zeros({1}, found_inf.options().device(dev));
      it = per_device.emplace(kv.first.first, std::make_pair(f, inv_scale.to(dev))).first;
    }
    at::_amp_foreach_non_finite_check_and_unscale_(kv.second, it->second.first, it->second.second);
  }
  for (auto& kv : per_device)
    if (!kv.second.first.is_same(found_inf)) found_inf = at::maximum(found_inf, kv.second.first.to(device_));
  return found_inf;
}

bool LossScaler::update(const at::Tensor& found_inf) {
  if (!opts_.enabled) return false;
  if (!found_inf.defined() || found_inf.numel() != 1)
    throw usage_error("loss scaler: found_inf must be a 1-element tensor");
  at::Tensor f = found_inf.reshape({1}).to(device_, at::kFloat);
  at::_amp_update_scale_(scale_, growth_tracker_, f, opts_.growth_factor, opts_.backoff_factor,
                         opts_.growth_interval);
  // The one host sync of a step: the skip decision and the new scale together.
  at::Tensor host;
  {
    DesignedHostSync sync("loss scaler: the skip decision and the new scale");
    host = at::cat({f, scale_}).to(at::kCPU);
  }
  host_scale_ = static_cast<double>(host[1].item<float>());
  return host[0].item<float>() > 0;
}

at::Tensor LossScaler::inv_scale() const {
  // torch computes the reciprocal in double and rounds once to fp32.
  return scale_.to(at::kDouble).reciprocal().to(at::kFloat);
}

double LossScaler::current_scale() const { return opts_.enabled ? host_scale_ : 1.0; }

std::vector<std::pair<std::string, at::Tensor>> LossScaler::state() const {
  if (!opts_.enabled) return {};
  return {{"scale", scale_}, {"growth_tracker", growth_tracker_}};
}

void LossScaler::load_state(const std::vector<std::pair<std::string, at::Tensor>>& state,
                            const std::string& source) {
  if (!opts_.enabled) return;
  at::Tensor scale, tracker;
  for (const auto& kv : state) {
    const std::string& key = kv.first;
    const at::Tensor& t = kv.second;
    auto bad = [&](const auto&... why) { return usage_error(source, ": loss scaler state '", key, "': ", why...); };
    at::Tensor* slot = key == "scale" ? &scale : key == "growth_tracker" ? &tracker : nullptr;
    if (!slot) throw bad("unknown key (expected scale, growth_tracker)");
    if (slot->defined()) throw bad("appears twice");
    if (!t.defined() || t.numel() != 1) throw bad("expected one number");
    if (slot == &scale) {
      const double v = t.reshape({}).to(at::kCPU).to(at::kDouble).item<double>();
      if (!(v > 0) || !std::isfinite(v)) throw bad("expected a finite scale > 0, got ", v);
    } else {
      if (t.is_floating_point() || t.is_complex()) throw bad("expected an integer count");
      const int64_t v = t.reshape({}).to(at::kCPU).item<int64_t>();
      if (v < 0) throw bad("expected a count >= 0, got ", v);
    }
    *slot = t;
  }
  if (!scale.defined())
    throw usage_error(source, ": loss scaler state 'scale' is missing (saved without fp16 loss scaling?)");
  if (!tracker.defined()) throw usage_error(source, ": loss scaler state 'growth_tracker' is missing");
  scale_ = scale.reshape({1}).to(device_, at::kFloat).clone();
  // A run resumed with a smaller growth_interval: a count at or past it would never again
  // equal it (the kernel grows on equality), so the scale could never grow.
  growth_tracker_ = tracker.reshape({1}).to(device_, at::kInt).clamp_max(opts_.growth_interval - 1).clone();
  host_scale_ = static_cast<double>(scale_.to(at::kCPU).item<float>());
}

}  // namespace faceshard
