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
#include "app/train/checkpoint_policy.h"
#include "app/train/checkpoint_writer.h"
#include "app/train/device_readout.h"
#include "app/train/log_sinks.h"
#include "app/train/run_folder.h"
#include "app/train/run_lock.h"
#include "app/train/step_report.h"
#include "app/train/train_job.h"
#include "app/train/train_state.h"
#include "app/train/train_step.h"
#include "app/train/validation.h"
#include "data/set_identity.h"
#include "partial_fc/distributed/dist_env.h"
#include "base/error.h"
#include "base/log.h"
#include "partial_fc/distributed/straggler_monitor.h"
#include "partial_fc/distributed/link_watch.h"

namespace faceshard {
namespace {

std::atomic<int> g_stop_signal{0};
// EX_TEMPFAIL: the run is not finished; its agent should restart this rank.
constexpr int kStoppedForPeerRestart = 75;
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

// A run's start: its output folder claimed, the checkpoint it resumes chosen and the job built.
struct RunStart {
  std::unique_ptr<RunLock> lock;  // rank 0's, for the run's life
  std::string from;               // the checkpoint resumed ("" for a fresh start)
  bool walk_back = false;         // a corrupt newest checkpoint may be passed over for an older one
  std::optional<TrainJob> job;
};

RunStart open_run(const TrainRequest& req) {
  // Where a resume starts is known before the job is built: the classifier's rows are then
  // only allocated, and the checkpoint is read straight into them.
  const std::string& output = req.config.output;
  if (req.overwrite && req.resume)
    throw usage_error("--overwrite starts afresh and --resume continues: give one of them");
  RunStart r;
  // One run per output folder: rank 0 holds its lock (run_lock.h) from before anything is
  // read or written there to the run's end; the job's other ranks write there only after they
  // have joined rank 0. A live holder refuses this run, --resume and --overwrite included.
  if (DistEnv::from_environment().rank == 0) {
    r.lock = RunLock::acquire(output);
    if (const auto& dead = r.lock->taken_over())
      log_warn("output '", output, "': took over the stale lock of a run that is gone (", dead->describe(), "; ",
               r.lock->taken_over_reason(), ")");
  }
  r.from = !req.resume_from.empty() ? resolve_resume_source(req.resume_from)
           : req.resume           ? latest_checkpoint(output + "/checkpoints")
                                  : "";
  // A run folder or --resume auto may walk back past a newest checkpoint that does not
  // verify; a checkpoint named on its own is that one or none.
  r.walk_back = req.resume_from.empty() || r.from != req.resume_from;
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
      r.from.empty() ? std::nullopt : read_checkpoint_batch(r.from, r.walk_back);
  r.job.emplace(build_train_job(req.config, r.from.empty() ? ClassifierStart::Fresh : ClassifierStart::FromCheckpoint,
                                resumed_batch));
  TrainJob& j = *r.job;
  const Config& cfg = j.cfg;
  Distributed& d = *j.dist;
  if (d.rank() == 0) {
    std::filesystem::create_directories(cfg.output);
    set_log_file(cfg.output + "/training.log");
    write_text_durably(req.config_text, cfg.output + "/config.yaml");
    // Which data the run trains on (data/set_identity.h): faceshard-clean audits a run
    // against its own data only.
    const auto t_id = Clock::now();
    const SetIdentity data_set = set_identity(*j.dataset);
    write_text_durably(data_set.text() + "\n", cfg.output + "/data_set.txt");
    log_info("data set: ", data_set.brief(), " (identity in ", format_sig(seconds_since(t_id)), " s)");
  }
  d.barrier();
  // Each rank's record of its last collectives goes here when one hangs or fails, on
  // SIGUSR1 and at a fatal error (faceshard-dist-check --trace reads them).
  d.set_trace_dir(cfg.output + "/trace");
  // The checkpoint a resume starts from is read back first (its files shared out among the
  // ranks, CRC-32 of every entry): a corrupt or incomplete one is passed over for the newest
  // that verifies, in one line; none that verifies is an error, never a fresh start.
  if (!r.from.empty() && std::filesystem::exists(r.from + "/COMMITTED"))
    r.from = choose_verified_checkpoint(r.from, r.walk_back, d);
  return r;
}

// The run's start-up lines: the data and schedule, the model and classifier, the rates.
void log_run(const TrainJob& j) {
  const Config& cfg = j.cfg;
  const PartialFCOptions& o = j.fc->options();
  log_info("data: '", cfg.data.rec, "', ", j.dataset->size(), " images; ", j.steps_per_epoch, " steps/epoch, global batch ",
           j.global_batch(), "; schedule: ", j.total_steps, " steps, warm-up ", j.warmup_steps);
  log_info("model: ", cfg.model.backbone, " (", j.backbone_params.size(), " tensors in ", j.ddp->num_buckets(),
           " gradient buckets), classifier ", *cfg.data.num_classes, " classes x ", o.subcenters,
           o.subcenters == 1 ? " centre (loss.subcenters)" : " sub-centres (loss.subcenters)", ", ",
           j.fc->shard().count, " classes on this rank, ", j.fc->num_sample(), " per step (centres ",
           o.weight_dtype == at::kBFloat16 ? "bf16" : "fp32", ", logits ", o.streamed_logits ? "streamed" : "buffered",
           cfg.loss.logits == "auto" ? " by loss.logits auto" : "", "); head ", describe_margin_head(o.head, o.margin),
           "; precision ", cfg.train.precision);
  log_info(describe_learning_rates(cfg.optim));
}

// The batches of the run in order: an epoch is steps_per_epoch whole steps (micro-batches
// left over at its end are never read, so no gradient of them leaks into the next step).
BatchSource epoch_batches(TrainJob& j, TrainProgress& p) {
  const int64_t batches_per_epoch = j.steps_per_epoch * j.micro;
  j.loader->start_epoch(static_cast<uint64_t>(p.epoch), static_cast<uint64_t>(p.batch_in_epoch));
  return [&j, &p, batches_per_epoch]() -> Batch {
    if (p.batch_in_epoch == batches_per_epoch) {
      p.epoch++;
      p.batch_in_epoch = 0;
      j.loader->start_epoch(static_cast<uint64_t>(p.epoch), 0);
    }
    std::optional<Batch> b = j.loader->next();
    if (!b)
      throw runtime_error("data loader: epoch ", p.epoch, " ended after ", p.batch_in_epoch, " of ", batches_per_epoch,
                          " batches");
    p.batch_in_epoch++;
    return std::move(*b);
  };
}

// A stop asked for by a signal (to this rank or another): its checkpoint, one line, and the
// exit status.
int stop_run(const TrainRequest& req, TrainJob& j, const TrainProgress& p, CheckpointPolicy& policy,
             const CheckpointManager& checkpoints) {
  Distributed& d = *j.dist;
  const bool signalled_here = g_stop_signal.load() != 0;
  if (!policy.save_for_stop(signalled_here ? "signal" : "signal to another rank")) {
    d.shutdown();
    return kCheckpointsFailing;
  }
  log_info("stopped at step ", p.step, " of ", j.last_step, "; checkpoint ", checkpoints.latest(),
           policy.stop_step() != p.step ? " (of step " + std::to_string(policy.stop_step()) + ")" : "",
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

}  // namespace

int run_training(const TrainRequest& req) {
  RunStart start = open_run(req);
  TrainJob& j = *start.job;
  const std::string& from = start.from;
  const Config& cfg = j.cfg;
  Distributed& d = *j.dist;
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
  CheckpointPolicy policy(cfg, d, checkpoints, state, sinks);
  if (req.resume && from.empty()) log_info("--resume: no committed checkpoint under ", checkpoints.root(), ", starting fresh");
  if (!from.empty()) state.load(from);
  policy.set_writer(make_checkpoint_writer(j, state, checkpoints));
  install_writer_faults(req.faults, d.rank(), policy.writer());
  // (An explicit --resume DIR at its last step still saves at once: resharding a checkpoint.)
  if (!from.empty() && req.resume_from.empty() && p.step >= j.last_step) {
    // A scheduler reran a finished job: nothing to train; the export is written if the
    // run ended between its last checkpoint and the export.
    log_info("resume: the run already finished at step ", p.step, " of ", j.last_step, " (", from, "); nothing to do");
    if (!std::filesystem::exists(cfg.output + "/model.pt")) export_model(j, p.step);
    d.shutdown();
    return 0;
  }
  log_run(j);
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
  BatchSource next_batch = epoch_batches(j, p);
  j.backbone->train();
  // The starting point of the verification curve (chance for a fresh model).
  if (cfg.train.verify_every > 0 && p.step == 0 && j.last_step > 0) validation.run(0, p.best_accuracy, sinks);

  std::unique_ptr<StragglerMonitor> stragglers;
  if (d.world_size() > 1 && cfg.dist.straggler_window > 0)
    stragglers = std::make_unique<StragglerMonitor>(d.connect_side_store(std::chrono::seconds(5)), d.rank(),
                                                    d.world_size(), d.hosts(), cfg.dist.straggler_window);
  // On the CPU the phases are timed by the host's clock at no cost: a slow rank is named
  // with the phase it is slow in. (A GPU's phases would need a wait for the device.)
  if (stragglers && j.device.is_cpu()) train_step.set_timing(true);
  StepReport report(j, sinks, checkpoints, stragglers.get(), p.step);
  StepWatch watch(j, stragglers.get());
  int64_t skipped = 0;
  auto t_checkpoint = Clock::now();
  while (p.step < j.last_step) {
    watch.begin();
    StepResult r = train_step.run(next_batch, p.step);
    if (r.skipped) {
      skipped++;
      log_info("loss scaling: non-finite gradients at step ", p.step + 1, ", step skipped; loss scale now ",
               j.scaler->current_scale());
    }
    p.step++;
    if (j.device.is_cpu()) check_finite();  // free on the CPU: stop at the very step
    report.add(r, p, train_step);
    report.deliver(/*wait=*/false);
    if (cfg.train.verify_every > 0 && p.step % cfg.train.verify_every == 0 && p.step != j.last_step) {
      d.set_context(p.step, "validation");
      report.deliver(/*wait=*/true);  // the log line of the step comes before its verification
      const auto verifying = watch.scheduled().scope("verification");
      validation.run(p.step, p.best_accuracy, sinks);
    }
    const bool epoch_end = p.batch_in_epoch == j.steps_per_epoch * j.micro;
    bool want_checkpoint = cfg.train.checkpoint_every > 0 ? p.step % cfg.train.checkpoint_every == 0 : epoch_end;
    // SIGTERM/SIGINT on any rank, and a time-based checkpoint falling due on any rank's
    // clock: every rank learns both at the same step (one all-reduce of two flags).
    const bool due = cfg.train.checkpoint_every_s > 0 && seconds_since(t_checkpoint) >= cfg.train.checkpoint_every_s;
    at::Tensor flags = torch::tensor({static_cast<float>(g_stop_signal.load() != 0), static_cast<float>(due)});
    d.set_context(p.step, "step");
    d.all_reduce(flags, ReduceOp::Max);
    watch.end(p.step, r);
    const auto f = flags.accessor<float, 1>();
    want_checkpoint = want_checkpoint || f[1] > 0;
    if (f[0] > 0) {
      d.set_context(p.step, "checkpoint");
      report.deliver(/*wait=*/true);
      check_finite();
      return stop_run(req, j, p, policy, checkpoints);
    }
    if (want_checkpoint && p.step != j.last_step) {
      d.set_context(p.step, "checkpoint");
      const auto saving = watch.scheduled().scope("checkpoint");
      report.deliver(/*wait=*/true);
      check_finite();
      if (!policy.save(/*last=*/false)) {
        d.shutdown();
        return kCheckpointsFailing;
      }
      t_checkpoint = Clock::now();
    }
  }
  d.set_context(p.step, "finish");
  report.deliver(/*wait=*/true);
  check_finite();
  if (skipped) log_info("loss scaling: ", skipped, " steps skipped for non-finite gradients");
  validation.run(p.step, p.best_accuracy, sinks);
  if (!policy.save(/*last=*/true)) {
    d.shutdown();
    return kCheckpointsFailing;
  }
  export_model(j, p.step);
  d.shutdown();
  log_info("done: ", p.step, " steps in ", format_duration(seconds_since(report.started())));
  return 0;
}

}  // namespace faceshard
