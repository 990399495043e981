// The combined margin on the target logit: s * (cos(m1*theta + m2) - m3), with
// ArcFace = (1, 0.5, 0), CosFace = (1, 0, 0.4), SphereFace-like m1 > 1, and combinations.
//
// Gradient: EXACT (not passed straight through as arcface_torch does):
//   d/dc cos(m1*acos(c) + m2) = m1 * sin(m1*theta + m2) / sin(theta).
// Where m1*theta + m2 > pi the cosine would turn back up (a wrong-way margin), so beyond
// theta_max = (pi - m2) / m1 the target logit continues linearly with slope 1 in c:
//   t(c) = c - c_max - 1 - m3, c_max = cos(theta_max), continuous at the boundary.
#pragma once
#include <torch/torch.h>

namespace faceshard {

struct CombinedMargin {
  double m1 = 1.0, m2 = 0.5, m3 = 0.0;
  double scale = 64.0;
  // Non-target cosines above this value are treated as 0 (arcface_torch's inter-class
  // filtering for noisy labels); 0 = off.
  double interclass_filter = 0.0;

  bool is_identity() const { return m1 == 1.0 && m2 == 0.0 && m3 == 0.0; }
  // t(c) before scaling, element-wise (any floating dtype).
  at::Tensor target(const at::Tensor& cos) const;
  // dt/dc, element-wise.
  at::Tensor target_grad(const at::Tensor& cos) const;
};

}  // namespace faceshard
