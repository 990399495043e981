// The classifier's chunks on a GPU come from a memory budget (chunk_policy.h), so that a step
// launches a bounded number of kernels however many classes a shard holds; the CPU stands in
// for the GPU by counting the operators that would launch one (op_counter.h). Checked here:
// the chunk sizes against their closed forms, the counter against operators whose launches
// are known, and the count of a whole classifier step at 200k and 2M classes per shard, the
// GPU's policy against the CPU's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <iostream>

#include "app/plan/allocation_meter.h"
#include "partial_fc/classifier/chunk_policy.h"
#include "partial_fc/classifier/partial_fc.h"
#include "base/op_counter.h"
#include "tests/harness.h"
#include "tests/test_errors.h"

namespace faceshard {
namespace {

TEST(ChunkPolicy, SizesFromTheBudget) {
  ChunkInputs in;
  in.cuda = true;
  in.embedding_size = 512;
  in.global_rows = 128;
  ChunkSizes c = chunk_sizes(in);
  // 2 GiB: the update's raw rows at 4 x 512 B, the logits' columns at 6 x 512 + 12 x 128 B.
  EXPECT_EQ(c.update_rows, 2147483648LL / 2048);
  EXPECT_EQ(c.logits_columns, static_cast<int64_t>(std::floor(2147483648.0 / 4608)) / 4 * 4);
  EXPECT_DOUBLE_EQ(c.temporary_bytes, std::max(2048.0 * c.update_rows, 4608.0 * c.logits_columns));
  EXPECT_LE(c.temporary_bytes, 2147483648.0);
  // Without the one-pass update the rows' copies come on top: 16 B an element.
  in.fused_update = false;
  EXPECT_EQ(chunk_sizes(in).update_rows, 2147483648LL / (16 * 512));
  in.fused_update = true;
  // A budget of its own, and the same on the CPU when asked for.
  in.budget_bytes = 64 << 20;
  in.cuda = false;
  in.policy = ChunkPolicy::Budget;
  EXPECT_EQ(chunk_sizes(in).update_rows, (64 << 20) / 2048);
  // The CPU's own: 2 MiB of fp32 rows, whatever the budget.
  in.policy = ChunkPolicy::Auto;
  c = chunk_sizes(in);
  EXPECT_EQ(c.update_rows, 1024);
  EXPECT_EQ(c.logits_columns, 1024);
  // A fixed size wins over both.
  in.fixed_rows = 102;
  c = chunk_sizes(in);
  EXPECT_EQ(c.update_rows, 102);
  EXPECT_EQ(c.logits_columns, 100);
  EXPECT_EQ(chunk_policy_name(parse_chunk_policy("budget")), std::string("budget"));
}

// Reduced-precision GEMMs convert each chunk's slice of G' [N, chunk] for them: 2 B per
// logits row on every row of the update and every column of the logits' passes (at batch
// 128 an eighth more per update row, at 8,192 eight times as much).
TEST(ChunkPolicy, Bf16GemmsCountTheConvertedGradient) {
  ChunkInputs in;
  in.cuda = true;
  in.embedding_size = 512;
  in.global_rows = 128;
  in.reduced_gemm = true;
  ChunkSizes c = chunk_sizes(in);
  EXPECT_EQ(c.update_rows, 2147483648LL / (4 * 512 + 2 * 128) / 4 * 4);
  EXPECT_EQ(c.logits_columns, 2147483648LL / (6 * 512 + 14 * 128) / 4 * 4);
  EXPECT_LE(c.temporary_bytes, 2147483648.0);
  in.global_rows = 8192;
  c = chunk_sizes(in);
  EXPECT_EQ(c.update_rows, 2147483648LL / (4 * 512 + 2 * 8192) / 4 * 4);
  in.reduced_gemm = false;
  EXPECT_EQ(chunk_sizes(in).update_rows, 2147483648LL / (4 * 512));
  // The classifier's memory plan takes the same inputs from its options.
  PartialFCOptions o;
  o.num_classes = 4000000;
  o.embedding_size = 512;
  o.gemm_dtype = at::kBFloat16;
  const ClassifierMemoryPlan p = classifier_memory_plan(o, 1, 0, 8192, /*cuda=*/true);
  const double row = 4 * 512 + 2 * 8192, col = 6 * 512 + 14 * 8192;
  const double rows = static_cast<double>(2147483648LL / static_cast<int64_t>(row) / 4 * 4);
  const double cols = static_cast<double>(2147483648LL / static_cast<int64_t>(col) / 4 * 4);
  EXPECT_DOUBLE_EQ(p.chunk_bytes, std::max(rows * row, cols * col));
  EXPECT_LE(p.chunk_bytes, 2147483648.0);
}

// What the budget promises, measured: the CPU allocations of one chunked update with bf16
// GEMMs (the GPU's chunking run on the CPU with a 4 MiB budget, a global batch of 2,048 at
// d = 64, where the converted G' is 16 times a row's raw gradient) stay within the budget, the
// one bf16 copy of E the step converts, the CPU GEMM's bf16 result of each chunk (a GPU's is
// fp32 at once) and 5% for the CPU GEMM's own scratch (measured: 4.71 MB against 4.40 MB of
// budget and E). Counting the raw gradient alone, the chunk was the whole 4,000-row shard:
// 17.9 MB.
TEST(ChunkPolicy, Bf16UpdateStaysWithinTheBudget) {
  auto dist = Distributed::init(DistEnv{});
  const int64_t C = 4000, D = 64, N = 2048, budget = int64_t(4) << 20;
  PartialFCOptions o;
  o.num_classes = C;
  o.embedding_size = D;
  o.gemm_dtype = at::kBFloat16;
  o.chunking = ChunkPolicy::Budget;
  o.chunk_budget_bytes = budget;
  PartialFC fc(*dist, o);
  torch::manual_seed(3);
  at::Tensor emb = torch::randn({N, D}).requires_grad_();
  const at::Tensor labels = torch::randint(0, C, {N}, torch::kLong);
  AllocationMeter::install();
  fc.forward(emb, labels).loss.backward();
  const ChunkSizes cs = fc.chunk_sizes_for(N);
  // One thread: the CPU GEMM's packing buffers grow with its threads (0.75 MB more on two
  // here); they are the CPU library's, not the classifier's temporaries, and a GPU has none.
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  AllocationMeter::reset_peak();
  const int64_t before = AllocationMeter::current_bytes();
  fc.step(0.1);
  const double used = static_cast<double>(AllocationMeter::peak_bytes() - before);
  at::set_num_threads(threads);
  const double allowed = 1.05 * static_cast<double>(budget) + 2.0 * N * D + static_cast<double>(cs.update_rows) * 2.0 * D;
  EXPECT_LE(used, allowed) << cs.update_rows << " rows a chunk";
  EXPECT_GT(used, 0.5 * static_cast<double>(budget)) << "the chunk's temporaries were not measured";
  EXPECT_NE(testing::error_of([] { parse_chunk_policy("gpu"); }).find("fc_chunking"), std::string::npos);
}

// Views, allocations and the operators a composite one dispatches are not launches; an
// in-place arithmetic operator and a copy are.
TEST(OpCounter, CountsWhatWouldLaunchAKernel) {
  at::Tensor a = torch::ones({8, 4});
  int64_t views = 0, composite = 0, arithmetic = 0, dispatched = 0;
  {
    OpCounter c;
    at::Tensor v = a.narrow(0, 0, 2).t().unsqueeze(0);
    at::Tensor e = at::empty({3});
    views = c.count();
    dispatched = c.dispatched();
  }
  {
    OpCounter c;
    at::Tensor n = a.norm(2, {1});  // one launch, however it is implemented
    composite = c.count();
  }
  {
    OpCounter c;
    a.add_(1);
    at::Tensor b = a.to(at::kDouble);  // a copy
    at::Tensor same = a.to(at::kFloat);  // no copy
    arithmetic = c.count();
  }
  EXPECT_EQ(views, 0);
  EXPECT_GE(dispatched, 4);  // the observer saw them
  EXPECT_EQ(composite, 1);
  EXPECT_EQ(arithmetic, 2);
  EXPECT_TRUE(op_counts_as_launch("aten::mm"));
  EXPECT_FALSE(op_counts_as_launch("aten::slice.Tensor"));
  EXPECT_FALSE(op_counts_as_launch("aten::empty.memory_format"));
}

struct StepCase {
  double rate;
  at::ScalarType weight;
  bool streamed;
};

// The operators of one classifier step (forward, backward and the update) after a first
// step, at `classes` classes on one rank.
int64_t step_operators(Distributed& d, const StepCase& c, int64_t classes, ChunkPolicy policy, int64_t budget,
                       int64_t fixed_rows = 0) {
  constexpr int64_t kDim = 16, kBatch = 4;
  PartialFCOptions o;
  o.num_classes = classes;
  o.embedding_size = kDim;
  o.sample_rate = c.rate;
  o.margin = CombinedMargin{1.0, 0.5, 0.0};
  o.weight_dtype = c.weight;
  o.streamed_logits = c.streamed;
  o.chunking = policy;
  o.chunk_budget_bytes = budget;
  o.update_chunk_rows = fixed_rows;
  PartialFC fc(d, o, torch::kCPU);
  torch::manual_seed(7);
  at::Tensor emb = torch::randn({kBatch, kDim}).requires_grad_();
  const at::Tensor labels = torch::randint(0, classes, {kBatch}, torch::kLong);
  auto step = [&] {
    fc.arm_step(0.1);
    fc.forward(emb, labels).loss.backward();
    fc.step(0.1);
    emb.mutable_grad().reset();
  };
  step();
  OpCounter counter;
  step();
  return counter.count();
}

// d = 16 and a global batch of 4 with a 64 MiB budget make the same chunks as d = 512 and 128
// with the default 2 GiB (every per-row byte count is 32 times smaller): 200k classes are one
// chunk of every pass, 2M classes 2 chunks of the update and 5 of the logits.
TEST(ChunkPolicy, StepLaunchesDoNotGrowWithTheClasses) {
  constexpr int64_t kBudget = 64 << 20;
  testing::run_ranks(1, [&](Distributed& d) {
    // Where the step's rows fit a few budget chunks (fp32 centres, and any rows at a rate of
    // 0.1): the same count within 5% at 10x the classes.
    for (const StepCase& c : {StepCase{1.0, at::kFloat, false}, StepCase{0.1, at::kFloat, false},
                              StepCase{0.1, at::kBFloat16, false}, StepCase{0.1, at::kFloat, true}}) {
      SCOPED_TRACE("rate " + std::to_string(c.rate) + (c.weight == at::kFloat ? " fp32" : " bf16") +
                   (c.streamed ? " streamed" : " buffer"));
      const int64_t small = step_operators(d, c, 200000, ChunkPolicy::Budget, kBudget);
      const int64_t large = step_operators(d, c, 2000000, ChunkPolicy::Budget, kBudget);
      EXPECT_LE(std::abs(large - small), small / 20) << small << " operators at 200k, " << large << " at 2M";
      std::cout << "[ launches ] rate " << c.rate << (c.weight == at::kFloat ? " fp32" : " bf16")
                << (c.streamed ? " streamed" : " buffer") << ": " << small << " at 200k classes, " << large
                << " at 2M\n";
    }
    // Every column read as bf16 or streamed: a few launches per budget chunk (each moving
    // hundreds of MiB), where the CPU's cache-sized chunks (1024 rows at d = 512) add
    // thousands (from 200k to 1M classes: 2 more chunks of the logits' passes, 782 more of
    // the CPU's).
    for (const StepCase& c : {StepCase{1.0, at::kBFloat16, false}, StepCase{1.0, at::kFloat, true}}) {
      SCOPED_TRACE(std::string("rate 1 ") + (c.streamed ? "streamed" : "bf16"));
      const int64_t budget_growth = step_operators(d, c, 1000000, ChunkPolicy::Budget, kBudget) -
                                    step_operators(d, c, 200000, ChunkPolicy::Budget, kBudget);
      const int64_t cache_growth = step_operators(d, c, 1000000, ChunkPolicy::Cache, 0, 1024) -
                                   step_operators(d, c, 200000, ChunkPolicy::Cache, 0, 1024);
      std::cout << "[ launches ] rate 1 " << (c.streamed ? "fp32 streamed" : "bf16 buffer") << ", 200k -> 1M classes: +"
                << budget_growth << " with the budget's chunks, +" << cache_growth << " with the CPU's\n";
      EXPECT_GT(cache_growth, 0);
      EXPECT_LE(budget_growth * 10, cache_growth) << "budget +" << budget_growth << ", cache +" << cache_growth;
    }
  });
}

}  // namespace
}  // namespace faceshard
