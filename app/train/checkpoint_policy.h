// What a run does with its checkpoints' outcomes, and which checkpoint a stop takes.
//
// A checkpoint that cannot be saved (a full disk, a quota, an I/O error on any rank) costs
// nothing committed: one warning, training goes on, the next interval tries again. After
// train.max_failed_checkpoints in a row, or when the run's last checkpoint (its end, a stop)
// fails, the run stops: one line (report_fatal), and the caller exits with
// kCheckpointsFailing. With train.checkpoint_async a save's outcome is known when the next
// save starts or the run ends (checkpoint_writer.h): the policy is applied to it then, at the
// same step on every rank. Each outcome goes to the sinks (metrics.jsonl: how long the
// training stopped for it beside how long the write took).
//
// A stop's checkpoint: where a checkpoint of an earlier step is still being written in the
// background on any rank, that one is the stop's (the resume redoes the steps since: they
// took less time than that write has so far), instead of the stop writing a second
// checkpoint after it (twice the stop's time: what a scheduler's grace period may not allow).
// Where it fails, the stop's own step is written.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "app/train/checkpoint_writer.h"

namespace faceshard {

struct Config;
class Distributed;
class CheckpointManager;
class TrainState;
class LogSinks;

// Checkpoints could not be saved: the process exit status.
constexpr int kCheckpointsFailing = 3;

class CheckpointPolicy {
 public:
  CheckpointPolicy(const Config& cfg, Distributed& dist, CheckpointManager& checkpoints, TrainState& state,
                   LogSinks& sinks);
  // The writer, made once the state is loaded (make_checkpoint_writer).
  void set_writer(std::unique_ptr<CheckpointWriter> writer) { writer_ = std::move(writer); }
  CheckpointWriter& writer() { return *writer_; }

  // Takes the checkpoint of the state's step; `last` (the run's end): waited for before it
  // returns. false: the run must stop (said on rank 0).
  bool save(bool last);
  // The stop's checkpoint (`who` asked for the stop: said in the log line); false as save().
  bool save_for_stop(const std::string& who);
  // The step of the stop's checkpoint (the state's step, or the earlier one being written).
  int64_t stop_step() const { return stop_step_; }

 private:
  bool settle(const CheckpointOutcome& o, bool last);
  // Whether the background write of step `q` is still going on on any rank (collective: the
  // same answer everywhere, so that every rank takes the same checkpoint).
  bool writing_anywhere(const std::optional<int64_t>& q);

  const Config& cfg_;
  Distributed& dist_;
  CheckpointManager& checkpoints_;
  TrainState& state_;
  LogSinks& sinks_;
  std::unique_ptr<CheckpointWriter> writer_;
  int64_t stop_step_ = -1;
};

}  // namespace faceshard
