// The host memory a checkpoint written in the background (train.checkpoint_async) stages:
// rank 0 copies the backbone, its optimiser's state and its classifier shard; every other
// rank its shard. A host's ranks stage at the same step, so the host holds the sum; the
// trainer saves synchronously where its host's available memory cannot hold that.
#pragma once
#include "app/plan/job_time_plan.h"

namespace faceshard {

struct CheckpointStagingPlan {
  double rank0_bytes = 0;   // backbone.pt + train_state.pt + rank 0's shard (the largest)
  double other_bytes = 0;   // any other rank: its shard
  int ranks_per_host = 1;
  double host_bytes = 0;    // the host that runs rank 0: rank 0's + (ranks_per_host - 1) others'
};

// From the checkpoint plan of the same job; ranks_per_host: the ranks one host runs (at most
// the job's world size).
CheckpointStagingPlan plan_checkpoint_staging(const CheckpointPlan& ck, const JobSettings& job, int ranks_per_host);

}  // namespace faceshard
