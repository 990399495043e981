#include "partial_fc/classifier/margin.h"

#include <cmath>

namespace faceshard {
namespace {
// Keeps acos and 1/sin(theta) finite at c = +-1.
constexpr double kClampEps = 1e-7;

double theta_max(const CombinedMargin& m) { return (M_PI - m.m2) / m.m1; }
}  // namespace

at::Tensor CombinedMargin::target(const at::Tensor& c) const {
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
  if (m1 == 1.0 && m2 == 0.0) return torch::ones_like(c);
  at::Tensor cc = c.clamp(-1 + kClampEps, 1 - kClampEps);
  at::Tensor theta = cc.acos();
  at::Tensor inside = (theta * m1 + m2).sin() * m1 / theta.sin();
  const double tmax = theta_max(*this);
  if (tmax >= M_PI) return inside;
  return torch::where(theta <= tmax, inside, torch::ones_like(c));
}

}  // namespace faceshard
