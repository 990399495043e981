#include "app/train/checkpoint_policy.h"

#include "app/config/config.h"
#include "app/io/checkpoint.h"
#include "app/train/log_sinks.h"
#include "app/train/train_state.h"
#include "base/error.h"
#include "base/log.h"
#include "partial_fc/distributed/distributed.h"

namespace faceshard {

CheckpointPolicy::CheckpointPolicy(const Config& cfg, Distributed& dist, CheckpointManager& checkpoints,
                                   TrainState& state, LogSinks& sinks)
    : cfg_(cfg), dist_(dist), checkpoints_(checkpoints), state_(state), sinks_(sinks) {}

bool CheckpointPolicy::settle(const CheckpointOutcome& o, bool last) {
  sinks_.checkpoint(
      CheckpointRecord{o.step, o.wait_s, o.stage_s, o.previous_s, o.write_s, o.bytes, o.background, o.committed});
  if (o.committed) return true;
  const std::string latest = checkpoints_.latest();
  const std::string kept =
      latest.empty() ? "no checkpoint is committed yet" : "the last committed checkpoint, " + latest + ", is untouched";
  const int64_t n = checkpoints_.failed_in_a_row();
  const int64_t limit = cfg_.train.max_failed_checkpoints;
  if (last || n >= limit) {
    if (dist_.rank() == 0)
      report_fatal("faceshard-train",
                   detail::concat(n, " checkpoint save", n > 1 ? "s" : "", " failed in a row (",
                                  last ? "the run's last one" : "train.max_failed_checkpoints " + std::to_string(limit),
                                  "), the last at step ", o.step, ": ", o.problem, "; ", kept));
    return false;
  }
  if (n == 1)
    log_warn("checkpoint step ", o.step, " not saved: ", o.problem, "; ", kept,
             "; training goes on and the next checkpoint tries again (the run stops after ", limit,
             " failures in a row)");
  return true;
}

bool CheckpointPolicy::save(bool last) {
  if (std::optional<CheckpointOutcome> o = writer_->save(state_, last)) {
    const bool this_one = o->step == state_.progress().step && !writer_->background();
    if (!settle(*o, last && this_one)) return false;
  }
  // The run's last checkpoint (its end, a stop) is waited for before the process exits.
  if (last)
    if (std::optional<CheckpointOutcome> o = writer_->finish())
      if (!settle(*o, true)) return false;
  return true;
}

bool CheckpointPolicy::writing_anywhere(const std::optional<int64_t>& q) {
  if (!q) return false;
  at::Tensor w = torch::tensor({static_cast<float>(writer_->still_writing())});
  if (dist_.world_size() > 1) dist_.all_reduce(w, ReduceOp::Max);
  return w.item<float>() > 0;
}

bool CheckpointPolicy::save_for_stop(const std::string& who) {
  const int64_t step = state_.progress().step;
  stop_step_ = step;
  // A write already over everywhere costs the stop nothing to wait for: the stop's own step
  // is written (one write), as with no write in flight.
  if (const std::optional<int64_t> q = writer_->in_flight_step(); q && *q < step && writing_anywhere(q)) {
    log_info("stop requested (", who, ") at step ", step, ": the checkpoint of step ", *q,
             ", being written in the background, is the stop's checkpoint (the resume redoes steps ", *q + 1, "-",
             step, " rather than the stop writing a second checkpoint after it)");
    if (std::optional<CheckpointOutcome> o = writer_->finish()) {
      if (!settle(*o, /*last=*/false)) return false;
      if (o->committed) {
        stop_step_ = *q;
        return true;
      }
      log_warn("stop: the checkpoint of step ", *q, " was not saved (", o->problem, "): checkpointing step ", step,
               " instead");
    }
  } else {
    log_info("stop requested (", who, "): checkpointing at step ", step, " and exiting");
  }
  return save(/*last=*/true);
}

}  // namespace faceshard
