// faceshard-train's job: build the run (app/train/train_job.h), resume its state if asked
// (train_state.h), then the loop: one TrainStep per step (train_step.h), log records to the
// sinks (log_sinks.h), verification (validation.h), checkpoints, graceful SIGTERM, and the
// export of the final backbone.
#pragma once
#include <string>

#include "app/config/config.h"
#include "app/train/fault_injection.h"

namespace faceshard {

struct TrainRequest {
  Config config;
  std::string config_text;  // the merged config as YAML, saved next to the outputs
  bool resume = false;      // continue from the latest committed checkpoint
  std::string resume_from;  // ... or from this run folder, checkpoints folder or checkpoint
  bool overwrite = false;   // a fresh run moves a previous run's files aside instead of refusing
  FaultPlan faults;         // tests only: faults to inject (empty: none)
};

// Runs the job on the ranks of the environment; returns the process exit status.
int run_training(const TrainRequest& request);

}  // namespace faceshard
