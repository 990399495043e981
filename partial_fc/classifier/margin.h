// The combined margin on the target logit, in one of two modes (the non-target logits are
// s * cos in both):
//
// Exact (the default): s * (cos(m1*theta + m2) - m3), with ArcFace = (1, 0.5, 0), CosFace =
// (1, 0, 0.4), SphereFace-like m1 > 1, and combinations, and its EXACT gradient
//   d/dc cos(m1*acos(c) + m2) = m1 * sin(m1*theta + m2) / sin(theta).
// Where m1*theta + m2 > pi the cosine would turn back up (a wrong-way margin), so beyond
// theta_max = (pi - m2) / m1 the target logit continues linearly with slope 1 in c:
//   t(c) = c - c_max - 1 - m3, c_max = cos(theta_max), continuous at the boundary.
//
// ArcfaceTorch: what arcface_torch's CombinedMarginLoss computes (losses.py, since the
// additive angular margin moved under torch.no_grad()):
//   m3 > 0:            t = c - m3 (m1 and m2 are ignored, even when set), gradient 1;
//   m1 = 1, m3 = 0:    t = cos(acos(c) + m2) with no correction where theta + m2 > pi (the
//                      cosine turns back up there), and the gradient passed straight
//                      through: dt/dc = 1, as if the target were the plain cosine;
//   anything else (m1 != 1 without m3, m3 < 0): arcface_torch raises; validate() rejects it.
// Its DistCrossEntropy also reports log(max(p_target, 1e-30)), so a row's loss is capped at
// -log(1e-30) (row_loss_cap()); the gradient ignores the cap, there as here.
#pragma once
#include <torch/torch.h>

namespace faceshard {

enum class MarginMode { Exact, ArcfaceTorch };

// "exact" | "arcface_torch" (option_error naming "margin_mode" otherwise).
MarginMode parse_margin_mode(const std::string& text);
const char* to_string(MarginMode mode);

struct CombinedMargin {
  double m1 = 1.0, m2 = 0.5, m3 = 0.0;
  double scale = 64.0;
  // Non-target cosines above this value are treated as 0 (arcface_torch's inter-class
  // filtering for noisy labels); 0 = off.
  double interclass_filter = 0.0;
  MarginMode mode = MarginMode::Exact;

  bool is_identity() const { return m1 == 1.0 && m2 == 0.0 && m3 == 0.0; }
  // True when dt/dc = 1 for every c: the backward leaves the target entries as they are.
  bool unit_gradient() const;
  // Throws option_error naming "margin" for margins the mode cannot express.
  void validate() const;
  // t(c) before scaling, element-wise (any floating dtype; c in [-1, 1]).
  at::Tensor target(const at::Tensor& cos) const;
  // dt/dc, element-wise.
  at::Tensor target_grad(const at::Tensor& cos) const;
  // The largest loss a single row reports (infinity: none).
  double row_loss_cap() const;
};

}  // namespace faceshard
