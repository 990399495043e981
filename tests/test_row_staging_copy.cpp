// Copy-on-write staging of the classifier's rows (app/train/row_staging.h) on its own: the
// training thread and the writer thread at once, whichever gets to a row first copying it.
// Depends on RowStaging and ATen only, so that tools/tsan.sh builds it with ThreadSanitizer.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "app/train/row_staging.h"

namespace faceshard {
namespace {

struct Rows {
  std::vector<at::Tensor> live, buffers, at_begin;
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs() const {
    std::vector<std::pair<at::Tensor, at::Tensor>> p;
    for (size_t i = 0; i < live.size(); ++i) p.emplace_back(live[i], buffers[i]);
    return p;
  }
};

// A shard's kinds of row tensors: bf16 centres, fp32 momentum, int64 per-row counts.
Rows make_rows(int64_t rows, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Rows r;
  r.live = {at::randn({rows, 8}, gen).to(at::kBFloat16), at::randn({rows, 8}, gen),
            at::randint(0, 1000, {rows}, gen, at::kLong)};
  for (const at::Tensor& t : r.live) {
    r.buffers.push_back(at::full_like(t, 7));
    r.at_begin.push_back(t.clone());
  }
  return r;
}

// What the training does to rows it changes: every value moved. Plain loops over the
// tensors' memory (not ATen kernels), so that ThreadSanitizer sees these writes too.
template <class T>
void change_rows(at::Tensor& t, int64_t first, int64_t count, const at::Tensor& index) {
  T* p = t.data_ptr<T>();
  const int64_t width = t.numel() / t.size(0);
  auto move = [&](int64_t row, bool fill) {
    for (int64_t j = 0; j < width; ++j) p[row * width + j] = fill ? T(3) : T(static_cast<float>(p[row * width + j]) + 1);
  };
  if (index.defined()) {
    const int64_t* ix = index.data_ptr<int64_t>();
    for (int64_t i = 0; i < index.numel(); ++i) move(ix[i], true);
  } else {
    for (int64_t r = first; r < first + count; ++r) move(r, false);
  }
}

void change(Rows& r, int64_t first, int64_t count, const at::Tensor& index) {
  change_rows<at::BFloat16>(r.live[0], first, count, index);
  change_rows<float>(r.live[1], first, count, index);
  change_rows<int64_t>(r.live[2], first, count, index);
}

void expect_buffers_hold_the_start(const Rows& r) {
  for (size_t i = 0; i < r.buffers.size(); ++i)
    EXPECT_TRUE(torch::equal(r.buffers[i], r.at_begin[i])) << "tensor " << i << ": the buffer is not the rows at begin()";
}

// The training changes a range and scattered rows before the writer starts: it copies those
// rows itself (counted once each, repeats included), and the writer the others.
TEST(RowStaging, RowsChangedBeforeTheWriterGetsThereAreCopiedFirst) {
  const int64_t rows = 5000;  // five chunks, the last one short
  Rows r = make_rows(rows, 1);
  RowStaging s;
  s.begin(r.pairs(), rows);
  ASSERT_TRUE(s.active());
  s.before_change(100, 1400, at::Tensor());
  change(r, 100, 1400, at::Tensor());
  const at::Tensor index = torch::tensor({4999, 3, 2048, 2048, 77, 150}, at::kLong);
  s.before_change(0, 0, index);
  change(r, 0, 0, index);
  // The control: the live rows did change.
  ASSERT_FALSE(torch::equal(r.live[1], r.at_begin[1]));
  ASSERT_TRUE(s.complete());
  EXPECT_FALSE(s.active());
  expect_buffers_hold_the_start(r);
  // 1400 of the range, and 4999, 3, 2048, 77 (150 was in the range; 2048 twice).
  EXPECT_EQ(s.rows_copied_by_training(), 1404);
  // Once complete, changes cost nothing and copy nothing.
  s.before_change(0, rows, at::Tensor());
  EXPECT_EQ(s.rows_copied_by_training(), 1404);
  EXPECT_DOUBLE_EQ(s.bytes(), static_cast<double>(rows) * (8 * 2 + 8 * 4 + 8));
}

// The writer and the training at once, over and over: whatever the interleaving, the buffers
// end as the rows were at begin().
TEST(RowStaging, TheWriterAndTheTrainingAtOnce) {
  const int64_t rows = 20000;
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 6; ++trial) {
    Rows r = make_rows(rows, 100 + trial);
    RowStaging s;
    s.begin(r.pairs(), rows);
    std::atomic<bool> go{false};
    std::thread writer([&] {
      while (!go.load()) std::this_thread::yield();
      s.complete();
    });
    go = true;
    for (int k = 0; k < 40; ++k) {
      if (k % 2) {
        const int64_t first = static_cast<int64_t>(rng() % rows), count = std::min<int64_t>(1 + rng() % 3000, rows - first);
        s.before_change(first, count, at::Tensor());
        change(r, first, count, at::Tensor());
      } else {
        std::vector<int64_t> ix(200);
        for (auto& v : ix) v = static_cast<int64_t>(rng() % rows);
        const at::Tensor index = torch::tensor(ix, at::kLong);
        s.before_change(0, 0, index);
        change(r, 0, 0, index);
      }
    }
    writer.join();
    expect_buffers_hold_the_start(r);
  }
}

TEST(RowStaging, AnAbortedCopyIsGivenUpAndWhatCannotBeStagedIsRefused) {
  Rows r = make_rows(3000, 2);
  RowStaging s;
  s.begin(r.pairs(), 3000);
  std::atomic<bool> abort{true};
  EXPECT_FALSE(s.complete(&abort));
  EXPECT_FALSE(s.active());
  // A strided source, a buffer of another shape: refused, with what they are.
  const at::Tensor strided = at::zeros({8, 3000}).t();
  EXPECT_FALSE(RowStaging::stageable(strided, 3000));
  EXPECT_THROW(s.begin({{strided, at::zeros({3000, 8})}}, 3000), std::exception);
  EXPECT_THROW(s.begin({{at::zeros({3000, 8}), at::zeros({3000, 4})}}, 3000), std::exception);
}

// The race made to happen: before each chunk it copies the writer meets the training at a
// rendezvous (two counters, no sleeps), and then, at the same time, the writer copies that
// chunk and the training changes rows of that very chunk (and a few elsewhere). Whichever
// takes the chunk's lock first copies the rows: the training (it copied rows itself) or the
// writer (the training finds them copied and copies nothing). Over 40 trials of 20 chunks
// both outcomes happen, and in every trial the buffers hold the rows at begin().
TEST(RowStaging, TheWriterAndTheTrainingRaceForTheSameChunk) {
  const int64_t rows = 20000, chunk = RowStaging::kChunkRows;  // 20 chunks
  std::mt19937_64 rng(11);
  int64_t training_won = 0, writer_won = 0;
  for (int trial = 0; trial < 40; ++trial) {
    Rows r = make_rows(rows, 300 + trial);
    RowStaging s;
    std::atomic<int64_t> writer_at{0}, training_at{0};
    std::atomic<bool> training_done{false}, writer_done{false};
    s.set_chunk_hook([&](int64_t c) {
      writer_at = c + 1;
      while (training_at.load() < c + 1 && !training_done.load()) std::this_thread::yield();
    });
    s.begin(r.pairs(), rows);
    std::thread writer([&] {
      s.complete();
      writer_done = true;
    });
    for (int64_t k = 1; k <= (rows + chunk - 1) / chunk && !writer_done.load(); ++k) {
      training_at = k;
      while (writer_at.load() < k && !writer_done.load()) std::this_thread::yield();
      // The chunk the writer is copying now (writer_at - 1): some of its rows, then a few elsewhere.
      const int64_t c = writer_at.load() - 1, c0 = c * chunk, n = std::min(chunk, rows - c0);
      const int64_t first = c0 + static_cast<int64_t>(rng() % uint64_t(n)), count = std::min<int64_t>(1 + rng() % 64, c0 + n - first);
      const int64_t before = s.rows_copied_by_training();
      s.before_change(first, count, at::Tensor());
      (s.rows_copied_by_training() > before ? training_won : writer_won) += 1;
      change(r, first, count, at::Tensor());
      std::vector<int64_t> ix(8);
      for (auto& v : ix) v = static_cast<int64_t>(rng() % rows);
      const at::Tensor index = torch::tensor(ix, at::kLong);
      s.before_change(0, 0, index);
      change(r, 0, 0, index);
    }
    training_done = true;
    writer.join();
    expect_buffers_hold_the_start(r);
  }
  std::printf("races for a chunk: the training copied the rows first in %lld, the writer in %lld\n",
              static_cast<long long>(training_won), static_cast<long long>(writer_won));
  EXPECT_GT(training_won, 0) << "the training never got to a chunk's rows before the writer";
  EXPECT_GT(writer_won, 0) << "the writer never got to a chunk before the training";
}

}  // namespace
}  // namespace faceshard
