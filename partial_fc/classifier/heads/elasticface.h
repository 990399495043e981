// ElasticFace (Boutros et al., CVPRW 2022; fdbtrs/ElasticFace utils/losses.py): each row's
// margin drawn from N(m, sigma) every step: ElasticFace-Arc cos(theta + m_i) (no correction
// past pi, as there), ElasticFace-Cos cos - m_i. The "plus" variant sorts the draws and hands
// them out by the target cosines' descending order exactly as the authors' code indexes
// them (margin_sorted[argsort_desc(cos_y)][i]). The draws are a function of the run's seed
// and the forward count alone (elasticface_draws): every rank draws the same, a resumed run
// draws what the uninterrupted one would have, and they are made on the device that uses
// them with tensor operations, so that a step on a GPU neither waits for nor copies from the host.
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

// The N margins ElasticFace draws for a forward (before the plus variant's ordering), fp32
// on `device`: m + sigma * z_i, z_i standard normal by Box-Muller from two uniforms
// (b + 0.5) / 2^32, where b are 32-bit counter-based hashes (sr_hash.h's mix32) of
// (seed, forward) and the counters 2i and 2i + 1. Integer hashing is exact on every device and
// the Box-Muller step runs in float64, so CPU and CUDA give the same fp32 margins (their
// float64 log and cos may differ in the last bit, which the rounding to fp32 hides except in
// about one value in 10^8, then by one fp32 ulp). Nothing is drawn on the host: no generator,
// no copy, no host synchronisation.
at::Tensor elasticface_draws(int64_t n, double m, double sigma, uint64_t seed, int64_t forward,
                             const at::Device& device = at::kCPU);

}  // namespace faceshard
