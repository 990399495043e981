// The bar RowUpdateCuda.SameAsTheCpuLoop holds the GPU's row update to, checked on the CPU:
// the update evaluated as a GPU evaluates it -- every a * b + c contracted into one fused
// multiply-add (one rounding instead of two), the dot product summed in another order --
// against the CPU's loop (row_update_cpu.h) with the same stochastic-rounding keys. fp32
// results move by an ulp, and bf16 results, on almost no element, by at most one bf16 step of
// their own magnitude -- plus fp32 ulps of the update's terms where the update cancels most of
// a value (tests/bf16_bound.h); a fixed absolute tolerance is below one step for the test's
// larger values, and one step of the result alone is below the cancelling ones.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "partial_fc/classifier/row_update_cpu.h"
#include "partial_fc/classifier/stochastic_round.h"
#include "tests/bf16_bound.h"

namespace faceshard {
namespace {

// One row's update as a GPU thread block evaluates it: fused multiply-adds, a sequential dot.
template <typename WT, typename MT>
void fused_update(WT* w_row, MT* m_row, const float* g, int64_t d, float inv_norm, const RowSgd& o, uint32_t key) {
  std::vector<float> w(static_cast<size_t>(d));
  for (int64_t k = 0; k < d; ++k) w[size_t(k)] = static_cast<float>(w_row[k]);
  float dot = 0;
  for (int64_t k = d - 1; k >= 0; --k) dot = std::fma(w[size_t(k)], g[k], dot);
  const float c = dot * inv_norm * inv_norm;
  const float lr = static_cast<float>(o.lr), mom = static_cast<float>(o.momentum), wd = static_cast<float>(o.weight_decay);
  for (int64_t k = 0; k < d; ++k) {
    const float grad = std::fma(wd, w[size_t(k)], std::fma(-c, w[size_t(k)], g[k]));
    const float step = std::fma(mom, static_cast<float>(m_row[k]), grad);
    m_row[k] = static_cast<MT>(step);
    w[size_t(k)] = std::fma(-lr, step, w[size_t(k)]);
  }
  for (int64_t k = 0; k < d; ++k) {
    if constexpr (std::is_same_v<WT, float>)
      w_row[k] = w[size_t(k)];
    else
      w_row[k] = sr_round(w[size_t(k)], sr_bits(key, static_cast<uint32_t>(k)));
  }
}

template <typename WT, typename MT>
void fused_rows(at::Tensor& w, at::Tensor& m, const at::Tensor& raw, const at::Tensor& inv, int64_t first,
                const RowSgd& o, const RowRounding& r) {
  for (int64_t i = 0; i < raw.size(0); ++i) {
    const int64_t row = first + i;
    fused_update(w.data_ptr<WT>() + row * w.size(1), m.data_ptr<MT>() + row * m.size(1),
                 raw.data_ptr<float>() + i * raw.size(1), raw.size(1), inv[i].item<float>(), o,
                 sr_row_key(r.seed, r.step, r.class_start + row));
  }
}

TEST(RowUpdateBound, FusedMultiplyAddsStayWithinOneBf16Step) {
  torch::manual_seed(11);
  constexpr int64_t kRows = 2000, kDim = 200, kFirst = 7, kN = 1900;  // the values RowUpdateCuda makes, more rows
  const RowSgd sgd{0.1, 0.9, 5e-4};
  const RowRounding rounding{2048, 17, 1000, false, at::Tensor()};
  const at::Tensor w0 = torch::randn({kRows, kDim}).mul_(0.05), m0 = torch::randn({kRows, kDim}).mul_(0.01);
  const at::Tensor raw = torch::randn({kN, kDim}).mul_(0.1);
  const at::Tensor inv = w0.narrow(0, kFirst, kN).norm(2, {1}).reciprocal();
  // fp32 weight and momentum: the two evaluations differ in the last bits on many values.
  {
    at::Tensor w_loop = w0.clone(), m_loop = m0.clone(), w_fma = w0.clone(), m_fma = m0.clone();
    sgd_projected_rows_cpu(w_loop, m_loop, raw, inv, kFirst, at::Tensor(), sgd, rounding);
    fused_rows<float, float>(w_fma, m_fma, raw, inv, kFirst, sgd, rounding);
    const double differ = w_loop.ne(w_fma).to(at::kDouble).mean().item<double>();
    EXPECT_GT(differ, 0.01) << "the emulation computes what the loop computes: it tests nothing";
    EXPECT_LE((w_loop - w_fma).abs().max().item<double>(), 1e-6);
    std::cout << "[row update] fp32: " << 100 * differ << "% of the weights differ in their last bits\n";
  }
  // bf16 weight (stochastically rounded with the same keys) and bf16 momentum.
  at::Tensor w_loop = w0.to(at::kBFloat16), m_loop = m0.to(at::kBFloat16);
  at::Tensor w_fma = w_loop.clone(), m_fma = m_loop.clone();
  sgd_projected_rows_cpu(w_loop, m_loop, raw, inv, kFirst, at::Tensor(), sgd, rounding);
  fused_rows<c10::BFloat16, c10::BFloat16>(w_fma, m_fma, raw, inv, kFirst, sgd, rounding);
  const double same_w = w_loop.view(at::kShort).eq(w_fma.view(at::kShort)).to(at::kDouble).mean().item<double>();
  const double same_m = m_loop.view(at::kShort).eq(m_fma.view(at::kShort)).to(at::kDouble).mean().item<double>();
  EXPECT_GE(same_w, 0.999);
  EXPECT_GE(same_m, 0.999);
  EXPECT_LT(same_w + same_m, 2.0) << "no bf16 value moved: the bar below is not exercised";
  // One bf16 step of each value, plus fp32 ulps of the terms where the update cancels most of
  // a value (there the result is far smaller than what was summed: one step of the result
  // alone is not the bar, and a few such values exist among the 380,000).
  const auto [w_terms, m_terms] =
      testing::row_update_terms(w0, m0, raw, torch::arange(kFirst, kFirst + kN), sgd.lr, sgd.momentum, sgd.weight_decay);
  EXPECT_LE(testing::max_steps_apart_given_terms(w_fma, w_loop, w_terms), 1.0);
  EXPECT_LE(testing::max_steps_apart_given_terms(m_fma, m_loop, m_terms), 1.0);
  // The bar without the terms fails on those values: the allowance is what they need.
  EXPECT_GT(std::max(testing::max_bf16_steps_apart(w_fma, w_loop), testing::max_bf16_steps_apart(m_fma, m_loop)), 1.0);
  // The absolute tolerances this bar replaces (0.0079 x 0.06 for the weight, x 0.02 for the
  // momentum) were under one bf16 step at the largest values the test makes.
  EXPECT_LT(0.0079 * 0.06, testing::bf16_step_at(w_loop, w_loop).max().item<double>());
  EXPECT_LT(0.0079 * 0.02, testing::bf16_step_at(m_loop, m_loop).max().item<double>());
  std::cout << "[row update] bf16: " << 100 * (1 - same_w) << "% of the weights and " << 100 * (1 - same_m)
            << "% of the momentum values one step apart\n";
}

}  // namespace
}  // namespace faceshard
