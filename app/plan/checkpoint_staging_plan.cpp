#include "app/plan/checkpoint_staging_plan.h"

#include <algorithm>

namespace faceshard {

CheckpointStagingPlan plan_checkpoint_staging(const CheckpointPlan& ck, const JobSettings& job, int ranks_per_host) {
  CheckpointStagingPlan s;
  const double C = static_cast<double>(std::max<int64_t>(1, job.num_classes));
  const int64_t W = std::max(1, job.world_size);
  // Rank 0's shard has the most rows: ceil(C / W) (class_shard.h).
  const double rows0 = static_cast<double>((std::max<int64_t>(1, job.num_classes) + W - 1) / W);
  double backbone = 0, shards = 0;
  for (const CheckpointFilePlan& f : ck.files) {
    if (f.name.rfind("fc_shard", 0) == 0)
      shards += f.bytes;
    else
      backbone += f.bytes;
  }
  const double shard = shards * rows0 / C;
  s.rank0_bytes = backbone + shard;
  s.other_bytes = shard;
  s.ranks_per_host = std::clamp<int>(ranks_per_host, 1, static_cast<int>(W));
  s.host_bytes = s.rank0_bytes + (s.ranks_per_host - 1) * s.other_bytes;
  return s;
}

}  // namespace faceshard
