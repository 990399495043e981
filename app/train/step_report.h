// The training log's step records, and what a step's timing says about the job.
//
// StepReport sums each step's loss and accuracy on the device, and every train.log_every
// steps posts one record (TrainRecord: loss, accuracy, learning rates, speed, ETA, the head's
// state, the share of bf16 centre updates that left the stored value unchanged, stragglers
// and slow links) whose device values are read a step or two later (DeviceReadout: no host
// synchronisation); a non-finite loss found in them stops the run.
//
// StepWatch judges each step's time: the median of the recent steps scales the hang
// detection (Distributed::hang_limit), time waited in collectives beyond what the step's
// scheduled work (verification, checkpoints) explains is a network stall (one line at most
// every 10 s, naming who fell silent), and each step's times go to the straggler monitor.
#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>

#include <ATen/ATen.h>

#include "app/train/device_readout.h"
#include "partial_fc/distributed/link_watch.h"

namespace faceshard {

struct TrainJob;
struct TrainProgress;
struct StepResult;
class TrainStep;
class LogSinks;
class CheckpointManager;
class StragglerMonitor;

class StepReport {
 public:
  StepReport(TrainJob& job, LogSinks& sinks, CheckpointManager& checkpoints, StragglerMonitor* stragglers,
             int64_t start_step);
  // After each step (progress already at the step just made).
  void add(const StepResult& r, const TrainProgress& p, const TrainStep& step);
  // The records whose values have arrived (`wait`: all of them); throws on a non-finite loss.
  void deliver(bool wait) { readout_.deliver(wait); }
  std::chrono::steady_clock::time_point started() const { return t_start_; }

 private:
  void post(const StepResult& r, const TrainProgress& p, const TrainStep& step);

  TrainJob& j_;
  LogSinks& sinks_;
  CheckpointManager& checkpoints_;
  StragglerMonitor* stragglers_;
  int64_t start_step_;
  at::Tensor loss_sum_, acc_sum_;
  DeviceReadout readout_;
  int64_t logged_ = 0;
  std::chrono::steady_clock::time_point t_start_, t_log_;
};

class StepWatch {
 public:
  StepWatch(TrainJob& job, StragglerMonitor* stragglers);
  // At the start of a step: its time and its collectives' waits are counted from here.
  void begin();
  // Verification and checkpoints are scheduled work that other ranks wait for: left out of
  // the stall line and the straggler windows (link_watch.h).
  ScheduledWork& scheduled() { return scheduled_; }
  // At the end of step `step` (after its last collective).
  void end(int64_t step, const StepResult& r);

 private:
  TrainJob& j_;
  StragglerMonitor* stragglers_;
  ScheduledWork scheduled_;
  std::chrono::steady_clock::time_point t_step_;
  // The median of the last 51 step times, once 10 are in (the first steps, with cuDNN's
  // algorithm search and the caches filling, are not the run's pace).
  std::deque<double> times_;
  int64_t seen_ = 0;
  double median_step_ = 0;
  int64_t stalls_unreported_ = 0;
  std::chrono::steady_clock::time_point t_stall_line_;
};

}  // namespace faceshard
