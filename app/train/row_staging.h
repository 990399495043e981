// Copy-on-write staging of a classifier shard's rows on the CPU. A checkpoint in the
// background needs a copy of the shard as it was at its step (GBs: 2M classes of fp32
// centres and momentum are 8.2 GB, a second or more of memory bandwidth), but the next step
// changes only the rows it trains (a tenth of them at sample_rate 0.1). So the training does
// not copy the shard at the checkpoint's step: the background writer copies it, chunk by
// chunk, while the training goes on, and whenever the training is about to change rows the
// writer has not copied yet (PartialFC's before_rows_change hook), it copies those rows
// first, itself. Each row is copied exactly once, by whichever gets to it first, and always
// before anything changes it: the copy is the step's state, as a copy taken at the step
// would be. (On a GPU the shard is staged on a side stream instead: StagingBuffers.)
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace faceshard {

class RowStaging {
 public:
  // Rows per chunk: the unit the writer copies and the two sides lock.
  static constexpr int64_t kChunkRows = 1024;

  // Whether `t` (a live row tensor of `rows` rows) can be staged row by row: on the CPU,
  // contiguous, with `rows` rows.
  static bool stageable(const at::Tensor& t, int64_t rows);

  // Starts a copy of each pair's source (live [rows, ...] tensors, contiguous, on the CPU)
  // into its buffer (the same shape and type). Nothing is copied yet. Called by the training
  // thread at the checkpoint's step; the previous copy must be complete.
  void begin(std::vector<std::pair<at::Tensor, at::Tensor>> source_and_buffer, int64_t rows);
  // The training thread, before rows change in place (PartialFC::RowsChangeHook): rows
  // [first, first + count), or the rows `index` lists, copied now where not copied yet.
  void before_change(int64_t first, int64_t count, const at::Tensor& index);
  // The writer: copies every row not copied yet; when it returns the buffers hold the step's
  // state. `abort`, when set, stops it early (returns false: the buffers are incomplete).
  bool complete(const std::atomic<bool>* abort = nullptr);
  // Whether a copy is under way (begun, not complete).
  bool active() const { return active_.load(std::memory_order_acquire); }

  // Called by complete() before each chunk it has not seen copied (its index), outside the
  // chunk's lock: where tests make the writer wait for the training, so that the two sides
  // interleave chunk by chunk instead of the writer finishing first.
  void set_chunk_hook(std::function<void(int64_t chunk)> hook) { chunk_hook_ = std::move(hook); }

  // Of the last copy: the rows the training copied itself, and the seconds it spent on them
  // (waits for the writer's chunk included).
  int64_t rows_copied_by_training() const { return training_rows_.load(); }
  double training_seconds() const;
  double bytes() const;

 private:
  // Rows [first, first + n) of every pair (within one chunk, its lock held).
  void copy_rows(int64_t first, int64_t n);
  // The rows of [first, first + n) not copied yet, within chunk c (its lock held).
  void copy_unclaimed(int64_t c, int64_t first, int64_t n, bool by_training);

  std::vector<std::pair<at::Tensor, at::Tensor>> pairs_;
  std::vector<int64_t> row_bytes_;
  int64_t rows_ = 0;
  std::atomic<bool> active_{false};
  // Per chunk: its lock, and whether it is wholly copied.
  std::unique_ptr<std::mutex[]> locks_;
  std::unique_ptr<std::atomic<bool>[]> done_;
  int64_t chunks_ = 0;
  std::vector<uint8_t> copied_;  // per row, in chunks not wholly copied (under the chunk's lock)
  std::vector<int64_t> copied_in_chunk_;  // per chunk, its rows copied so far (under its lock)
  std::atomic<int64_t> training_rows_{0};
  std::atomic<int64_t> training_ns_{0};
  std::function<void(int64_t)> chunk_hook_;
};

}  // namespace faceshard
