// faceshard-train's job: distributed init -> data -> backbone (DataParallel, optional
// SyncBatchNorm) -> sharded classifier -> loss -> backward -> optimiser steps, with the LR
// schedule, mixed precision, logging (console, metrics.jsonl, TensorBoard), verification,
// checkpoints with resume (also onto a different number of ranks), graceful SIGTERM and
// the export of the final backbone.
#pragma once
#include <string>

#include "app/config.h"

namespace faceshard {

struct TrainRequest {
  Config config;
  std::string config_text;  // the merged config as YAML, saved next to the outputs
  bool resume = false;      // continue from the latest committed checkpoint
  std::string resume_from;  // ... or from this checkpoint folder
};

// Runs the job on the ranks of the environment; returns the process exit status.
int run_training(const TrainRequest& request);

}  // namespace faceshard
