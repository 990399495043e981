// AdaFace (Kim et al., CVPR 2022; mk-minchul/AdaFace head.py): the margin of each row
// follows its feature norm, standardised by running statistics of the norms (EMA with
// t_alpha over the global batch): angular margin -m * z on the target's angle (clipped to
// [eps, pi - eps]) and additive margin m + m * z on its cosine, z = clip(h * (a - mean) /
// (std + eps), -1, 1), a the detached norm clipped to [0.001, 100]; every cosine is clamped
// to [-1 + eps, 1 - eps], eps = 1e-3. The gradient is the authors' autograd's.
#pragma once
#include <map>
#include <string>

#include "partial_fc/classifier/margin_head.h"

namespace faceshard {

class AdaFaceHead : public MarginHead {
 public:
  explicit AdaFaceHead(const std::map<std::string, double>& p);
  std::string name() const override { return "adaface"; }
  double scale() const override { return s_; }
  bool needs_norms() const override { return true; }
  HeadRows begin_forward(const HeadInputs& in) override;
  at::Tensor target(const at::Tensor& c, const HeadRows& rows) const override;
  at::Tensor target_grad(const at::Tensor& c, const HeadRows& rows) const override;
  bool modifies_negatives() const override { return true; }
  void negatives_forward(at::Tensor logits, at::Tensor codes, const HeadRows& rows) const override;
  void negatives_backward(at::Tensor grad, const at::Tensor& logits, const at::Tensor& codes,
                          const HeadRows& rows) const override;
  std::vector<std::pair<std::string, at::Tensor>> state() const override;

 private:
  static constexpr double kEps = 1e-3;
  double m_, h_, s_, t_alpha_;
  mutable at::Tensor batch_mean_, batch_std_;  // [1] fp32 on the buffer's device
};

}  // namespace faceshard
