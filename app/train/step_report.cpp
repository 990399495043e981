#include "app/train/step_report.h"

#include <algorithm>
#include <string>
#include <vector>

#include "app/io/checkpoint.h"
#include "app/train/log_sinks.h"
#include "app/train/train_job.h"
#include "app/train/train_state.h"
#include "app/train/train_step.h"
#include "base/error.h"
#include "base/log.h"
#include "partial_fc/distributed/straggler_monitor.h"

namespace faceshard {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The straggler monitor's reports since the last record: one warning line each, and their
// scores in the record.
void take_straggler_reports(StragglerMonitor& stragglers, Distributed& d, TrainRecord& rec) {
  for (const StragglerReport& s : stragglers.take_reports()) {
    if (s.phase == "link") {
      log_warn("slow link: host ", s.host, " (rank ", s.rank, ") <-> host ", d.store_host(),
               " (the store's): heartbeat round trips ", format_sig(s.median_s * 1000), " ms (90th percentile) against ",
               format_sig(s.fastest_s * 1000), " ms (the fastest rank's median) in steps ", s.first_step, "-",
               s.last_step);
      rec.head_state.emplace_back("slow_link/" + std::to_string(s.rank), s.median_s * 1000);
      continue;
    }
    log_warn("straggler: rank ", s.rank, " (host ", s.host, ") is slow in ", s.phase, ": ", format_sig(s.score, 2),
             " of the fastest rank's pace (median ", format_sig(s.median_s), " s against ", format_sig(s.fastest_s),
             " s a step) in steps ", s.first_step, "-", s.last_step);
    rec.head_state.emplace_back("straggler/" + std::to_string(s.rank), s.score);
  }
}

}  // namespace

StepReport::StepReport(TrainJob& job, LogSinks& sinks, CheckpointManager& checkpoints, StragglerMonitor* stragglers,
                       int64_t start_step)
    : j_(job), sinks_(sinks), checkpoints_(checkpoints), stragglers_(stragglers), start_step_(start_step) {
  loss_sum_ = torch::zeros({}, torch::TensorOptions().device(j_.device));
  acc_sum_ = torch::zeros_like(loss_sum_);
  t_start_ = t_log_ = Clock::now();
}

void StepReport::add(const StepResult& r, const TrainProgress& p, const TrainStep& step) {
  loss_sum_.add_(r.loss);
  acc_sum_.add_(r.accuracy);
  logged_++;
  const bool log_now = p.step % j_.cfg.train.log_every == 0 || p.step == j_.last_step;
  if (!log_now) {
    sinks_.progress(p.step, j_.last_step);
    return;
  }
  post(r, p, step);
  loss_sum_.zero_();
  acc_sum_.zero_();
  logged_ = 0;
  t_log_ = Clock::now();
}

