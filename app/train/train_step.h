// One optimiser step of training, as a unit: it pulls the step's micro-batches, runs the
// backbone and the sharded classifier forward, backward (DataParallel synchronises the
// backbone's gradients on the last micro-batch only; the classifier sets each earlier
// micro-batch's gradient aside), scales the loss and skips non-finite steps under fp16,
// clips the backbone's gradient and steps both optimisers with the step's learning rates.
// faceshard-train calls it in its loop; faceshard-bench's step mode times it.
#pragma once
#include <functional>
#include <optional>
#include <utility>

#include <torch/torch.h>

#include "app/train/graphed_backbone.h"
#include "app/train/train_job.h"
#include "data/loader.h"

namespace faceshard {

// Seconds per phase of one step (filled when timing is on: on a GPU from events recorded
// at each boundary, the device's time per phase, read once the step is queued, which
// waits for it; the trainer leaves it off).
struct StepTimes {
  double data = 0, forward = 0, backward = 0, optimizer = 0;
  // The host's time blocked in collectives within each phase (waiting for other ranks).
  double forward_wait = 0, backward_wait = 0, optimizer_wait = 0;
  double total() const { return data + forward + backward + optimizer; }
};

struct StepResult {
  at::Tensor loss;      // 0-dim, mean over the step's micro-batches, on the device (no sync)
  at::Tensor accuracy;  // 0-dim, likewise
  double lr = 0, fc_lr = 0;
  bool skipped = false;  // loss scaling: non-finite gradients on some rank, nothing moved
  double data_wait_s = 0;  // host seconds waiting for the micro-batches (always measured)
  StepTimes times;
};

// The next micro-batch of the run (the caller decides epochs and positions).
using BatchSource = std::function<Batch()>;

class TrainStep {
 public:
  explicit TrainStep(TrainJob& job, bool timing = false);
  // Per-phase times in StepResult::times from the next step on (or not). On a GPU a timed
  // step waits for the device at its end.
  void set_timing(bool on) { timing_ = on; }

  // Runs optimiser step `step` (0-based): job.micro micro-batches from `next`.
  StepResult run(const BatchSource& next, int64_t step);

  // Without loss scaling a non-finite loss is an error: the first step (0-based) whose loss
  // was not finite, if any. Reads the device (a host sync): call where the loop syncs anyway.
  std::optional<int64_t> first_nonfinite_step() const;
  // The same as it lives on the device (int64, 0-dim, -1 while every loss was finite), for
  // a reader that does not wait for the device.
  const at::Tensor& first_nonfinite_marker() const { return first_bad_; }

  // How the step runs the backbone: make_backbone_run's choice (eagerly, or CUDA graphs with
  // train.cuda_graph) unless replaced here (tests: a GraphedBackbone on the CPU).
  void set_backbone_run(BackboneRun run) { backbone_run_ = std::move(run); }

  // Called on every rank after the step's backward, before unscaling and the optimisers,
  // with the 1-based step number (fault injection).
  void set_gradient_hook(std::function<void(int64_t step)> hook) { gradient_hook_ = std::move(hook); }

 private:
  TrainJob& job_;
  bool timing_;
  at::Tensor first_bad_;  // int64 0-dim on the device, -1 while every loss was finite
  std::function<void(int64_t)> gradient_hook_;
  BackboneRun backbone_run_;
};

}  // namespace faceshard
