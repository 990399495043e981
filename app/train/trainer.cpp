#include "app/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <optional>
#include <vector>
#include <csignal>
#include <filesystem>

#include "app/io/checkpoint.h"
#include "app/io/checkpoint_verify.h"
#include "app/train/checkpoint_writer.h"
#include "app/train/device_readout.h"
#include "app/train/log_sinks.h"
#include "app/train/run_folder.h"
#include "app/train/run_lock.h"
#include "app/train/train_job.h"
#include "app/train/train_state.h"
#include "app/train/train_step.h"
#include "app/train/validation.h"
#include "data/set_identity.h"
#include "partial_fc/runtime/dist_env.h"
#include "partial_fc/runtime/error.h"
#include "partial_fc/runtime/log.h"
#include "partial_fc/runtime/straggler_monitor.h"
#include "partial_fc/runtime/link_watch.h"

namespace faceshard {
namespace {

std::atomic<int> g_stop_signal{0};
// EX_TEMPFAIL: the run is not finished; its agent should restart this rank.
constexpr int kStoppedForPeerRestart = 75;
// Checkpoints could not be saved (train.max_failed_checkpoints in a row, or the last one).
constexpr int kCheckpointsFailing = 3;
// A second signal while the stop is under way is answered with one line (write(2) is
// async-signal-safe) and changes nothing: the stop's checkpoint is still written.
extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal.exchange(sig) == 0) return;
  static const char kAgain[] =
      "faceshard-train: a stop is already under way: the run exits once its checkpoint is written (the log says how "
      "far it is); SIGKILL ends it at once, without that checkpoint\n";
  ssize_t ignored = ::write(STDERR_FILENO, kAgain, sizeof kAgain - 1);
  (void)ignored;
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The median of the last 51 step times, once 10 are in (the first steps, with cuDNN's
// algorithm search and the caches filling, are not the run's pace).
class StepTimer {
 public:
  std::optional<double> add(double seconds) {
    times_.push_back(seconds);
    if (times_.size() > 51) times_.pop_front();
    if (++seen_ < 10) return std::nullopt;
    std::vector<double> v(times_.begin(), times_.end());
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  }

 private:
  std::deque<double> times_;
  int64_t seen_ = 0;
};

}  // namespace

int run_training(const TrainRequest& req) {
  // Where a resume starts is known before the job is built: the classifier's rows are then
  // only allocated, and the checkpoint is read straight into them.
  const std::string& output = req.config.output;
  if (req.overwrite && req.resume)
    throw usage_error("--overwrite starts afresh and --resume continues: give one of them");
  // One run per output folder: rank 0 holds its lock (run_lock.h) from before anything is
  // read or written there to the run's end; the job's other ranks write there only after they
  // have joined rank 0. A live holder refuses this run, --resume and --overwrite included.
  std::unique_ptr<RunLock> run_lock;
  if (DistEnv::from_environment().rank == 0) {
    run_lock = RunLock::acquire(output);
    if (const auto& dead = run_lock->taken_over())
      log_warn("output '", output, "': took over the stale lock of a run that is gone (", dead->describe(), "; ",
               run_lock->taken_over_reason(), ")");
  }
  std::string from = !req.resume_from.empty() ? resolve_resume_source(req.resume_from)
                     : req.resume           ? latest_checkpoint(output + "/checkpoints")
                                            : "";
  // A run folder or --resume auto may walk back past a newest checkpoint that does not
  // verify; a checkpoint named on its own is that one or none.
  const bool walk_back = req.resume_from.empty() || from != req.resume_from;
  // Runs never mix: a fresh run into a folder holding a run is refused before anything is
  // built or written. (--resume with no checkpoint yet is the same run restarted: it starts
  // fresh in its own folder; --resume DIR continues the checkpoint it names.)
  if (!req.resume) check_output_free_for_fresh_run(output, req.overwrite);
  if (req.overwrite && DistEnv::from_environment().rank == 0) {
    const std::vector<std::string> moved = run_files_in(output);
    const std::string aside = move_previous_run_aside(output);
    if (!aside.empty()) log_info("--overwrite: the previous run's files (", moved.size(), ") moved into ", aside);
  }
  // A resume keeps its checkpoint's global batch on any number of ranks (train_job.h).
  const std::optional<CheckpointBatch> resumed_batch =
      from.empty() ? std::nullopt : read_checkpoint_batch(from, walk_back);
  TrainJob j = build_train_job(req.config, from.empty() ? ClassifierStart::Fresh : ClassifierStart::FromCheckpoint,
                               resumed_batch);
  const Config& cfg = j.cfg;
  Distributed& d = *j.dist;
  if (d.rank() == 0) {
    std::filesystem::create_directories(cfg.output);
    set_log_file(cfg.output + "/training.log");
    write_text_durably(req.config_text, cfg.output + "/config.yaml");
    // Which data the run trains on (data/set_identity.h): faceshard-clean audits a run
    // against its own data only.
    const auto t_id = std::chrono::steady_clock::now();
    const SetIdentity data_set = set_identity(*j.dataset);
    write_text_durably(data_set.text() + "\n", cfg.output + "/data_set.txt");
    log_info("data set: ", data_set.brief(), " (identity in ",
             format_sig(std::chrono::duration<double>(std::chrono::steady_clock::now() - t_id).count()), " s)");
  }
  d.barrier();
  // Each rank's record of its last collectives goes here when one hangs or fails, on
  // SIGUSR1 and at a fatal error (faceshard-dist-check --trace reads them).
  d.set_trace_dir(cfg.output + "/trace");
  // The checkpoint a resume starts from is read back first (its files shared out among the
  // ranks, CRC-32 of every entry): a corrupt or incomplete one is passed over for the newest
  // that verifies, in one line; none that verifies is an error, never a fresh start.
  if (!from.empty() && std::filesystem::exists(from + "/COMMITTED")) from = choose_verified_checkpoint(from, walk_back, d);
  CheckpointManager checkpoints(cfg.output + "/checkpoints", d, cfg.train.keep_checkpoints);
  TrainState state(j);
  TrainProgress& p = state.progress();
  TrainStep train_step(j);
  install_faults(req.faults, d.rank(), checkpoints, train_step, j.backbone_params);
  LogSinks sinks;
  if (d.rank() == 0) {
    sinks.add(std::make_unique<ConsoleSink>(isatty(STDOUT_FILENO)));
    sinks.add(std::make_unique<MetricsSink>(cfg.output + "/metrics.jsonl", req.resume || !req.resume_from.empty()));
    if (cfg.train.tensorboard) sinks.add(std::make_unique<TensorBoardSink>(cfg.output + "/tensorboard"));
  }
  Validation validation(j);
  // A checkpoint that cannot be saved (a full disk, a quota, an I/O error on any rank) costs
  // nothing committed: one warning, training goes on, the next interval tries again. After
  // train.max_failed_checkpoints in a row, or when the run's last checkpoint (its end, a
  // stop) fails, the run stops: one line, exit status kCheckpointsFailing.
  // With train.checkpoint_async a save's outcome is known when the next save starts or the
  // run ends (checkpoint_writer.h): the policy is applied to it then, at the same step on every rank.
  std::unique_ptr<CheckpointWriter> writer;
  auto settle = [&](const CheckpointOutcome& o, bool last) -> bool {
    // How long the training stopped for it beside how long the write took (metrics.jsonl).
    sinks.checkpoint(CheckpointRecord{o.step, o.wait_s, o.stage_s, o.previous_s, o.write_s, o.bytes, o.background,
                                      o.committed});
    if (o.committed) return true;
    const std::string latest = checkpoints.latest();
    const std::string kept = latest.empty() ? "no checkpoint is committed yet"
                                            : "the last committed checkpoint, " + latest + ", is untouched";
    const int64_t n = checkpoints.failed_in_a_row();
    if (last || n >= cfg.train.max_failed_checkpoints) {
      if (d.rank() == 0)
        report_fatal("faceshard-train", detail::concat(n, " checkpoint save", n > 1 ? "s" : "", " failed in a row (",
                                                       last ? "the run's last one" : "train.max_failed_checkpoints " +
                                                       std::to_string(cfg.train.max_failed_checkpoints), "), the last at step ",
                                                       o.step, ": ", o.problem, "; ", kept));
      return false;
    }
    if (n == 1)
      log_warn("checkpoint step ", o.step, " not saved: ", o.problem, "; ", kept,
               "; training goes on and the next checkpoint tries again (the run stops after ",
               cfg.train.max_failed_checkpoints, " failures in a row)");
    return true;
  };
  auto save_checkpoint = [&](bool last) -> bool {
    if (std::optional<CheckpointOutcome> o = writer->save(state, last)) {
      const bool this_one = o->step == p.step && !writer->background();
      if (!settle(*o, last && this_one)) return false;
    }
    // The run's last checkpoint (its end, a stop) is waited for before the process exits.
    if (last)
      if (std::optional<CheckpointOutcome> o = writer->finish())
        if (!settle(*o, true)) return false;
    return true;
  };
  // A stop's checkpoint. Where a checkpoint of an earlier step is still being written in the
  // background, that one is the stop's: the resume redoes the steps since (they took less
  // time than that write has so far), instead of the stop writing a second checkpoint after
  // it (twice the stop's time: what a scheduler's grace period may not allow). Where it
  // fails, the stop's own step is written.
  int64_t stop_checkpoint_step = -1;  // the step of the stop's checkpoint
  // Whether the background write of step `q` is still going on on any rank (collective: the
  // same answer everywhere, so that every rank takes the same checkpoint).
  auto writing_anywhere = [&](const std::optional<int64_t>& q) {
    if (!q) return false;
    at::Tensor w = torch::tensor({static_cast<float>(writer->still_writing())});
    if (d.world_size() > 1) d.all_reduce(w, ReduceOp::Max);
    return w.item<float>() > 0;
  };
  auto stop_checkpoint = [&](const std::string& who) -> bool {
    stop_checkpoint_step = p.step;
    // A write already over everywhere costs the stop nothing to wait for: the stop's own
    // step is written (one write), as with no write in flight.
    if (const std::optional<int64_t> q = writer->in_flight_step(); q && *q < p.step && writing_anywhere(q)) {
      log_info("stop requested (", who, ") at step ", p.step, ": the checkpoint of step ", *q,
               ", being written in the background, is the stop's checkpoint (the resume redoes steps ", *q + 1, "-",
               p.step, " rather than the stop writing a second checkpoint after it)");
      if (std::optional<CheckpointOutcome> o = writer->finish()) {
        if (!settle(*o, /*last=*/false)) return false;
        if (o->committed) {
          stop_checkpoint_step = *q;
          return true;
        }
        log_warn("stop: the checkpoint of step ", *q, " was not saved (", o->problem, "): checkpointing step ", p.step,
                 " instead");
      }
    } else {
      log_info("stop requested (", who, "): checkpointing at step ", p.step, " and exiting");
    }
    return save_checkpoint(/*last=*/true);
  };
  if (req.resume && from.empty()) log_info("--resume: no committed checkpoint under ", checkpoints.root(), ", starting fresh");
  if (!from.empty()) state.load(from);
  writer = make_checkpoint_writer(j, state, checkpoints);
  install_writer_faults(req.faults, d.rank(), *writer);
  // (An explicit --resume DIR at its last step still saves at once: resharding a checkpoint.)
  if (!from.empty() && req.resume_from.empty() && p.step >= j.last_step) {
    // A scheduler reran a finished job: nothing to train; the export is written if the
    // run ended between its last checkpoint and the export.
    log_info("resume: the run already finished at step ", p.step, " of ", j.last_step, " (", from, "); nothing to do");
    if (!std::filesystem::exists(cfg.output + "/model.pt")) export_model(j, p.step);
    d.shutdown();
    return 0;
  }
  log_info("data: '", cfg.data.rec, "', ", j.dataset->size(), " images; ", j.steps_per_epoch, " steps/epoch, global batch ",
           j.global_batch(), "; schedule: ", j.total_steps, " steps, warm-up ", j.warmup_steps);
  log_info("model: ", cfg.model.backbone, " (", j.backbone_params.size(), " tensors in ", j.ddp->num_buckets(),
           " gradient buckets), classifier ", *cfg.data.num_classes, " classes x ", j.fc->options().subcenters,
           j.fc->options().subcenters == 1 ? " centre (loss.subcenters)" : " sub-centres (loss.subcenters)", ", ",
           j.fc->shard().count, " classes on this rank, ",
           j.fc->num_sample(), " per step (centres ", j.fc->options().weight_dtype == at::kBFloat16 ? "bf16" : "fp32",
           ", logits ", j.fc->options().streamed_logits ? "streamed" : "buffered",
           cfg.loss.logits == "auto" ? " by loss.logits auto" : "", "); head ",
           describe_margin_head(j.fc->options().head, j.fc->options().margin), "; precision ", cfg.train.precision);
  log_info(describe_learning_rates(cfg.optim));
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);

