// The distributed sampler: every epoch a seeded permutation of the data set, cut into
// disjoint equal shares, one per rank (the remainder is dropped, as drop_last does), and
// resumable from (epoch, position). Plain C++ so that every rank computes the same order.
#pragma once
#include <cstdint>
#include <vector>

namespace faceshard {

class DistributedSampler {
 public:
  // shuffle=false keeps the data-set order (used for evaluation and tests).
  DistributedSampler(uint64_t dataset_size, int world_size, int rank, uint64_t seed, bool shuffle = true);

  // Samples of this rank per epoch: dataset_size / world_size.
  uint64_t size() const { return per_rank_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }

  // This rank's data-set indices for `epoch`, starting at `position` (0 <= position <=
  // size()): resuming at (epoch, position) continues exactly where an interrupted run
  // stopped. The order depends only on (seed, epoch), never on the rank count of the
  // caller's history.
  std::vector<uint64_t> indices(uint64_t epoch, uint64_t position = 0) const;

  // The whole epoch's permutation before it is shared out (all ranks agree on it).
  std::vector<uint64_t> permutation(uint64_t epoch) const;

 private:
  uint64_t n_;
  int world_;
  int rank_;
  uint64_t seed_;
  bool shuffle_;
  uint64_t per_rank_;
};

}  // namespace faceshard
