#include "app/train/row_staging.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "base/error.h"

namespace faceshard {

bool RowStaging::stageable(const at::Tensor& t, int64_t rows) {
  return t.defined() && t.device().is_cpu() && t.is_contiguous() && t.dim() >= 1 && t.size(0) == rows && rows > 0;
}

void RowStaging::begin(std::vector<std::pair<at::Tensor, at::Tensor>> source_and_buffer, int64_t rows) {
  if (active()) throw runtime_error("RowStaging::begin: the previous copy is not complete");
  row_bytes_.clear();
  for (const auto& [src, buf] : source_and_buffer) {
    if (!stageable(src, rows) || !buf.is_contiguous() || buf.sizes() != src.sizes() ||
        buf.scalar_type() != src.scalar_type() || !buf.device().is_cpu())
      throw runtime_error("RowStaging::begin: a source of shape ", src.sizes(), " and its buffer of shape ", buf.sizes(),
                          " cannot be staged by row");
    row_bytes_.push_back(static_cast<int64_t>(src.numel() / rows) * static_cast<int64_t>(src.element_size()));
  }
  pairs_ = std::move(source_and_buffer);
  rows_ = rows;
  const int64_t chunks = (rows + kChunkRows - 1) / kChunkRows;
  if (chunks != chunks_) {
    locks_ = std::make_unique<std::mutex[]>(static_cast<size_t>(chunks));
    done_ = std::make_unique<std::atomic<bool>[]>(static_cast<size_t>(chunks));
    chunks_ = chunks;
  }
  for (int64_t c = 0; c < chunks_; ++c) done_[c].store(false, std::memory_order_relaxed);
  copied_in_chunk_.assign(static_cast<size_t>(chunks_), 0);
  copied_.assign(static_cast<size_t>(rows), 0);
  training_rows_ = 0;
  training_ns_ = 0;
  active_.store(true, std::memory_order_release);
}

void RowStaging::copy_rows(int64_t first, int64_t n) {
  for (size_t p = 0; p < pairs_.size(); ++p) {
    const int64_t rb = row_bytes_[p];
    const auto* src = static_cast<const char*>(pairs_[p].first.data_ptr()) + first * rb;
    auto* dst = static_cast<char*>(pairs_[p].second.data_ptr()) + first * rb;
    std::memcpy(dst, src, static_cast<size_t>(n * rb));
  }
}

void RowStaging::copy_unclaimed(int64_t c, int64_t first, int64_t n, bool by_training) {
  // Runs of rows not copied yet, each one memcpy per tensor.
  int64_t r = first;
  const int64_t end = first + n;
  int64_t taken = 0;
  while (r < end) {
    while (r < end && copied_[r]) ++r;
    int64_t s = r;
    while (r < end && !copied_[r]) ++r;
    if (r > s) {
      copy_rows(s, r - s);
      std::memset(&copied_[s], 1, static_cast<size_t>(r - s));
      taken += r - s;
    }
  }
  if (by_training) training_rows_ += taken;
  copied_in_chunk_[c] += taken;
  // A chunk the training copied piece by piece may be whole now.
  if (copied_in_chunk_[c] == std::min(kChunkRows, rows_ - c * kChunkRows)) done_[c].store(true, std::memory_order_release);
}

void RowStaging::before_change(int64_t first, int64_t count, const at::Tensor& index) {
  if (!active()) return;
  const auto t0 = std::chrono::steady_clock::now();
  if (index.defined()) {
    const at::Tensor ix = index.to(at::kCPU, at::kLong).contiguous();
    const int64_t* p = ix.data_ptr<int64_t>();
    for (int64_t i = 0, n = ix.numel(); i < n; ++i) {
      const int64_t row = p[i];
      if (row < 0 || row >= rows_) continue;  // not a row of this shard: nothing of it is staged
      const int64_t c = row / kChunkRows;
      if (done_[c].load(std::memory_order_acquire)) continue;
      std::lock_guard<std::mutex> lock(locks_[c]);
      if (!done_[c].load(std::memory_order_relaxed)) copy_unclaimed(c, row, 1, true);
    }
  } else {
    const int64_t lo = std::max<int64_t>(first, 0), hi = std::min(first + count, rows_);
    for (int64_t r = lo; r < hi;) {
      const int64_t c = r / kChunkRows, end = std::min(hi, (c + 1) * kChunkRows);
      if (!done_[c].load(std::memory_order_acquire)) {
        std::lock_guard<std::mutex> lock(locks_[c]);
        if (!done_[c].load(std::memory_order_relaxed)) copy_unclaimed(c, r, end - r, true);
      }
      r = end;
    }
  }
  training_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

bool RowStaging::complete(const std::atomic<bool>* abort) {
  if (!active()) return true;
  for (int64_t c = 0; c < chunks_; ++c) {
    if (abort && abort->load()) {
      active_.store(false, std::memory_order_release);  // given up: the buffers are never written
      return false;
    }
    if (done_[c].load(std::memory_order_acquire)) continue;
    if (chunk_hook_) chunk_hook_(c);
    std::lock_guard<std::mutex> lock(locks_[c]);
    if (done_[c].load(std::memory_order_relaxed)) continue;
    const int64_t c0 = c * kChunkRows;
    copy_unclaimed(c, c0, std::min(kChunkRows, rows_ - c0), false);
  }
  active_.store(false, std::memory_order_release);
  return true;
}

double RowStaging::training_seconds() const { return static_cast<double>(training_ns_.load()) * 1e-9; }

double RowStaging::bytes() const {
  double b = 0;
  for (int64_t rb : row_bytes_) b += static_cast<double>(rb) * static_cast<double>(rows_);
  return b;
}

}  // namespace faceshard
