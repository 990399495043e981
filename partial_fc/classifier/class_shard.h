// Which classes a rank owns: contiguous ranges, the first C % W ranks one class more.
// Sampling, checkpoints and resharding all work from these ranges.
#pragma once
#include <cstdint>
#include <vector>

namespace faceshard {

struct ClassShard {
  int64_t num_classes = 0;  // C, all ranks together
  int64_t start = 0;        // first class of this shard
  int64_t count = 0;        // classes in this shard
  int rank = 0;
  int world_size = 1;

  static ClassShard of(int64_t num_classes, int world_size, int rank);
  int64_t end() const { return start + count; }
  bool owns(int64_t label) const { return label >= start && label < start + count; }
  // The shard of every rank, in rank order.
  static std::vector<ClassShard> all(int64_t num_classes, int world_size);
};

}  // namespace faceshard
