// MagFace (Meng et al., CVPR 2021; IrvingMeng/MagFace models/magface.py): an ArcFace margin
// m(a) = (u_m - l_m) / (u_a - l_a) * (a - l_a) + l_m that grows with the feature norm a
// (clamped to [l_a, u_a]), easy margin by default (cosines <= 0 keep no margin), and the
// regulariser lambda_g * mean(a / u_a^2 + 1 / a) added to the loss. The norm's gradient
// flows through both: that is what MagFace trains.
#pragma once
#include <map>
#include <string>

#include "partial_fc/classifier/margin_head.h"

namespace faceshard {

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

}  // namespace faceshard