  // A non-finite loss stops the run (with loss scaling the step is skipped instead); the
  // check reads the device, so a GPU run does it where it syncs anyway.
  auto check_finite = [&] {
    if (j.loss_scaling) return;
    if (auto bad = train_step.first_nonfinite_step()) {
      const std::string last = checkpoints.latest();
      throw runtime_error("the loss became NaN/inf at step ", *bad + 1, "; stopping. Last good checkpoint: ",
                          last.empty() ? "none" : last);
    }
  };
  // An epoch is steps_per_epoch whole steps: micro-batches left over at its end are never
  // read, so no gradient of them leaks into the next step.
  const int64_t batches_per_epoch = j.steps_per_epoch * j.micro;
  j.loader->start_epoch(static_cast<uint64_t>(p.epoch), static_cast<uint64_t>(p.batch_in_epoch));
  BatchSource next_batch = [&]() -> Batch {
    if (p.batch_in_epoch == batches_per_epoch) {
      p.epoch++;
      p.batch_in_epoch = 0;
      j.loader->start_epoch(static_cast<uint64_t>(p.epoch), 0);
    }
    std::optional<Batch> b = j.loader->next();
    if (!b) throw runtime_error("data loader: epoch ", p.epoch, " ended after ", p.batch_in_epoch, " of ", batches_per_epoch, " batches");
    p.batch_in_epoch++;
    return std::move(*b);
  };
  j.backbone->train();
  // The starting point of the verification curve (chance for a fresh model).
  if (cfg.train.verify_every > 0 && p.step == 0 && j.last_step > 0) validation.run(0, p.best_accuracy, sinks);

