// The GPU's one-pass update of the classifier's rows (row_update_cuda.h) against its
// reference, the CPU's loop (row_update_cpu.h): fp32 and bf16 centres, fp32 and bf16
// momentum, with and without the sampled index, the learning rate as a device value, and the
// lost-update counts. bf16 rows must come out with the same bits wherever their fp32 values
// agree (the same keys), fp32 values within 1e-6 of the reference and bf16 ones within one
// bf16 step of their magnitude, plus fp32 ulps of the update's terms where it cancels most of
// a value (tests/bf16_bound.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "partial_fc/classifier/row_update_cpu.h"
#include "partial_fc/classifier/row_update_cuda.h"
#include "tests/bf16_bound.h"

namespace faceshard {
namespace {

TEST(RowUpdateCuda, SameAsTheCpuLoop) {
  if (!torch::cuda::is_available() || !sgd_projected_rows_cuda_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(11);
  constexpr int64_t kRows = 300, kDim = 200, kN = 96;  // d not a multiple of the block's threads
  for (const at::ScalarType wt : {at::kFloat, at::kBFloat16})
    for (const at::ScalarType mt : {at::kFloat, at::kBFloat16})
      for (const bool sampled : {false, true})
        for (const bool device_lr : {false, true}) {
          SCOPED_TRACE(std::string(c10::toString(wt)) + " weight, " + c10::toString(mt) + " momentum" +
                       (sampled ? ", sampled" : "") + (device_lr ? ", device lr" : ""));
          at::Tensor w_cpu = torch::randn({kRows, kDim}).mul_(0.05).to(wt);
          at::Tensor m_cpu = torch::randn({kRows, kDim}).mul_(0.01).to(mt);
          const at::Tensor raw = torch::randn({kN, kDim}).mul_(0.1);
          const at::Tensor inv = w_cpu.to(at::kFloat).narrow(0, 7, kN).norm(2, {1}).reciprocal();
          const at::Tensor index = sampled ? std::get<0>(torch::randperm(kRows).narrow(0, 0, kN).sort()) : at::Tensor();
          const RowSgd sgd{0.1, 0.9, 5e-4};
          RowRounding round_cpu{2048, 17, 1000, false, torch::zeros({2}, torch::kLong)};
          RowRounding round_gpu{2048, 17, 1000, false, torch::zeros({2}, torch::dtype(torch::kLong).device(torch::kCUDA))};
          const at::Tensor w_before = w_cpu.clone(), m_before = m_cpu.clone();
          at::Tensor w_gpu = w_cpu.to(torch::kCUDA), m_gpu = m_cpu.to(torch::kCUDA);
          sgd_projected_rows_cpu(w_cpu, m_cpu, raw, inv, sampled ? 0 : 7, index, sgd, round_cpu);
          const at::Tensor lr = device_lr ? torch::full({1}, 0.1, torch::dtype(torch::kFloat).device(torch::kCUDA))
                                          : at::Tensor();
          RowSgd sgd_gpu = sgd;
          if (device_lr) sgd_gpu.lr = 123.0;  // must be ignored
          sgd_projected_rows_cuda(w_gpu, m_gpu, raw.to(torch::kCUDA), inv.to(torch::kCUDA), sampled ? 0 : 7,
                                  sampled ? index.to(torch::kCUDA) : index, sgd_gpu, round_gpu, lr);
          const at::Tensor w_back = w_gpu.cpu(), m_back = m_gpu.cpu();
          // fp32: within 1e-6; bf16: at most one bf16 step of each value's own magnitude (the
          // GPU's fused multiply-adds and reduction order move fp32 results by an ulp, which
          // can move the rounded value by a step: tests/bf16_bound.h, and the CPU emulation
          // of it in RowUpdateBound.FusedMultiplyAddsStayWithinOneBf16Step).
          const auto [w_terms, m_terms] = testing::row_update_terms(
              w_before, m_before, raw, sampled ? index : torch::arange(7, 7 + kN), sgd.lr, sgd.momentum, sgd.weight_decay);
          if (wt == at::kFloat)
            EXPECT_LE((w_back.to(at::kDouble) - w_cpu.to(at::kDouble)).abs().max().item<double>(), 1e-6) << "weight";
          else
            EXPECT_LE(testing::max_steps_apart_given_terms(w_back, w_cpu, w_terms), 1.0) << "weight";
          if (mt == at::kFloat)
            EXPECT_LE((m_back.to(at::kDouble) - m_cpu.to(at::kDouble)).abs().max().item<double>(), 1e-6) << "momentum";
          else
            EXPECT_LE(testing::max_steps_apart_given_terms(m_back, m_cpu, m_terms), 1.0) << "momentum";
          if (wt == at::kBFloat16) {
            // Stochastic rounding with the same keys: equal bits on (almost) every element; the
            // rest differ by one bf16 step where the fp32 values differ in their last bits.
            const double same = w_back.view(at::kShort).eq(w_cpu.view(at::kShort)).to(at::kDouble).mean().item<double>();
            EXPECT_GE(same, 0.999);
            const at::Tensor lost_gpu = round_gpu.lost.cpu();
            EXPECT_EQ(lost_gpu[1].item<int64_t>(), round_cpu.lost[1].item<int64_t>());
            EXPECT_NEAR(lost_gpu[0].item<int64_t>(), round_cpu.lost[0].item<int64_t>(), kN * kDim / 1000 + 1);
          }
          // Rows outside the chunk never move.
          const at::Tensor moved_rows = sampled ? index : torch::arange(7, 7 + kN);
          at::Tensor untouched = torch::ones({kRows}, torch::kBool).index_fill_(0, moved_rows, false);
          EXPECT_TRUE(w_back.index({untouched}).equal(w_cpu.index({untouched})));
        }
}

}  // namespace
}  // namespace faceshard
