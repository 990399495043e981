// The learning-rate schedule of the backbone and the classifier: linear warm-up, then
// polynomial decay to 0, evaluated per optimiser step (arcface_torch's PolynomialLRWarmup
// in closed form, so a resumed run needs only the step count to continue it).
#pragma once
#include <cstdint>

namespace faceshard {

// With t = the number of optimiser steps taken before this one (0 for the first step),
// w = warmup_steps, T = total_steps, p = power:
//
//   lr(t) = base_lr * (t + 1) / w                          for 0 <= t < w
//   lr(t) = base_lr * (1 - (t - w) / (T - w))^p            for w <= t < T
//   lr(t) = 0                                              for t >= T
//
// Unlike arcface_torch (whose scheduler returns the full base lr before its first
// scheduler.step(), so step 0 of a warm-up runs at base_lr), the first step here runs at
// base_lr / w: a warm-up exists to keep the first updates small. The warm-up ends at
// base_lr at t = w - 1, and the decay starts from base_lr at t = w, so no step ever runs
// above base_lr, and the last step (t = T - 1) runs at base_lr * (1 / (T - w))^p > 0.
// warmup_steps = 0 means no warm-up (pure decay from base_lr).
struct PolyWarmupSchedule {
  double base_lr = 0.1;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double power = 1.0;

  // Throws faceshard::Error (usage) naming the bad field: base_lr < 0, warmup_steps < 0,
  // total_steps < 1, warmup_steps > total_steps, power <= 0.
  void validate() const;
  // Validates, then evaluates the formula above; step < 0 is an error.
  double lr(int64_t step) const;
};

}  // namespace faceshard
