#include "app/train/grad_clip.h"

#include <cmath>
#include <map>
#include <utility>

#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <c10/core/GradMode.h>

#include "base/error.h"

namespace faceshard {

at::Tensor clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  if (!(max_norm > 0) || !std::isfinite(max_norm))
    throw usage_error("clip_grad_norm: max_norm must be a finite number > 0 (got ", max_norm, ")");
  at::NoGradGuard no_grad;
  // The multi-tensor kernels take their fast path only for lists of one device and dtype.
  std::map<std::pair<std::string, at::ScalarType>, std::vector<at::Tensor>> groups;
  c10::optional<at::Device> first_device;
  for (const at::Tensor& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    if (g.is_sparse()) throw usage_error("clip_grad_norm: sparse gradients are not supported");
    if (!first_device) first_device = g.device();
    groups[{g.device().str(), g.scalar_type()}].push_back(g);
  }
  if (!first_device) return at::zeros({}, at::kFloat);

  std::vector<at::Tensor> norms;
  for (auto& kv : groups) {
    const at::ScalarType dt = kv.first.second;
    // Reduced-precision gradients are summed in fp32: their squares overflow fp16 easily.
    c10::optional<at::ScalarType> acc;
    if (dt == at::kHalf || dt == at::kBFloat16) acc = at::kFloat;
    for (at::Tensor& n : at::_foreach_norm(kv.second, 2, acc)) norms.push_back(n.to(*first_device, at::kFloat));
  }
  at::Tensor total = at::linalg_vector_norm(at::stack(norms), 2);
  // Clamped on the device: no .item(), so the host never waits for the GPU here.
  at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);
  for (auto& kv : groups) {
    const at::Tensor c = coef.to(kv.second.front().device());
    at::_foreach_mul_(kv.second, c);
  }
  return total;
}

}  // namespace faceshard
