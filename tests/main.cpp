// Test entry point. Rank processes of the multi-rank harness run this same binary with a
// filter naming one test (tests/harness.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // Two cores here: keep intra-op threads from oversubscribing when ranks run side by side.
  if (!std::getenv("OMP_NUM_THREADS")) torch::set_num_threads(1);
  return RUN_ALL_TESTS();
}
