// The test binary's intra-op threads: one unless OMP_NUM_THREADS says otherwise (main.cpp),
// so that the suites CMake runs again on two threads (threads2.*) really run on two.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>

namespace faceshard {
namespace {

TEST(IntraOpThreads, AsTheEnvironmentSays) {
  const char* env = std::getenv("OMP_NUM_THREADS");
  const int want = env ? std::atoi(env) : 1;
  EXPECT_EQ(at::get_num_threads(), want) << "OMP_NUM_THREADS=" << (env ? env : "(unset)");
  // A parallel region over enough work uses them all.
  std::atomic<int> seen{0};
  at::parallel_for(0, 1 << 16, 1, [&](int64_t, int64_t) { seen.fetch_add(1); });
  EXPECT_EQ(seen.load(), want);
}

}  // namespace
}  // namespace faceshard
