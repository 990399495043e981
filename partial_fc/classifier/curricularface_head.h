// CurricularFace (Huang et al., CVPR 2020; HuangYG123/CurricularFace head/metrics.py): an
// ArcFace target cos(theta + m) (c - sin(pi - m) * m past theta + m > pi), and every
// non-target cosine above its row's cos(theta_y + m) becomes c * (t + c), t an EMA (0.01)
// of the mean target cosine of the global batch, updated before it is used (no gradient
// through t). The target cosines live on their owners' shards: one [N] all-reduce shares them.
#pragma once
#include <map>
#include <string>

#include "partial_fc/classifier/margin_head.h"

namespace faceshard {

class CurricularFaceHead : public MarginHead {
 public:
  explicit CurricularFaceHead(const std::map<std::string, double>& p);
  std::string name() const override { return "curricularface"; }
  double scale() const override { return s_; }
  bool needs_target_cosines() const override { return true; }
  HeadRows begin_forward(const HeadInputs& in) override;
  at::Tensor target(const at::Tensor& c, const HeadRows& rows) const override;
  at::Tensor target_grad(const at::Tensor& c, const HeadRows& rows) const override;
  bool modifies_negatives() const override { return true; }
  void negatives_forward(at::Tensor logits, at::Tensor codes, const HeadRows& rows) const override;
  void negatives_backward(at::Tensor grad, const at::Tensor& logits, const at::Tensor& codes,
                          const HeadRows& rows) const override;
  std::vector<std::pair<std::string, at::Tensor>> state() const override { return {{"t", t_}}; }

 private:
  double m_, s_, cos_m_, sin_m_, threshold_, mm_;
  at::Tensor t_;  // [1] fp32
};

}  // namespace faceshard
