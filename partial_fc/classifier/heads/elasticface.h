// ElasticFace (Boutros et al., CVPRW 2022; fdbtrs/ElasticFace utils/losses.py): each row's
// margin drawn from N(m, sigma) every step: ElasticFace-Arc cos(theta + m_i) (no correction
// past pi, as there), ElasticFace-Cos cos - m_i. The "plus" variant sorts the draws and hands
// them out by the target cosines' descending order exactly as the authors' code indexes
// them (margin_sorted[argsort_desc(cos_y)][i]). Draws come from a generator seeded by the
// run's seed and the forward count: every rank draws the same, and a resumed run draws what
// the uninterrupted one would have.
#pragma once
#include <map>
#include <string>

#include "partial_fc/classifier/margin_head.h"

namespace faceshard {

class ElasticFaceHead : public MarginHead {
 public:
  ElasticFaceHead(const std::map<std::string, double>& p, bool arc);
  std::string name() const override { return arc_ ? "elasticface_arc" : "elasticface_cos"; }
  double scale() const override { return s_; }
  bool needs_target_cosines() const override { return plus_; }
  HeadRows begin_forward(const HeadInputs& in) override;
  at::Tensor target(const at::Tensor& c, const HeadRows& rows) const override;
  at::Tensor target_grad(const at::Tensor& c, const HeadRows& rows) const override;
  bool unit_gradient() const override { return !arc_; }

 private:
  double m_, sigma_, s_;
  bool plus_, arc_;
};

// The N margins ElasticFace draws for a forward (before the plus variant's ordering).
at::Tensor elasticface_draws(int64_t n, double m, double sigma, uint64_t seed, int64_t forward);

}  // namespace faceshard
