#include "app/train/train_step.h"

#include <chrono>

#include <memory>
#include <utility>
#include <vector>

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "app/train/fine_tune.h"
#include "app/train/grad_clip.h"
#include "base/designed_host_sync.h"

namespace faceshard {
namespace {

using Clock = std::chrono::steady_clock;

// Marks phase boundaries when timing is on. On the CPU, the host's clock at each one; on a
// GPU, an event recorded on the device's stream at each boundary, read once the step is
// queued (finish): each phase's time is the device's between its boundaries, and the step
// is timed without a host synchronisation inside it.
class PhaseClock {
 public:
  PhaseClock(bool on, torch::Device device, const Distributed& dist)
      : on_(on), device_(device), dist_(dist), t_(Clock::now()), blocked_(dist.blocked_seconds_total()) {
    if (on_ && !device_.is_cpu()) mark(nullptr);
  }
  // `wait`: where the host's time blocked in collectives during the phase goes.
  void lap(double& into, double* wait = nullptr) {
    if (!on_) return;
    const double b = dist_.blocked_seconds_total();
    if (wait) *wait += b - blocked_;
    blocked_ = b;
    if (!device_.is_cpu()) return mark(&into);
    const auto now = Clock::now();
    into += std::chrono::duration<double>(now - t_).count();
    t_ = now;
  }
  // Adds the device's phase times (waits for the last boundary's event).
  void finish() {
    if (marks_.empty()) return;
    marks_.back().first->synchronize();
    for (size_t k = 1; k < marks_.size(); ++k)
      *marks_[k].second += marks_[k - 1].first->elapsedTime(*marks_[k].first) / 1000.0;
    marks_.clear();
  }

 private:
  void mark(double* into) {
    auto ev = std::make_unique<c10::Event>(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    ev->record(c10::impl::getDeviceGuardImpl(device_.type())->getStream(device_));
    marks_.emplace_back(std::move(ev), into);
  }

  bool on_;
  torch::Device device_;
  const Distributed& dist_;
  Clock::time_point t_;
  double blocked_;
  std::vector<std::pair<std::unique_ptr<c10::Event>, double*>> marks_;
};

}  // namespace

TrainStep::TrainStep(TrainJob& job, bool timing)
    : job_(job),
      timing_(timing),
      first_bad_(torch::full({}, -1, torch::TensorOptions().device(job.device).dtype(torch::kLong))),
      backbone_run_(make_backbone_run(job)) {}

StepResult TrainStep::run(const BatchSource& next, int64_t step) {
  TrainJob& j = job_;
  j.freeze.apply(step);  // fine-tuning: frozen or thawed before this step's forward
  StepResult r;
  r.lr = j.schedule.lr(step) * thaw_warmup_factor(j.cfg.optim, step);
  r.fc_lr = j.fc_schedule.lr(step);
  PhaseClock clock(timing_, j.device, *j.dist);
  const auto zero = torch::TensorOptions().device(j.device);
  at::Tensor loss_sum = torch::zeros({}, zero), acc_sum = torch::zeros({}, zero);
  // A step that is never skipped nor inspected before it is taken: the classifier's
  // backward applies it as it goes (streamed logits; PartialFC::arm_step).
  if (!j.loss_scaling && j.micro == 1 && !gradient_hook_) j.fc->arm_step(r.fc_lr);
  for (int64_t k = 0; k < j.micro; ++k) {
    j.dist->set_context(step + 1, "forward");
    const auto t_data = Clock::now();
    Batch batch = next();
    r.data_wait_s += std::chrono::duration<double>(Clock::now() - t_data).count();
    clock.lap(r.times.data);
    auto out = j.fc->forward(backbone_run_(batch.images), batch.labels);
    at::Tensor loss = j.micro > 1 ? out.loss / static_cast<double>(j.micro) : out.loss;
    at::Tensor scaled = j.scaler->scale(loss).reshape(loss.sizes());
    j.ddp->prepare_for_backward({scaled});
    clock.lap(r.times.forward, &r.times.forward_wait);
    j.dist->set_context(step + 1, "backward");
    if (k + 1 == j.micro) {
      scaled.backward();
    } else {
      auto local_only = j.ddp->no_sync();
      scaled.backward();
    }
    torch::NoGradGuard ng;
    loss_sum.add_(out.loss.detach());
    acc_sum.add_(out.accuracy.detach());
    if (!j.loss_scaling) first_bad_.masked_fill_((~torch::isfinite(out.loss.detach())) & (first_bad_ < 0), step);
    // The classifier's sampled rows change every micro-batch: keep their gradient.
    if (k + 1 < j.micro) j.fc->accumulate();
    clock.lap(r.times.backward, &r.times.backward_wait);
  }
  j.dist->set_context(step + 1, "optimizer");
  if (gradient_hook_) gradient_hook_(step + 1);
  if (j.loss_scaling) {
    at::Tensor found_inf = torch::maximum(j.scaler->unscale_(j.backbone_params), j.fc->unscale_(j.scaler->inv_scale()));
    // Every rank must take the same decision (the shards' gradients differ).
    at::Tensor f;
    {
      DesignedHostSync sync("loss scaler: found_inf to the host, for the ranks' one skip decision");
      f = found_inf.to(torch::kCPU).to(torch::kFloat).reshape({1}).clone();
    }
    j.dist->all_reduce(f, ReduceOp::Max);
    r.skipped = j.scaler->update(f.to(found_inf.device()));
  }
  if (r.skipped) {
    j.opt->zero_grad();
    j.fc->zero_grad();
  } else {
    if (j.cfg.optim.grad_clip > 0) clip_grad_norm(j.backbone_params, j.cfg.optim.grad_clip);
    j.opt->step(r.lr);
    j.fc->step(r.fc_lr);
    j.opt->zero_grad();
  }
  clock.lap(r.times.optimizer, &r.times.optimizer_wait);
  clock.finish();
  r.loss = loss_sum / static_cast<double>(j.micro);
  r.accuracy = acc_sum / static_cast<double>(j.micro);
  return r;
}

std::optional<int64_t> TrainStep::first_nonfinite_step() const {
  const int64_t bad = first_bad_.item<int64_t>();
  return bad >= 0 ? std::optional<int64_t>(bad) : std::nullopt;
}

}  // namespace faceshard
