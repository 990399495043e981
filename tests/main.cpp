// Test entry point. Rank processes of the multi-rank harness run this same binary with a
// filter naming one test (tests/harness.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

#include "tests/harness.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // Two cores here: keep intra-op threads from oversubscribing when ranks run side by side.
  if (!std::getenv("OMP_NUM_THREADS")) torch::set_num_threads(1);
  const int rc = RUN_ALL_TESTS();
  // Out without the libraries' static destructors (LibTorch deregistering every kernel: a
  // third of an empty run's CPU time, paid by each of the hundreds of processes ctest
  // starts); what they would do that matters here is done first.
  faceshard::testing::remove_temp_dirs();
  std::fflush(nullptr);
  std::_Exit(rc);
}
