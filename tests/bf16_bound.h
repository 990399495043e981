// The bar for two bf16 results of one computation done in two fp32 evaluation orders (a GPU's
// fused multiply-adds and its reduction order against the CPU's loop): the fp32 values may
// differ in their last bits, which moves a rounded bf16 value by one bf16 step at most, the
// step being that of the value's own magnitude (2^(e - 7) for |v| in [2^e, 2^(e+1))). An
// absolute tolerance would be below one step for the larger values and above several for
// the small ones.
#pragma once
#include <torch/torch.h>

#include <utility>

namespace faceshard::testing {

// Per element: one bf16 step at max(|a|, |b|) (the smallest normal bf16 step for zeros).
inline at::Tensor bf16_step_at(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor m = torch::maximum(a.to(at::kDouble).abs(), b.to(at::kDouble).abs()).clamp_min(1.1754943508222875e-38);
  return torch::exp2(torch::floor(torch::log2(m)) - 7.0);
}

// The largest |a - b| in units of that step (<= 1 when the two agree to one bf16 step).
inline double max_bf16_steps_apart(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return 0.0;
  return ((a.to(at::kDouble) - b.to(at::kDouble)).abs() / bf16_step_at(a, b)).max().item<double>();
}

// The same for values that come out of a sum whose terms are larger than the result (an
// update that cancels most of a value: w - lr * step near zero): there the two fp32
// evaluations differ by ulps of the terms, not of the result. Each element's allowance is one
// bf16 step of the result plus 4 fp32 ulps (2^-21) of `terms`, the magnitude of the largest
// term that element summed (same shape).
inline double max_steps_apart_given_terms(const at::Tensor& a, const at::Tensor& b, const at::Tensor& terms) {
  if (a.numel() == 0) return 0.0;
  const at::Tensor allowance = bf16_step_at(a, b) + terms.to(at::kDouble).abs() * 4.76837158203125e-07;
  return ((a.to(at::kDouble) - b.to(at::kDouble)).abs() / allowance).max().item<double>();
}

// The terms of the classifier's row update (row_update_cpu.h) per element of the weight and
// of the momentum: w' = w - lr m' with m' = mom m + (g - c w) + wd w, c = (w . g) / ||w||^2,
// for the updated rows `rows` of w0/m0 (before) whose gradient rows are `raw` (one per
// updated row); zero elsewhere (rows that do not move compare exactly).
inline std::pair<at::Tensor, at::Tensor> row_update_terms(const at::Tensor& w0, const at::Tensor& m0,
                                                          const at::Tensor& raw, const at::Tensor& rows, double lr,
                                                          double momentum, double weight_decay) {
  const at::Tensor w = w0.to(at::kDouble).index_select(0, rows), m = m0.to(at::kDouble).index_select(0, rows);
  const at::Tensor g = raw.to(at::kDouble);
  const at::Tensor c = (w * g).sum(1, true) / (w * w).sum(1, true);
  const at::Tensor step = momentum * m.abs() + g.abs() + (c * w).abs() + weight_decay * w.abs();
  at::Tensor wt = torch::zeros(w0.sizes(), at::kDouble), mt = torch::zeros(m0.sizes(), at::kDouble);
  wt.index_copy_(0, rows, w.abs() + lr * step);
  mt.index_copy_(0, rows, step);
  return {wt, mt};
}

}  // namespace faceshard::testing
