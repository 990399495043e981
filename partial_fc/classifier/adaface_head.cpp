#include "partial_fc/classifier/adaface_head.h"

#include <cmath>

#include "partial_fc/runtime/error.h"

namespace faceshard {

AdaFaceHead::AdaFaceHead(const std::map<std::string, double>& p)
    : m_(p.at("m")), h_(p.at("h")), s_(p.at("s")), t_alpha_(p.at("t_alpha")) {
  if (!(t_alpha_ >= 0 && t_alpha_ <= 1)) throw option_error("t_alpha", "must be in [0, 1], got ", t_alpha_);
  if (!(h_ >= 0)) throw option_error("h", "must be >= 0, got ", h_);
  batch_mean_ = torch::full({1}, 20.0);
  batch_std_ = torch::full({1}, 100.0);
}

HeadRows AdaFaceHead::begin_forward(const HeadInputs& in) {
  const at::Tensor safe = in.norms.to(torch::kFloat).clamp(0.001, 100);
  if (batch_mean_.device() != safe.device()) {
    batch_mean_ = batch_mean_.to(safe.device());
    batch_std_ = batch_std_.to(safe.device());
  }
  // The statistics of this batch join the running ones before they standardise it.
  batch_mean_.copy_(safe.mean().reshape({1}) * t_alpha_ + batch_mean_ * (1 - t_alpha_));
  batch_std_.copy_(safe.std().reshape({1}) * t_alpha_ + batch_std_ * (1 - t_alpha_));
  const at::Tensor z = ((safe - batch_mean_) / (batch_std_ + kEps) * h_).clamp(-1, 1);
  HeadRows r;
  r.a = z * (-m_);     // angular margin
  r.b = z * m_ + m_;   // additive margin
  return r;
}

at::Tensor AdaFaceHead::target(const at::Tensor& c, const HeadRows& r) const {
  const at::Tensor theta = c.clamp(-1 + kEps, 1 - kEps).acos();
  return (theta + r.a).clamp(kEps, M_PI - kEps).cos() - r.b;
}

at::Tensor AdaFaceHead::target_grad(const at::Tensor& c, const HeadRows& r) const {
  const at::Tensor cc = c.clamp(-1 + kEps, 1 - kEps), theta = cc.acos(), tm = theta + r.a;
  // d cos(theta_m)/dc = sin(theta_m) / sin(theta); zero where a clamp or clip holds.
  const at::Tensor live = (c >= -1 + kEps) & (c <= 1 - kEps) & (tm >= kEps) & (tm <= M_PI - kEps);
  return torch::where(live, tm.sin() / (1 - cc * cc).sqrt(), torch::zeros_like(c));
}

void AdaFaceHead::negatives_forward(at::Tensor logits, at::Tensor codes, const HeadRows&) const {
  const double hi = s_ * (1 - kEps);
  codes.copy_((logits > hi) | (logits < -hi));
  logits.clamp_(-hi, hi);
}

void AdaFaceHead::negatives_backward(at::Tensor grad, const at::Tensor&, const at::Tensor& codes,
                                     const HeadRows&) const {
  grad.masked_fill_(codes != 0, 0.0);
}

std::vector<std::pair<std::string, at::Tensor>> AdaFaceHead::state() const {
  return {{"batch_mean", batch_mean_}, {"batch_std", batch_std_}};
}

}  // namespace faceshard
