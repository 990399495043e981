// Verification during training: rank 0 holds the data.val_targets sets (insightface .bin),
// evaluates the backbone on them with the insightface 10-fold protocol, keeps the best
// accuracy of each set and reports to the log sinks; every rank meets in a barrier.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "app/eval/evaluation.h"
#include "app/train/log_sinks.h"
#include "app/train/train_job.h"

namespace faceshard {

class Validation {
 public:
  // Loads the sets on rank 0 (usage error naming a missing file).
  explicit Validation(TrainJob& job);
  bool enabled() const { return !job_.cfg.data.val_targets.empty(); }
  // Collective. `best` (per set) is updated.
  void run(int64_t step, std::map<std::string, double>& best, LogSinks& sinks);

 private:
  TrainJob& job_;
  std::vector<VerificationData> sets_;
};

}  // namespace faceshard
