// The backbones' PReLU (models/prelu.h): the CPU backward pass against ATen's backward (the
// path other devices run) and against autograd through at::prelu, for NCHW and channels-last
// inputs, one slope per channel and a single slope, zeros in the input included.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/prelu.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

TEST(PReLU, CpuBackwardMatchesATenAndAutograd) {
  torch::manual_seed(5);
  for (const bool channels_last : {false, true})
    for (const int64_t slopes : {int64_t(24), int64_t(1)})
      for (const auto& shape : {std::vector<int64_t>{3, 24, 7, 9}, std::vector<int64_t>{2, 24, 1, 1}}) {
        SCOPED_TRACE(std::string(channels_last ? "channels_last" : "nchw") + " slopes " + std::to_string(slopes) +
                     " spatial " + std::to_string(shape[2]) + "x" + std::to_string(shape[3]));
        at::Tensor x = torch::randn(shape);
        x.view(-1).narrow(0, 0, 10).zero_();  // x = 0 takes the slope, as in ATen
        const at::Tensor w = torch::rand({slopes}) * 0.5;
        at::Tensor dy = torch::randn(shape);
        if (channels_last) {
          x = x.contiguous(at::MemoryFormat::ChannelsLast);
          dy = dy.contiguous(at::MemoryFormat::ChannelsLast);
        }
        auto [dx, dw] = prelu_backward(dy, x, w);
        auto [dx_ref, dw_ref] = prelu_backward(dy, x, w, /*cpu_pass=*/false);
        EXPECT_TRUE(torch::equal(dx, dx_ref));  // a select and a product: exact
        if (shape[2] * shape[3] > 1) {  // dx in x's memory format (1x1 planes are both)
          EXPECT_EQ(dx.is_contiguous(at::MemoryFormat::ChannelsLast), channels_last);
        }
        EXPECT_EQ(dw.sizes(), w.sizes());
        EXPECT_LE(testing::relative_error(dw, dw_ref), 1e-6);
        // Autograd through faceshard::prelu and through at::prelu, in float64 for the
        // reference.
        const at::Tensor xa = x.detach().requires_grad_(true), wa = w.detach().requires_grad_(true);
        (faceshard::prelu(xa, wa) * dy).sum().backward();
        const at::Tensor xd = x.to(at::kDouble).requires_grad_(true), wd = w.to(at::kDouble).requires_grad_(true);
        (at::prelu(xd, wd) * dy.to(at::kDouble)).sum().backward();
        EXPECT_LE(testing::relative_error(xa.grad(), xd.grad()), 1e-6);
        EXPECT_LE(testing::relative_error(wa.grad(), wd.grad()), 1e-6);
        EXPECT_TRUE(torch::equal(faceshard::prelu(x, w), at::prelu(x, w)));
      }
}

}  // namespace
}  // namespace faceshard
