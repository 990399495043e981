// MagFace (Meng et al., CVPR 2021; IrvingMeng/MagFace models/magface.py): an ArcFace margin
// m(a) = (u_m - l_m) / (u_a - l_a) * (a - l_a) + l_m that grows with the feature norm a
// (clamped to [l_a, u_a]), easy margin by default (cosines <= 0 keep no margin), and the
// regulariser lambda_g * mean(a / u_a^2 + 1 / a) added to the loss. The norm's gradient
// flows through both: that is what MagFace trains.
#include <cmath>
#include <map>
#include <memory>
#include <string>

#include "partial_fc/classifier/margin_head.h"
#include "base/error.h"

namespace faceshard {
namespace {

class MagFaceHead : public MarginHead {
 public:
  explicit MagFaceHead(const std::map<std::string, double>& p);
  std::string name() const override { return "magface"; }
  double scale() const override { return s_; }
  bool needs_norms() const override { return true; }
  bool norm_gradient() const override { return true; }
  HeadRows begin_forward(const HeadInputs& in) override;
  at::Tensor target(const at::Tensor& c, const HeadRows& rows) const override;
  at::Tensor target_grad(const at::Tensor& c, const HeadRows& rows) const override;
  at::Tensor target_grad_norm(const at::Tensor& c, const HeadRows& rows) const override;
  at::Tensor extra_loss(const at::Tensor& norms) const override;

 private:
  double l_a_, u_a_, l_m_, u_m_, lambda_g_, s_;
  bool easy_;
};

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

}  // namespace

FACESHARD_MARGIN_HEADS(magface) {
  register_margin_head(
      {"magface",
       "MagFace (Meng et al., CVPR 2021): an ArcFace margin growing linearly with the clamped feature norm, plus "
       "lambda_g mean(a / u_a^2 + 1 / a) in the loss",
       {{"l_a", 10.0, 0, kUnbounded, true, false, "the norm's lower bound"},
        {"u_a", 110.0, 0, kUnbounded, true, false, "the norm's upper bound"},
        {"l_m", 0.45, 0, kUnbounded, false, false, "the margin at the lower bound"},
        {"u_m", 0.8, 0, kUnbounded, false, false, "the margin at the upper bound"},
        {"lambda_g", 35.0, 0, kUnbounded, false, false, "the weight of the norm regulariser"},
        {"s", 64.0, 0, kUnbounded, true, false, "the logits' scale"},
        {"easy_margin", 1.0, 0, 1, false, true, "the margin only where the target cosine is positive"}}},
      [](const std::map<std::string, double>& p, const CombinedMargin&) { return std::make_unique<MagFaceHead>(p); });
}

}  // namespace faceshard
