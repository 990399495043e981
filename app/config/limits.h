// Bounds shared by the config's validation and the tools that plan a job from the same
// values (faceshard-plan), so that both accept exactly the same jobs.
#pragma once
#include <cstdint>

namespace faceshard {

// data.num_classes: class ids, shard bounds and tensor sizes are int64; at most 2^40
// classes keeps every product of them with an embedding size far from overflow.
constexpr int64_t kMaxNumClasses = int64_t(1) << 40;

}  // namespace faceshard
