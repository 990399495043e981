// Faults the end-to-end tests inject into a real run, to prove that the loss scaler skips
// a poisoned step and that a save killed half-way leaves the last checkpoint usable. The
// plan is read once, when faceshard-train starts, from FACESHARD_FAULTS (a comma-separated
// list of KIND@RANK:STEP, STEP counted from 1 as in the logs):
//   inf_gradient@1:3    rank 1 puts an inf into a backbone gradient of step 3
//   crash_in_save@0:8   rank 0 is killed (SIGKILL) half-way through the save of step 8
//   hold_save@0:3       rank 0's save of step 3 stops half-way until the file named by
//                       FACESHARD_FAULTS_RELEASE exists (a write kept in flight on purpose)
//   hold_write@0:2      rank 0's background writer holds its checkpoint of step 2 before it
//                       writes (or copies) anything, until that file exists: the training
//                       takes its next steps meanwhile, which must not reach the checkpoint
//   hold_written@1:2    rank 1's background write of step 2, committed, does not count as
//                       done until that file exists: the other ranks' writes are done, this
//                       rank's is still in flight
//   freeze_in_agreement@1:8   rank 1 stops itself (SIGSTOP) inside the last stage of the
//                       agreement of step 8's background save: after rank 0 wrote COMMITTED,
//                       before rank 1 confirmed it (the other ranks wait on a frozen peer)
// Nothing in the training step reads the environment; an empty plan injects nothing.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace faceshard {

struct FaultPlan {
  struct At {
    int rank = 0;
    int64_t step = 0;
  };
  std::optional<At> inf_gradient, crash_in_save, hold_save, hold_write, hold_written, freeze_in_agreement;
  std::string release_file;  // the holds'

  // Usage error naming the variable and the item when the spec is malformed.
  static FaultPlan parse(const std::string& spec);
  static FaultPlan from_environment();
  bool empty() const { return !inf_gradient && !crash_in_save && !hold_save && !hold_write && !hold_written && !freeze_in_agreement; }
};

class CheckpointManager;
class CheckpointWriter;
class TrainStep;

// Hooks the plan's faults for this rank into the run's checkpoints and training step
// (nothing when the plan is empty): inf_gradient writes +inf into the first backbone
// gradient; crash_in_save kills the process with SIGKILL (no handler, no flush).
void install_faults(const FaultPlan& plan, int rank, CheckpointManager& checkpoints, TrainStep& step,
                    const std::vector<at::Tensor>& backbone_params);
// hold_write, hold_written and freeze_in_agreement into the run's checkpoint writer: a usage error when the writer does not write
// in the background (the hold would stop the training itself).
void install_writer_faults(const FaultPlan& plan, int rank, CheckpointWriter& writer);

}  // namespace faceshard
