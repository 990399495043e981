// SphereFace (Liu et al., CVPR 2017): the multiplicative angular margin of A-Softmax on
// normalised features, psi(theta) = (-1)^k cos(m theta) - 2k for theta in [k pi / m,
// (k + 1) pi / m], which keeps the target logit falling monotonically in theta for any m >= 1;
// logits s * psi(theta_y) for the target and s * cos(theta) for the others.
#include <cmath>
#include <map>
#include <memory>
#include <string>

#include "partial_fc/classifier/margin_head.h"

namespace faceshard {
namespace {

class SphereFaceHead : public MarginHead {
 public:
  explicit SphereFaceHead(const std::map<std::string, double>& p) : m_(p.at("m")), s_(p.at("s")) {}
  std::string name() const override { return "sphereface"; }
  double scale() const override { return s_; }
  at::Tensor target(const at::Tensor& c, const HeadRows&) const override {
    const at::Tensor theta = c.clamp(-1, 1).acos(), k = interval(theta);
    return sign(k) * (theta * m_).cos() - 2 * k;
  }
  // d psi / dc = (-1)^k m sin(m theta) / sin(theta) (k is piecewise constant).
  at::Tensor target_grad(const at::Tensor& c, const HeadRows&) const override {
    const at::Tensor cc = c.clamp(-1, 1), theta = cc.acos();
    return sign(interval(theta)) * m_ * (theta * m_).sin() / (1 - cc * cc).sqrt();
  }

 private:
  // k = floor(m theta / pi), at most ceil(m) - 1 (theta = pi).
  at::Tensor interval(const at::Tensor& theta) const {
    return (theta * (m_ / M_PI)).floor().clamp_max(std::ceil(m_) - 1);
  }
  static at::Tensor sign(const at::Tensor& k) { return 1 - 2 * k.remainder(2); }  // (-1)^k
  double m_, s_;
};

}  // namespace

FACESHARD_MARGIN_HEADS(sphereface) {
  register_margin_head(
      {"sphereface",
       "SphereFace (Liu et al., CVPR 2017): the target logit s ((-1)^k cos(m theta) - 2k), theta in [k pi / m, "
       "(k + 1) pi / m], a multiplicative angular margin",
       {{"m", 4.0, 1, kUnbounded, false, false, "the multiplicative angular margin"},
        {"s", 64.0, 0, kUnbounded, true, false, "the logits' scale"}}},
      [](const std::map<std::string, double>& p, const CombinedMargin&) { return std::make_unique<SphereFaceHead>(p); });
}

}  // namespace faceshard
