// The dynamic loss scaler of fp16 training (torch.amp.GradScaler's semantics, which
// LibTorch's C++ API lacks): scales the loss so small fp16 gradients do not flush to zero,
// unscales the gradients before clipping and the step, and skips steps that overflowed.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Device.h>

namespace faceshard {

struct LossScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 100;  // arcface_torch's GradScaler(growth_interval=100)
  bool enabled = true;            // off: every method is an identity / no-op (fp32, bf16)
};

// One step under fp16, with the skip decision shared by all ranks:
//   scaler.scale(loss).backward();        (gradient all-reduce happens here)
//   at::Tensor inf = scaler.unscale_(params);
//   all_reduce(inf, MAX);                 (the trainer's job)
//   clip_grad_norm(params, 5);
//   if (!scaler.update(inf)) optimiser.step(lr);
// The scale lives on the device as a 1-element fp32 tensor (the AMP kernels read it there),
// with an int32 count of consecutive good steps; both go into checkpoints.
class LossScaler {
 public:
  LossScaler(LossScalerOptions opts, c10::Device device);

  // loss * scale (same shape as loss), or loss itself when disabled.
  at::Tensor scale(const at::Tensor& loss) const;
  // Multiplies every defined grad in place by fp32(1 / scale) (per (device, dtype) group,
  // with at::_amp_foreach_non_finite_check_and_unscale_) and returns found_inf: a
  // 1-element fp32 tensor on the scaler's device, 1 if any grad held an inf or NaN, else 0.
  // Not synchronised across ranks and no host sync. Call once per step. Disabled: grads are
  // untouched and found_inf is 0.
  at::Tensor unscale_(const std::vector<at::Tensor>& params);
  // With the (all-reduced) found_inf: on an overflow the scale is multiplied by
  // backoff_factor and the good-step count resets; after growth_interval consecutive good
  // steps it is multiplied by growth_factor. Returns true when this step must be skipped.
  // Reads found_inf and the new scale to the host in one sync. Disabled: returns false.
  bool update(const at::Tensor& found_inf);
  // The scale after the last update()/load_state() (no sync); 1 when disabled.
  double current_scale() const;
  // fp32(1 / scale) on the scaler's device, as unscale_ applies it (for gradients that
  // are not parameters' .grad, such as the classifier shard's).
  at::Tensor inv_scale() const;
  bool enabled() const { return opts_.enabled; }

  // {"scale" (fp32, 1 element), "growth_tracker" (int32, 1 element)}; empty when disabled
  // (like GradScaler.state_dict()). load_state validates names, sizes and values and throws
  // faceshard::Error (usage) naming source and key; a disabled scaler ignores the state.
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state, const std::string& source);

 private:
  LossScalerOptions opts_;
  c10::Device device_;
  at::Tensor scale_;           // fp32 [1]
  at::Tensor growth_tracker_;  // int32 [1]
  double host_scale_;
};

}  // namespace faceshard
