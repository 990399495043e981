#include "partial_fc/classifier/margin.h"

#include <cmath>
#include <limits>

#include "base/error.h"

namespace faceshard {
namespace {
// Keeps acos and 1/sin(theta) finite at c = +-1.
constexpr double kClampEps = 1e-7;

double theta_max(const CombinedMargin& m) { return (M_PI - m.m2) / m.m1; }

// arcface_torch's branches (CombinedMarginLoss.forward): the additive cosine margin alone
// whenever m3 > 0, the angular one (straight-through) when m1 = 1 and m3 = 0.
bool torch_cosface(const CombinedMargin& m) { return m.m3 > 0; }
}  // namespace

MarginMode parse_margin_mode(const std::string& text) {
  if (text == "exact") return MarginMode::Exact;
  if (text == "arcface_torch") return MarginMode::ArcfaceTorch;
  throw option_error("margin_mode", "'", text, "' is not a margin mode (exact or arcface_torch)");
}

const char* to_string(MarginMode mode) { return mode == MarginMode::Exact ? "exact" : "arcface_torch"; }

void CombinedMargin::validate() const {
  if (!(m1 > 0)) throw option_error("margin", "m1 must be > 0, got ", m1);
  if (mode == MarginMode::ArcfaceTorch && !torch_cosface(*this) && !(m1 == 1.0 && m3 == 0.0))
    throw option_error("margin", "(", m1, ", ", m2, ", ", m3,
                       ") has no arcface_torch equivalent: its CombinedMarginLoss takes m1 = 1 with m3 = 0 "
                       "(ArcFace) or m3 > 0 (CosFace) and raises otherwise; use margin mode exact");
}

bool CombinedMargin::unit_gradient() const {
  if (mode == MarginMode::ArcfaceTorch) return true;
  return m1 == 1.0 && m2 == 0.0;
}

at::Tensor CombinedMargin::target(const at::Tensor& c) const {
  if (mode == MarginMode::ArcfaceTorch) {
    if (torch_cosface(*this)) return c - m3;
    if (m2 == 0.0) return c.clone();
    // acos of the clamped cosine, + m2, cos: no fallback beyond theta + m2 = pi.
    return (c.clamp(-1, 1).acos() + m2).cos();
  }
  if (m1 == 1.0 && m2 == 0.0) return c - m3;
  at::Tensor cc = c.clamp(-1 + kClampEps, 1 - kClampEps);
  at::Tensor theta = cc.acos();
  const double tmax = theta_max(*this);
  at::Tensor inside = (theta * m1 + m2).cos() - m3;
  if (tmax >= M_PI) return inside;
  const double cmax = std::cos(tmax);
  at::Tensor outside = c - cmax - 1 - m3;
  return torch::where(theta <= tmax, inside, outside);
}

at::Tensor CombinedMargin::target_grad(const at::Tensor& c) const {
  if (unit_gradient()) return torch::ones_like(c);
  at::Tensor cc = c.clamp(-1 + kClampEps, 1 - kClampEps);
  at::Tensor theta = cc.acos();
  at::Tensor inside = (theta * m1 + m2).sin() * m1 / theta.sin();
  const double tmax = theta_max(*this);
  if (tmax >= M_PI) return inside;
  return torch::where(theta <= tmax, inside, torch::ones_like(c));
}

double CombinedMargin::row_loss_cap() const {
  if (mode == MarginMode::Exact) return std::numeric_limits<double>::infinity();
  // -log(p) with p clamped at 1e-30 as an fp32 scalar, as arcface_torch's fp32 tensors see it.
  return -std::log(static_cast<double>(static_cast<float>(1e-30)));
}

}  // namespace faceshard
