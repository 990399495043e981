#include "partial_fc/classifier/magface_head.h"

#include <cmath>

#include "partial_fc/runtime/error.h"

namespace faceshard {

MagFaceHead::MagFaceHead(const std::map<std::string, double>& p)
    : l_a_(p.at("l_a")),
      u_a_(p.at("u_a")),
      l_m_(p.at("l_m")),
      u_m_(p.at("u_m")),
      lambda_g_(p.at("lambda_g")),
      s_(p.at("s")),
      easy_(p.at("easy_margin") != 0) {
  if (!(l_a_ > 0 && u_a_ > l_a_)) throw option_error("u_a", "must exceed l_a > 0, got l_a ", l_a_, ", u_a ", u_a_);
}

HeadRows MagFaceHead::begin_forward(const HeadInputs& in) {
  const at::Tensor a = in.norms.to(torch::kFloat);
  const double slope = (u_m_ - l_m_) / (u_a_ - l_a_);
  HeadRows r;
  r.a = (a.clamp(l_a_, u_a_) - l_a_) * slope + l_m_;                                     // m(a)
  r.b = torch::where((a >= l_a_) & (a <= u_a_), torch::full_like(a, slope), torch::zeros_like(a));  // dm/da
  return r;
}

at::Tensor MagFaceHead::target(const at::Tensor& c, const HeadRows& r) const {
  const at::Tensor cc = c.clamp(-1, 1), sin = (1 - cc * cc).sqrt();
  const at::Tensor ctm = cc * r.a.cos() - sin * r.a.sin();
  if (easy_) return torch::where(cc > 0, ctm, cc);
  return torch::where(cc > (M_PI - r.a).cos(), ctm, cc - (M_PI - r.a).sin() * r.a);
}

at::Tensor MagFaceHead::target_grad(const at::Tensor& c, const HeadRows& r) const {
  const at::Tensor cc = c.clamp(-1, 1);
  const at::Tensor d = r.a.cos() + cc * r.a.sin() / (1 - cc * cc).sqrt();
  const at::Tensor on = easy_ ? cc > 0 : cc > (M_PI - r.a).cos();
  return torch::where(on, d, torch::ones_like(cc));
}

at::Tensor MagFaceHead::target_grad_norm(const at::Tensor& c, const HeadRows& r) const {
  const at::Tensor cc = c.clamp(-1, 1), sin = (1 - cc * cc).sqrt();
  // d/dm of cos(theta + m) = -(c sin m + sin(theta) cos m); of c - sin(m) m: -(m cos m + sin m).
  const at::Tensor on_arc = -(cc * r.a.sin() + sin * r.a.cos());
  if (easy_) return torch::where(cc > 0, on_arc, torch::zeros_like(cc)) * r.b;
  return torch::where(cc > (M_PI - r.a).cos(), on_arc, -(r.a * r.a.cos() + r.a.sin())) * r.b;
}

at::Tensor MagFaceHead::extra_loss(const at::Tensor& norms) const {
  const at::Tensor a = norms.to(torch::kFloat).clamp(l_a_, u_a_);
  return (a / (u_a_ * u_a_) + a.reciprocal()).mean() * lambda_g_;
}

}  // namespace faceshard
