#include "app/train/lr_schedule.h"

#include <cmath>

#include "base/error.h"

namespace faceshard {

void PolyWarmupSchedule::validate() const {
  if (!(base_lr >= 0) || !std::isfinite(base_lr))
    throw usage_error("lr schedule: base_lr must be a finite number >= 0 (got ", base_lr, ")");
  if (warmup_steps < 0) throw usage_error("lr schedule: warmup_steps must be >= 0 (got ", warmup_steps, ")");
  if (total_steps < 1) throw usage_error("lr schedule: total_steps must be >= 1 (got ", total_steps, ")");
  if (warmup_steps > total_steps)
    throw usage_error("lr schedule: warmup_steps (", warmup_steps, ") must not exceed total_steps (", total_steps, ")");
  if (!(power > 0) || !std::isfinite(power))
    throw usage_error("lr schedule: power must be a finite number > 0 (got ", power, ")");
}

double PolyWarmupSchedule::lr(int64_t step) const {
  validate();
  if (step < 0) throw usage_error("lr schedule: step must be >= 0 (got ", step, ")");
  if (step >= total_steps) return 0.0;
  if (step < warmup_steps) return base_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  // Here warmup_steps <= step < total_steps, so total_steps - warmup_steps >= 1.
  const double frac = static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
  return base_lr * std::pow(1.0 - frac, power);
}

}  // namespace faceshard
