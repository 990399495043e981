#include "partial_fc/classifier/class_shard.h"

#include <algorithm>

#include "base/error.h"

namespace faceshard {

ClassShard ClassShard::of(int64_t C, int W, int r) {
  if (C < W) throw option_error("num_classes", "must be at least the number of ranks (", W, "), got ", C);
  ClassShard s;
  s.num_classes = C;
  s.world_size = W;
  s.rank = r;
  s.count = C / W + (r < C % W ? 1 : 0);
  s.start = C / W * r + std::min<int64_t>(r, C % W);
  return s;
}

std::vector<ClassShard> ClassShard::all(int64_t C, int W) {
  std::vector<ClassShard> v;
  for (int r = 0; r < W; ++r) v.push_back(of(C, W, r));
  return v;
}

}  // namespace faceshard