void StepReport::post(const StepResult& r, const TrainProgress& p, const TrainStep& step) {
  TrainRecord rec;
  rec.step = p.step;
  rec.last_step = j_.last_step;
  rec.epoch = p.epoch;
  rec.lr = r.lr;
  rec.fc_lr = r.fc_lr;
  rec.samples_per_sec = logged_ * j_.global_batch() / std::max(seconds_since(t_log_), 1e-9);
  rec.eta_s = seconds_since(t_start_) / std::max<int64_t>(1, p.step - start_step_) * (j_.last_step - p.step);
  if (j_.loss_scaling) rec.loss_scale = j_.scaler->current_scale();
  rec.memory_gb = device_peak_memory_gb(j_.device);
  if (stragglers_) take_straggler_reports(*stragglers_, *j_.dist, rec);
  // The device's values of the record are read a step or two later (no host sync).
  std::vector<at::Tensor> values{loss_sum_, acc_sum_, step.first_nonfinite_marker()};
  std::vector<std::string> names;
  for (const auto& kv : j_.fc->head().state()) {
    names.push_back("head/" + j_.fc->head().name() + "/" + kv.first);
    values.push_back(kv.second);
  }
  // bf16 centres: the share of this rank's moved values whose stored bf16 stayed the same.
  const at::Tensor lost = j_.fc->take_lost_update_counts();
  if (lost.defined()) {
    values.push_back(lost[0]);
    values.push_back(lost[1]);
  }
  readout_.post(values, [&sinks = sinks_, &checkpoints = checkpoints_, rec, names, n = logged_,
                         counted = lost.defined(), scaling = j_.loss_scaling](const std::vector<double>& v) mutable {
    if (!scaling && v[2] >= 0)
      throw runtime_error("the loss became NaN/inf at step ", static_cast<int64_t>(v[2]) + 1,
                          "; stopping. Last good checkpoint: ",
                          checkpoints.latest().empty() ? "none" : checkpoints.latest());
    rec.loss = v[0] / n;
    rec.accuracy = v[1] / n;
    for (size_t k = 0; k < names.size(); ++k) rec.head_state.emplace_back(names[k], v[3 + k]);
    if (counted) {
      const double lost = v[3 + names.size()], moved = v[4 + names.size()];
      rec.head_state.emplace_back("fc/unchanged_updates", moved > 0 ? lost / moved : 0.0);
    }
    sinks.train(rec);
  });
}

StepWatch::StepWatch(TrainJob& job, StragglerMonitor* stragglers)
    : j_(job),
      stragglers_(stragglers),
      scheduled_([d = job.dist.get()] { return d->blocked_seconds_total(); }, &job.dist->links()),
      t_stall_line_(Clock::now() - std::chrono::hours(1)) {}

void StepWatch::begin() {
  t_step_ = Clock::now();
  j_.dist->take_blocked_seconds();  // from here: this step's
  scheduled_.take();
}

void StepWatch::end(int64_t step, const StepResult& r) {
  Distributed& d = *j_.dist;
  const JudgedStep judged = judged_step(seconds_since(t_step_), d.take_blocked_seconds(), scheduled_.take());
  const double step_s = judged.step_s;
  times_.push_back(step_s);
  if (times_.size() > 51) times_.pop_front();
  if (++seen_ >= 10) {
    std::vector<double> v(times_.begin(), times_.end());
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    d.set_step_seconds(median_step_ = v[v.size() / 2]);
  }
  // What the heartbeat saw during the step; time this process itself did not run (stopped,
  // starved) is no wait for the network or a peer, even where it fell inside a collective.
  const LinkWatch::Stall silent = d.links().take_stall();
  const double blocked_s = std::max(0.0, judged.blocked_s - silent.self_stopped_s);
  if (stragglers_) {
    StepPhases own;
    if (j_.device.is_cpu()) {  // the host's clock is the work's: each phase less its waits
      own.forward = std::max(0.0, r.times.forward - r.times.forward_wait);
      own.backward = std::max(0.0, r.times.backward - r.times.backward_wait);
      own.optimizer = std::max(0.0, r.times.optimizer - r.times.optimizer_wait);
    }
    stragglers_->add_step(step, step_s, r.data_wait_s, blocked_s, d.links().take_round_trips_ms(), own);
  }
  // Steps held up in collectives (a partition that heals, a link slowed to a trickle): one
  // line at most every 10 s, saying who fell silent meanwhile.
  if (is_stall(blocked_s, median_step_, !silent.empty()) && ++stalls_unreported_ && seconds_since(t_stall_line_) >= 10) {
    log_warn("network: step ", step, " waited ", format_sig(blocked_s), " s in collectives (the median step is ",
             format_sig(median_step_), " s)",
             stalls_unreported_ > 1 ? " (" + std::to_string(stalls_unreported_) + " such steps since the last line)" : "",
             ": ", describe_stall(silent, [&d](int rank) { return d.host_of(rank); }, d.store_host()));
    stalls_unreported_ = 0;
    t_stall_line_ = Clock::now();
  }
}

}  // namespace faceshard
