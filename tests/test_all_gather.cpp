// AllGather with gradient against a single process that holds the concatenated tensor,
// for W = 1, 2, 3 with equal and unequal row counts, and the seed documents' numbers; the
// GlooCuda cases gather CUDA tensors at world 2 with both ranks on cuda:0 over Gloo (its
// backward's reduce-scatter staged through the host).
#include <gtest/gtest.h>

#include "partial_fc/data_parallel/all_gather.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

int64_t rows_of(int q, bool uneven) { return uneven ? (q == 1 ? 0 : q + 2) : 3; }

struct Case {
  int world;
  bool uneven;
  GatherGrad mode;
  bool cuda = false;  // the rank's rows on cuda:0 (every rank on the same GPU, over Gloo)
};

class AllGatherGrad : public ::testing::TestWithParam<Case> {};

TEST_P(AllGatherGrad, MatchesSingleProcess) {
  const Case c = GetParam();
  if (c.cuda && !torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  testing::run_ranks(c.world, [c](Distributed& d) {
    const torch::Device dev = c.cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
    const int W = d.world_size(), r = d.rank();
    int64_t total = 0;
    std::vector<at::Tensor> xs, ws;
    for (int q = 0; q < W; ++q) total += rows_of(q, c.uneven);
    for (int q = 0; q < W; ++q) {
      torch::manual_seed(100 + q);
      xs.push_back(torch::randn({rows_of(q, c.uneven), 4}, torch::kDouble));
      torch::manual_seed(200 + q);
      ws.push_back(torch::randn({total, 4}, torch::kDouble));  // rank q's loss weights
    }
    // Reference: one process, the concatenated tensor, autograd.
    std::vector<at::Tensor> leaves;
    for (auto& x : xs) leaves.push_back(x.clone().requires_grad_());
    at::Tensor X = torch::cat(leaves);
    at::Tensor ref_loss = c.mode == GatherGrad::ReduceScatterSum ? torch::zeros({}, torch::kDouble)
                                                                 : (ws[r] * X * X).sum();
    if (c.mode == GatherGrad::ReduceScatterSum)
      for (int q = 0; q < W; ++q) ref_loss = ref_loss + (ws[q] * X * X).sum();
    ref_loss.backward();
    at::Tensor ref_grad = leaves[r].grad().defined() ? leaves[r].grad() : torch::zeros_like(xs[r]);

    // float64 on either device: the same few sums, the same tolerance.
    at::Tensor x = xs[r].clone().to(dev).requires_grad_();
    at::Tensor G = all_gather_with_grad(d, x, c.mode);
    ASSERT_EQ(G.size(0), total);
    EXPECT_EQ(G.device(), dev);
    EXPECT_TRUE(torch::allclose(G.cpu(), X.detach()));
    (ws[r].to(dev) * G * G).sum().backward();
    ASSERT_TRUE(x.grad().defined());
    EXPECT_EQ(x.grad().device(), dev);
    EXPECT_TRUE(torch::allclose(x.grad().cpu(), ref_grad, 1e-10, 1e-12)) << x.grad() << "\nvs\n" << ref_grad;
  });
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "W" + std::to_string(c.world) + (c.uneven ? "_uneven" : "_even") +
         (c.mode == GatherGrad::ReduceScatterSum ? "_reduce_scatter" : "_own_slice");
}

INSTANTIATE_TEST_SUITE_P(Modes, AllGatherGrad,
                         ::testing::Values(Case{1, false, GatherGrad::ReduceScatterSum}, Case{2, false, GatherGrad::ReduceScatterSum},
                                           Case{3, false, GatherGrad::ReduceScatterSum}, Case{2, true, GatherGrad::ReduceScatterSum},
                                           Case{3, true, GatherGrad::ReduceScatterSum}, Case{1, false, GatherGrad::OwnSlice},
                                           Case{2, false, GatherGrad::OwnSlice}, Case{3, true, GatherGrad::OwnSlice}),
                         case_name);
// Rank 1 of the uneven case has no rows: an empty CUDA block on one side.
INSTANTIATE_TEST_SUITE_P(GlooCuda, AllGatherGrad,
                         ::testing::Values(Case{2, false, GatherGrad::ReduceScatterSum, true},
                                           Case{2, true, GatherGrad::ReduceScatterSum, true},
                                           Case{2, false, GatherGrad::OwnSlice, true}),
                         case_name);

// The seed example: x = ones (rank 0) / zeros (rank 1), y = x + 2, z = y*y, r = z_0 * z_1,
// out = mean(r). Own slice: y.grad = 6 / 9; summed losses (reduce-scatter): 12 / 18.
TEST(AllGatherGrad, SeedExampleNumbers) {
  for (auto mode : {GatherGrad::OwnSlice, GatherGrad::ReduceScatterSum}) {
    testing::run_ranks(2, [mode](Distributed& d) {
      at::Tensor x = d.rank() == 0 ? torch::ones({2, 2}) : torch::zeros({2, 2});
      x.requires_grad_();
      at::Tensor y = x + 2;
      y.retain_grad();
      at::Tensor z = y * y;
      at::Tensor g = all_gather_with_grad(d, z, mode);
      at::Tensor out = (g.narrow(0, 0, 2) * g.narrow(0, 2, 2)).mean();
      out.backward();
      const float expect = mode == GatherGrad::OwnSlice ? (d.rank() == 0 ? 6.f : 9.f) : (d.rank() == 0 ? 12.f : 18.f);
      EXPECT_TRUE(torch::equal(y.grad(), torch::full({2, 2}, expect))) << y.grad();
    });
  }
}

}  // namespace
}  // namespace faceshard
