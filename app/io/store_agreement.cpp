#include "app/io/store_agreement.h"

#include <algorithm>
#include <vector>

#include "base/error.h"

namespace faceshard {

StoreAgreement::StoreAgreement(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int world_size,
                               std::chrono::milliseconds timeout, const std::atomic<bool>* abort)
    : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), world_(world_size), timeout_(timeout),
      abort_(abort) {}

std::string StoreAgreement::agree(const std::string& mine) {
  if (world_ <= 1) return mine;
  if (!broken_.empty()) return broken_;
  if (before_stage_) before_stage_(stage_);
  const std::string stage = prefix_ + "/" + std::to_string(stage_++) + "/";
  std::vector<std::string> keys;
  for (int r = 0; r < world_; ++r) keys.push_back(stage + std::to_string(r));
  // A value of one byte or more: "+" then the problem ("+" alone: none).
  const std::string value = "+" + mine.substr(0, 400);
  try {
    store_->set(keys[static_cast<size_t>(rank_)], std::vector<uint8_t>(value.begin(), value.end()));
    // In slices of a second, so that an abort, or a dead or frozen peer, is seen soon.
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + timeout_;
    const int64_t start_ms = judge_.clock_ms ? judge_.clock_ms() : 0;
    for (;;) {
      if (abort_ && abort_->load()) return "rank " + std::to_string(rank_) + ": the save was given up (the run is ending)";
      if (judge_.limit && judge_.silent) {
        const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
        const auto limit = judge_.limit();
        if (waited >= limit) {
          std::vector<int> missing;
          for (int r = 0; r < world_; ++r)
            if (r != rank_ && !store_->check({keys[static_cast<size_t>(r)]})) missing.push_back(r);
          const std::string who = missing.empty() ? std::string() : judge_.silent(missing, start_ms);
          if (!who.empty())
            return broken_ = "rank " + std::to_string(rank_) + ": the checkpoint's agreement waited " +
                             std::to_string(waited.count() / 100 / 10.0).substr(0, 4) + " s, past the hang limit of " +
                             std::to_string(limit.count() / 100 / 10.0).substr(0, 4) + " s, for " + who;
        }
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      try {
        store_->wait(keys, std::max(std::chrono::milliseconds(1), std::min(left, std::chrono::milliseconds(1000))));
        break;
      } catch (const c10::DistStoreError&) {
        if (std::chrono::steady_clock::now() >= deadline) throw;
      }
    }
  } catch (const std::exception& e) {
    // Every rank that sees this gives the save up: a rank that never reported is dead or
    // cut off, and its part cannot be trusted.
    return broken_ = "rank " + std::to_string(rank_) + ": the other ranks did not all report within " +
                     std::to_string(timeout_.count() / 1000) + " s (" + one_line(e) + ")";
  }
  std::string verdict;
  for (int r = 0; r < world_ && verdict.empty(); ++r) {
    std::vector<uint8_t> got;
    try {
      got = store_->get(keys[static_cast<size_t>(r)]);
    } catch (const std::exception& e) {
      return "rank " + std::to_string(rank_) + ": cannot read rank " + std::to_string(r) + "'s report: " + one_line(e);
    }
    if (got.size() > 1) verdict.assign(got.begin() + 1, got.end());
  }
  return verdict;
}

}  // namespace faceshard
