// The backbones' PReLU (models/prelu.h): the CPU backward pass against ATen's backward (the
// path other devices run) and against autograd through at::prelu, for NCHW and channels-last
// inputs, one slope per channel and a single slope, zeros in the input included.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/prelu.h"
#include "base/error.h"
#include "tests/harness.h"

#ifdef FACESHARD_WITH_CUDA
#include "models/prelu_cuda.h"
#include "base/cuda_kernel_check.h"
#endif

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
        auto [dx_ref, dw_ref] = prelu_backward(dy, x, w, /*own_pass=*/false);
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

// model.prelu_kernel: false makes every backward ATen's (bit for bit), true brings the own
// pass back (whose slope sums differ from ATen's in their order).
TEST(PReLU, OwnPassCanBeSwitchedOff) {
  torch::manual_seed(6);
  const at::Tensor x = torch::randn({4, 32, 9, 9}), dy = torch::randn({4, 32, 9, 9}), w = torch::rand({32}) * 0.3;
  auto [dx_aten, dw_aten] = prelu_backward(dy, x, w, /*own_pass=*/false);
  set_prelu_own_pass(false);
  auto [dx_off, dw_off] = prelu_backward(dy, x, w);
  set_prelu_own_pass(true);
  auto [dx_on, dw_on] = prelu_backward(dy, x, w);
  EXPECT_TRUE(torch::equal(dx_off, dx_aten));
  EXPECT_TRUE(torch::equal(dw_off, dw_aten));
  EXPECT_FALSE(torch::equal(dw_on, dw_aten));  // fp64 sums over planes: not ATen's order
  EXPECT_LE(testing::relative_error(dw_on, dw_aten), 1e-6);
}

