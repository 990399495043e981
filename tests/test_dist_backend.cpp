// dist.backend: the key and its errors, the GPU each rank binds, and the runtime's collectives
// on CUDA tensors over Gloo at world 2 with both ranks on cuda:0 (Gloo's own CUDA works for
// all_reduce, broadcast and all_gather, the host-staged reduce_scatter) against the same
// collectives on CPU tensors in the same ranks.
#include <gtest/gtest.h>

#include "app/config/config.h"
#include "partial_fc/distributed/distributed.h"
#include "base/error.h"
#include "tests/harness.h"
#include "tests/test_paths.h"

namespace faceshard {
namespace {

// The one-line usage error of f, or "" (with a test failure) when there is none.
template <typename F>
std::string usage_error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), 2) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected an error";
  return "";
}

TEST(DistBackend, KeyValuesAndErrors) {
  EXPECT_EQ(load_config_text("data:\n  num_classes: 10\n", "m.yaml").dist.backend, "auto");
  EXPECT_EQ(load_config_text("dist:\n  backend: gloo\n  device: cuda\n", "m.yaml").dist.backend, "gloo");
  EXPECT_EQ(load_config_text("dist:\n  backend: gloo\n  device: cpu\n", "m.yaml").dist.backend, "gloo");
  std::string msg = usage_error_of([] { load_config_text("dist:\n  backend: mpi\n", "m.yaml"); });
  EXPECT_NE(msg.find("dist.backend"), std::string::npos) << msg;
  EXPECT_NE(msg.find("mpi"), std::string::npos) << msg;
  msg = usage_error_of([] { load_config_text("dist:\n  backend: nccl\n  device: cpu\n", "m.yaml"); });
  EXPECT_NE(msg.find("key 'dist.backend': nccl carries CUDA tensors only, but dist.device is cpu"), std::string::npos)
      << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// Without a GPU, a job that asks NCCL for its CUDA tensors stops at once naming the key.
TEST(DistBackend, NcclWithoutAGpuIsAConfigError) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is visible: NCCL would run";
  const auto r = testing::run_tool("faceshard-train", "--config \"" + std::string(FACESHARD_SOURCE_DIR) +
                                                          "/configs/demo.yaml\" --set dist.backend=nccl");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("key 'dist.backend': nccl needs a GPU but"), std::string::npos) << r.output;
}

TEST(DistBackend, NcclRanksOwnAGpuGlooRanksShareThem) {
  const int n = static_cast<int>(torch::cuda::device_count());
  for (int local = 0; local < 5; ++local) {
    DistEnv env;
    env.local_rank = local;
    env.local_world_size = 5;
    EXPECT_EQ(cuda_device_of(env, CudaBackend::Nccl), local);
    // One GPU: every rank on cuda:0.
    EXPECT_EQ(cuda_device_of(env, CudaBackend::Gloo), n > 0 ? local % n : local) << n << " GPU(s)";
    if (n == 1) EXPECT_EQ(cuda_device_of(env, CudaBackend::Gloo), 0);
  }
}

// The runtime's collectives on cuda:0 over Gloo against the same on the CPU, for the dtypes
// and reductions faceshard uses, equal and uneven blocks, and the asynchronous all-reduce
// DDP's buckets use: each result on the device, equal to the CPU's.
TEST(DistributedGlooCuda, CollectivesMatchTheCpuOnes) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  testing::run_ranks(2, [](Distributed& d) {
    ASSERT_FALSE(d.has_nccl());
    const torch::Device dev(torch::kCUDA, 0);
    const int r = d.rank();
    auto same = [&](const at::Tensor& gpu, const at::Tensor& cpu, const char* what) {
      EXPECT_EQ(gpu.device(), dev) << what;
      EXPECT_EQ(gpu.scalar_type(), cpu.scalar_type()) << what;
      EXPECT_TRUE(torch::equal(gpu.cpu(), cpu)) << what << ": " << gpu << " vs " << cpu;
    };
    for (at::ScalarType dt : {at::kFloat, at::kDouble, at::kBFloat16, at::kLong}) {
      SCOPED_TRACE(c10::toString(dt));
      torch::manual_seed(10 + r);
      const at::Tensor x = (torch::randn({5, 7}) * 100).to(dt);
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
        at::Tensor c = x.clone(), g = x.to(dev);
        d.all_reduce(c, op);
        d.all_reduce(g, op);
        same(g, c, "all_reduce");
        EXPECT_FALSE(torch::equal(c, x)) << "the ranks' tensors differ: the reduction must change them";
      }
      {
        at::Tensor c = x.clone(), g = x.to(dev);
        d.broadcast(c, 1);
        d.broadcast(g, 1);
        same(g, c, "broadcast");
      }
      for (bool uneven : {false, true}) {
        const at::Tensor part = uneven ? x.narrow(0, 0, r == 0 ? 3 : 0) : x;
        std::vector<int64_t> cc, gc;
        at::Tensor c = d.all_gather(part, &cc), g = d.all_gather(part.to(dev), &gc);
        EXPECT_EQ(cc, gc);
        same(g, c, "all_gather");
        // reduce_scatter: rank q's block has counts[q] rows.
        const std::vector<int64_t> counts = uneven ? std::vector<int64_t>{4, 1} : std::vector<int64_t>{2, 3};
        const at::Tensor in = x.narrow(0, 0, 5);
        at::Tensor rc = d.reduce_scatter(in, counts), rg = d.reduce_scatter(in.to(dev), counts);
        ASSERT_EQ(rc.size(0), counts[r]);
        same(rg, rc, "reduce_scatter");
      }
    }
    // The asynchronous all-reduce of a view into a larger buffer (a DDP bucket), finished with
    // wait(): the result is in place, the rest of the buffer untouched.
    at::Tensor buf = torch::arange(20, torch::kFloat).to(dev) + r;
    at::Tensor view = buf.narrow(0, 5, 10);
    auto work = d.all_reduce_async(view);
    d.wait(work, "bucket", true);
    at::Tensor want = torch::arange(20, torch::kFloat) + r;
    want.narrow(0, 5, 10).copy_(torch::arange(5, 15, torch::kFloat) * 2 + 1);
    same(buf, want, "all_reduce_async");
  });
}

}  // namespace
}  // namespace faceshard