  at::Tensor loss_sum = torch::zeros({}, torch::TensorOptions().device(j.device)), acc_sum = torch::zeros_like(loss_sum);
  DeviceReadout readout;
  int64_t logged = 0, skipped = 0;
  const int64_t start_step = p.step;
  auto t_start = Clock::now(), t_log = Clock::now(), t_checkpoint = Clock::now();
  // The median step time scales the hang detection (Distributed::hang_limit).
  StepTimer step_timer;
  std::unique_ptr<StragglerMonitor> stragglers;
  if (d.world_size() > 1 && cfg.dist.straggler_window > 0)
    stragglers = std::make_unique<StragglerMonitor>(d.connect_side_store(std::chrono::seconds(5)), d.rank(),
                                                    d.world_size(), d.hosts(), cfg.dist.straggler_window);
  // On the CPU the phases are timed by the host's clock at no cost: a slow rank is named
  // with the phase it is slow in. (A GPU's phases would need a wait for the device.)
  if (stragglers && j.device.is_cpu()) train_step.set_timing(true);
  // Steps held up in collectives (a partition that heals, a link slowed to a trickle): one
  // line at most every 10 s, saying who fell silent meanwhile.
  double median_step = 0;
  int64_t stalls_unreported = 0;
  auto t_stall_line = Clock::now() - std::chrono::hours(1);
  // Verification and checkpoints are scheduled work that other ranks wait for: left out of
  // the stall line and the straggler windows (link_watch.h).
  ScheduledWork scheduled([&d] { return d.blocked_seconds_total(); }, &d.links());
  while (p.step < j.last_step) {
    const auto t_step = Clock::now();
    d.take_blocked_seconds();  // from here: this step's
    scheduled.take();
    StepResult r = train_step.run(next_batch, p.step);
    loss_sum.add_(r.loss);
    acc_sum.add_(r.accuracy);
    if (r.skipped) {
      skipped++;
      log_info("loss scaling: non-finite gradients at step ", p.step + 1, ", step skipped; loss scale now ",
               j.scaler->current_scale());
    }
    p.step++;
    logged++;
    if (j.device.is_cpu()) check_finite();  // free on the CPU: stop at the very step
    const bool log_now = p.step % cfg.train.log_every == 0 || p.step == j.last_step;
    if (!log_now) sinks.progress(p.step, j.last_step);
    if (log_now) {
      TrainRecord rec;
      rec.step = p.step;
      rec.last_step = j.last_step;
      rec.epoch = p.epoch;
      rec.lr = r.lr;
      rec.fc_lr = r.fc_lr;
      rec.samples_per_sec = logged * j.global_batch() / std::max(seconds_since(t_log), 1e-9);
      rec.eta_s = seconds_since(t_start) / std::max<int64_t>(1, p.step - start_step) * (j.last_step - p.step);
      if (j.loss_scaling) rec.loss_scale = j.scaler->current_scale();
      rec.memory_gb = device_peak_memory_gb(j.device);
      if (stragglers)
        for (const StragglerReport& s : stragglers->take_reports()) {
          if (s.phase == "link") {
            log_warn("slow link: host ", s.host, " (rank ", s.rank, ") <-> host ", d.store_host(),
                     " (the store's): heartbeat round trips ", format_sig(s.median_s * 1000), " ms (90th percentile) against ",
                     format_sig(s.fastest_s * 1000), " ms (the fastest rank's median) in steps ", s.first_step, "-", s.last_step);
            rec.head_state.emplace_back("slow_link/" + std::to_string(s.rank), s.median_s * 1000);
            continue;
          }
          log_warn("straggler: rank ", s.rank, " (host ", s.host, ") is slow in ", s.phase, ": ", format_sig(s.score, 2),
                   " of the fastest rank's pace (median ", format_sig(s.median_s), " s against ", format_sig(s.fastest_s),
                   " s a step) in steps ", s.first_step, "-", s.last_step);
          rec.head_state.emplace_back("straggler/" + std::to_string(s.rank), s.score);
        }
      // The device's values of the record are read a step or two later (no host sync).
      std::vector<at::Tensor> values{loss_sum, acc_sum, train_step.first_nonfinite_marker()};
      std::vector<std::string> names;
      for (const auto& kv : j.fc->head().state()) {
        names.push_back("head/" + j.fc->head().name() + "/" + kv.first);
        values.push_back(kv.second);
      }
      // bf16 centres: the share of this rank's moved values whose stored bf16 stayed the same.
      const at::Tensor lost = j.fc->take_lost_update_counts();
      if (lost.defined()) {
        values.push_back(lost[0]);
        values.push_back(lost[1]);
      }
      readout.post(values, [&sinks, &checkpoints, rec, names, n = logged, counted = lost.defined(),
                            scaling = j.loss_scaling](const std::vector<double>& v) mutable {
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
      loss_sum.zero_();
      acc_sum.zero_();
      logged = 0;
      t_log = Clock::now();
    }
    readout.deliver(/*wait=*/false);
    if (cfg.train.verify_every > 0 && p.step % cfg.train.verify_every == 0 && p.step != j.last_step) {
      d.set_context(p.step, "validation");
      readout.deliver(/*wait=*/true);  // the log line of the step comes before its verification
      const auto verifying = scheduled.scope("verification");
      validation.run(p.step, p.best_accuracy, sinks);
    }
    const bool epoch_end = p.batch_in_epoch == batches_per_epoch;
    bool want_checkpoint = cfg.train.checkpoint_every > 0 ? p.step % cfg.train.checkpoint_every == 0 : epoch_end;
    // SIGTERM/SIGINT on any rank, and a time-based checkpoint falling due on any rank's
    // clock: every rank learns both at the same step (one all-reduce of two flags).
    const bool due = cfg.train.checkpoint_every_s > 0 && seconds_since(t_checkpoint) >= cfg.train.checkpoint_every_s;
    at::Tensor flags = torch::tensor({static_cast<float>(g_stop_signal.load() != 0), static_cast<float>(due)});
    d.set_context(p.step, "step");
    d.all_reduce(flags, ReduceOp::Max);
    const JudgedStep judged = judged_step(seconds_since(t_step), d.take_blocked_seconds(), scheduled.take());
    const double step_s = judged.step_s;
    if (const std::optional<double> median = step_timer.add(step_s)) d.set_step_seconds(median_step = *median);
    // What the heartbeat saw during the step; time this process itself did not run (stopped,
    // starved) is no wait for the network or a peer, even where it fell inside a collective.
    const LinkWatch::Stall silent = d.links().take_stall();
    const double blocked_s = std::max(0.0, judged.blocked_s - silent.self_stopped_s);
    if (stragglers) {
      StepPhases own;
      if (j.device.is_cpu()) {  // the host's clock is the work's: each phase less its waits
        own.forward = std::max(0.0, r.times.forward - r.times.forward_wait);
        own.backward = std::max(0.0, r.times.backward - r.times.backward_wait);
        own.optimizer = std::max(0.0, r.times.optimizer - r.times.optimizer_wait);
      }
      stragglers->add_step(p.step, step_s, r.data_wait_s, blocked_s, d.links().take_round_trips_ms(), own);
    }
    if (is_stall(blocked_s, median_step, !silent.empty()) && ++stalls_unreported && seconds_since(t_stall_line) >= 10) {
      log_warn("network: step ", p.step, " waited ", format_sig(blocked_s), " s in collectives (the median step is ",
               format_sig(median_step), " s)",
               stalls_unreported > 1 ? " (" + std::to_string(stalls_unreported) + " such steps since the last line)" : "",
               ": ", describe_stall(silent, [&d](int rank) { return d.host_of(rank); }, d.store_host()));
      stalls_unreported = 0;
      t_stall_line = Clock::now();
    }
    const auto f = flags.accessor<float, 1>();
    want_checkpoint = want_checkpoint || f[1] > 0;
    if (f[0] > 0) {
      d.set_context(p.step, "checkpoint");
      readout.deliver(/*wait=*/true);
      check_finite();
      const bool signalled_here = g_stop_signal.load() != 0;
      const std::string who = signalled_here ? "signal" : "signal to another rank";
      if (!stop_checkpoint(who)) {
        d.shutdown();
        return kCheckpointsFailing;
      }
      log_info("stopped at step ", p.step, " of ", j.last_step, "; checkpoint ", checkpoints.latest(),
               stop_checkpoint_step != p.step ? " (of step " + std::to_string(stop_checkpoint_step) + ")" : "",
               req.overwrite ? "; to continue, run the same command with --resume in place of --overwrite (which would "
                               "move this run aside and start afresh)"
                             : "; to continue, run the same command with --resume");
      d.shutdown();
      // Under torchrun's elastic agent, a signal to a host's workers is its agent restarting
      // them (a host joined or left). A rank that stops only because another host's agent did
      // exits non-zero, so that its own agent restarts it into the new round too, instead of
      // taking the run for finished and leaving the job (its agent counts one restart).
      // (torchrun's variables, with or without its agent's store: TORCH_DISABLE_SHARE_RDZV_TCP_STORE
      // makes rank 0 host the workers' store, and the agent restarts its workers all the same.)
      if (!signalled_here && d.env().source == "torchrun") {
        log_info("stopped for another host's restart: exit status ", kStoppedForPeerRestart,
                 " so that this host's torchrun agent restarts its workers too");
        return kStoppedForPeerRestart;
      }
      return 0;
    }
    if (want_checkpoint && p.step != j.last_step) {
      d.set_context(p.step, "checkpoint");
      const auto saving = scheduled.scope("checkpoint");
      readout.deliver(/*wait=*/true);
      check_finite();
      if (!save_checkpoint(/*last=*/false)) {
        d.shutdown();
        return kCheckpointsFailing;
      }
      t_checkpoint = Clock::now();
    }
  }
  d.set_context(p.step, "finish");
  readout.deliver(/*wait=*/true);
  check_finite();
  if (skipped) log_info("loss scaling: ", skipped, " steps skipped for non-finite gradients");
  validation.run(p.step, p.best_accuracy, sinks);
  if (!save_checkpoint(/*last=*/true)) {
    d.shutdown();
    return kCheckpointsFailing;
  }
  export_model(j, p.step);
  d.shutdown();
  log_info("done: ", p.step, " steps in ", format_duration(seconds_since(t_start)));
  return 0;
}

}  // namespace faceshard