// The CUDA pass (models/prelu_cuda.cu) against plain float64 ops on the same values and
// against ATen's CUDA backward: fp32, bf16 and fp16, NCHW and channels-last, one slope per
// channel (below and above the 256 channels one thread row covers) and one for all, slopes
// of x's type and fp32 slopes with reduced-precision x; through autograd as well.
TEST(PReLUCuda, BackwardMatchesATenAndFloat64) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(9);
  const auto dev = torch::Device(torch::kCUDA);
  for (const at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf})
    for (const bool channels_last : {false, true})
      for (const auto& shape : {std::vector<int64_t>{3, 24, 7, 9}, std::vector<int64_t>{2, 600, 3, 5},
                                std::vector<int64_t>{4, 64, 28, 28}})
        for (const bool one_slope : {false, true})
          for (const bool fp32_slopes : {false, true}) {
            if (type == at::kFloat && fp32_slopes) continue;  // the same case
            SCOPED_TRACE(std::string(c10::toString(type)) + (channels_last ? " channels_last" : " nchw") + " C " +
                         std::to_string(shape[1]) + (one_slope ? " one slope" : "") + (fp32_slopes ? " fp32 slopes" : ""));
            const auto opt = at::TensorOptions(dev).dtype(type);
            at::Tensor x = torch::randn(shape, opt), dy = torch::randn(shape, opt);
            x.view(-1).narrow(0, 0, 10).zero_();
            if (channels_last) {
              x = x.contiguous(at::MemoryFormat::ChannelsLast);
              dy = dy.contiguous(at::MemoryFormat::ChannelsLast);
            }
            const at::Tensor w = (torch::rand({one_slope ? 1 : shape[1]}, opt.dtype(at::kFloat)) * 0.5)
                                     .to(fp32_slopes ? at::kFloat : type);
            auto [dx, dw] = prelu_backward(dy, x, w);
            EXPECT_EQ(dx.scalar_type(), type);
            EXPECT_EQ(dw.scalar_type(), w.scalar_type());
            EXPECT_EQ(dw.sizes(), w.sizes());
            EXPECT_EQ(dx.is_contiguous(at::MemoryFormat::ChannelsLast), channels_last);
            // float64 from the same values.
            const at::Tensor xd = x.to(at::kDouble), gd = dy.to(at::kDouble), wd = w.to(at::kDouble);
            const at::Tensor a = one_slope ? wd.view({1, 1, 1, 1}) : wd.view({1, -1, 1, 1});
            const at::Tensor dx64 = at::where(xd > 0, gd, a * gd);
            const at::Tensor terms = at::where(xd > 0, at::zeros_like(xd), gd * xd);
            const at::Tensor dw64 = one_slope ? terms.sum().reshape({1}) : terms.sum({0, 2, 3});
            const double tol = type == at::kFloat ? 1e-6 : 1e-2;
            EXPECT_LE(testing::relative_error(dx.to(at::kDouble), dx64), tol);
            EXPECT_LE(testing::relative_error(dw.to(at::kDouble), dw64), type == at::kFloat || fp32_slopes ? 1e-5 : 1e-2);
            if (!fp32_slopes) {
              auto [dx_aten, dw_aten] = prelu_backward(dy, x, w, /*own_pass=*/false);
              EXPECT_TRUE(torch::equal(dx, dx_aten));  // a select and a product in fp32, then rounded
              EXPECT_LE(testing::relative_error(dw.to(at::kDouble), dw_aten.to(at::kDouble)), tol);
            }
            // Autograd through faceshard::prelu (the CUDA pass) against float64.
            const at::Tensor xa = x.detach().requires_grad_(true), wa = w.detach().requires_grad_(true);
            (faceshard::prelu(xa, wa).to(at::kDouble) * gd).sum().backward();
            EXPECT_LE(testing::relative_error(xa.grad().to(at::kDouble), dx64), tol);
            EXPECT_LE(testing::relative_error(wa.grad().to(at::kDouble), dw64), type == at::kFloat || fp32_slopes ? 1e-5 : 1e-2);
          }
  // Bit-deterministic: the slope sums are added in a fixed order (no atomics), so repeated
  // runs give the same bits. A batch of 256 makes many partial sums per channel (256 planes
  // each in NCHW, about a thousand blocks channels-last, 49 pieces for one slope), whose
  // order atomics would vary from run to run.
  for (const at::ScalarType type : {at::kFloat, at::kBFloat16})
    for (const bool channels_last : {false, true})
      for (const bool one_slope : {false, true}) {
        SCOPED_TRACE(std::string("repeat ") + c10::toString(type) + (channels_last ? " channels_last" : " nchw") +
                     (one_slope ? " one slope" : ""));
        const auto opt = at::TensorOptions(dev).dtype(type);
        const std::vector<int64_t> shape{256, 64, 14, 14};
        at::Tensor x = torch::randn(shape, opt), dy = torch::randn(shape, opt);
        if (channels_last) {
          x = x.contiguous(at::MemoryFormat::ChannelsLast);
          dy = dy.contiguous(at::MemoryFormat::ChannelsLast);
        }
        const at::Tensor w = torch::rand({one_slope ? 1 : shape[1]}, opt.dtype(at::kFloat)) * 0.5;
        auto [dx, dw] = prelu_backward(dy, x, w);
        const at::Tensor terms = at::where(x > 0, at::zeros_like(x, at::kDouble), dy.to(at::kDouble) * x.to(at::kDouble));
        const at::Tensor dw64 = one_slope ? terms.sum().reshape({1}) : terms.sum({0, 2, 3});
        EXPECT_LE(testing::relative_error(dw.to(at::kDouble), dw64), 1e-3);
        for (int run = 1; run <= 3; ++run) {
          auto [dx_again, dw_again] = prelu_backward(dy, x, w);
          EXPECT_TRUE(torch::equal(dw_again, dw)) << "run " << run << ": the slope gradient changed bits";
          EXPECT_TRUE(torch::equal(dx_again, dx)) << "run " << run;
        }
      }
}

// A launch that fails is raised where it happens, naming the kernel, instead of leaving dx and
// dw unwritten for a later operation to stumble on. The launch asks for more shared memory
// than any GPU has (a row of 2^20 channels): refused on a GPU (invalid argument), and with no
// GPU the CUDA runtime refuses every call; either way the launcher returns the error.
TEST(PReLU, FailedCudaLaunchNamesTheKernel) {
#ifdef FACESHARD_WITH_CUDA
  const int64_t channels = int64_t(1) << 20;
  try {
    check_cuda_kernel(prelu_backward_rows_cuda(PReLUCudaType::Float, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                               1, channels, nullptr),
                      "prelu_backward_rows (models/prelu_cuda.cu)");
    ADD_FAILURE() << "the launch did not fail";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Runtime);
    EXPECT_NE(std::string(e.what()).find("CUDA kernel prelu_backward_rows (models/prelu_cuda.cu) failed: "),
              std::string::npos)
        << e.what();
  }
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

}  // namespace
}  // namespace faceshard
