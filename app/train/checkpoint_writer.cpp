#include "app/train/checkpoint_writer.h"

#ifdef FACESHARD_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <random>
#include <sstream>

#include "app/io/store_agreement.h"
#include "app/train/train_job.h"
#include "base/error.h"
#include "base/log.h"

namespace faceshard {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double tensor_bytes(const at::Tensor& t) {
  return t.defined() ? static_cast<double>(t.numel()) * static_cast<double>(t.element_size()) : 0.0;
}

}  // namespace

std::optional<CheckpointOutcome> SyncCheckpointWriter::save(const TrainState& state, bool /*last*/) {
  CheckpointOutcome o;
  o.step = state.progress().step;
  const auto t0 = Clock::now();
  o.committed = state.save(checkpoints_);
  o.wait_s = o.write_s = seconds_since(t0);
  o.problem = o.committed ? "" : checkpoints_.last_problem();
  o.bytes = o.committed ? checkpoints_.last_bytes() : 0;
  return o;
}

double pinned_block_bytes(double bytes) {
  if (bytes <= 0) return 0;
  double block = 1;
  while (block < bytes) block *= 2;
  return block;
}

double staging_bytes(const CheckpointContents& c, int rank) {
  double b = 0;
  for (const StateDict* sd : {&c.backbone, &c.train_state, &c.shard})
    if (rank == 0 || sd == &c.shard)
      for (const auto& kv : *sd)
        // A GPU tensor's buffer is pinned host memory, which LibTorch's caching host allocator
        // hands out in blocks of powers of two: what the host gives up is the block.
        b += kv.second.defined() && kv.second.is_cuda() ? pinned_block_bytes(tensor_bytes(kv.second))
                                                         : tensor_bytes(kv.second);
  return b;
}

struct StagingBuffers::Device {
#ifdef FACESHARD_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> side;      // one for the buffers' life
  std::optional<c10::cuda::CUDAStream> training;
  at::cuda::CUDAEvent copied;
  bool started = false;  // this checkpoint's copies have begun (the side stream waits for the training's work)
#endif
};

namespace {

// The staging buffer of `t` under `key`, (re)allocated where missing or where its shape or
// type changed: host memory, pinned for a GPU's tensor (an asynchronous copy needs it).
at::Tensor& staging_buffer(std::map<std::string, at::Tensor>& buffers, const std::string& key, const at::Tensor& t,
                           bool* allocated = nullptr) {
  at::Tensor& buf = buffers[key];
  const bool fresh = !buf.defined() || buf.sizes() != t.sizes() || buf.scalar_type() != t.scalar_type();
  if (fresh) buf = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(t.is_cuda()));
  if (allocated) *allocated = fresh;
  return buf;
}

}  // namespace

void StagingBuffers::reserve(const StateDict& live, const std::string& file) {
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : live) {
    if (!t.defined()) continue;
    bool fresh = false;
    at::Tensor& buf = staging_buffer(buffers_, file + "/" + name, t, &fresh);
    // Written once now, so that its pages are mapped before the first checkpoint's copy.
    if (fresh) buf.zero_();
  }
}

StateDict StagingBuffers::stage(const StateDict& live, const std::string& file,
                                const std::function<bool(const std::string& name, const at::Tensor&)>& later,
                                std::vector<std::pair<at::Tensor, at::Tensor>>* deferred) {
  at::NoGradGuard no_grad;
  StateDict out;
  out.reserve(live.size());
  for (const auto& [name, t] : live) {
    if (!t.defined()) {
      out.emplace_back(name, t);
      continue;
    }
    at::Tensor& buf = staging_buffer(buffers_, file + "/" + name, t);
    if (later && deferred && later(name, t)) {
      deferred->emplace_back(t, buf);
      out.emplace_back(name, buf);
      continue;
    }
#ifdef FACESHARD_WITH_CUDA
    if (t.is_cuda()) {
      // The copy runs on a side stream that first waits for the training stream's work so
      // far (the step that produced these values), so the host never waits here.
      if (!device_) device_ = std::make_shared<Device>();
      if (!device_->started) {
        device_->training = c10::cuda::getCurrentCUDAStream(t.device().index());
        // One side stream for the buffers' life, and never the training stream itself:
        // LibTorch's pool hands out its streams in turn, and the training stream is one of
        // them (a stream taken per checkpoint would be it once every 32 checkpoints, and the
        // copy would no longer overlap the training).
        for (int i = 0; i < 64 && (!device_->side || *device_->side == *device_->training); ++i)
          device_->side = c10::cuda::getStreamFromPool(false, t.device().index());
        at::cuda::CUDAEvent produced;
        produced.record(*device_->training);
        produced.block(*device_->side);
        device_->started = true;
      }
      c10::cuda::CUDAStreamGuard guard(*device_->side);
      // The source's memory stays allocated until the side stream is done with it.
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *device_->side);
      buf.copy_(t, /*non_blocking=*/true);
      out.emplace_back(name, buf);
      continue;
    }
#endif
    buf.copy_(t);
    out.emplace_back(name, buf);
  }
  return out;
}

void StagingBuffers::fence() {
#ifdef FACESHARD_WITH_CUDA
  if (device_ && device_->started) {
    device_->copied.record(*device_->side);
    // The training stream's next kernel (the next optimiser step among them) starts only once
    // the copies have read what it would change; the host goes on at once.
    device_->copied.block(*device_->training);
    device_->started = false;  // the next checkpoint waits for the training stream afresh
  }
#endif
}

void StagingBuffers::ready() {
#ifdef FACESHARD_WITH_CUDA
  if (device_) device_->copied.synchronize();
#endif
}

double StagingBuffers::bytes() const {
  double b = 0;
  for (const auto& kv : buffers_) b += tensor_bytes(kv.second);
  return b;
}

AsyncCheckpointWriter::AsyncCheckpointWriter(CheckpointManager& checkpoints, int rank, int world_size,
                                             c10::intrusive_ptr<c10d::Store> store, std::string run_id,
                                             std::chrono::milliseconds timeout)
    : checkpoints_(checkpoints), rank_(rank), world_(world_size), store_(std::move(store)), run_id_(std::move(run_id)),
      timeout_(timeout) {}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  if (thread_.joinable()) {
    // Only a run ending on an error gets here with a save in flight: its ranks' agreement
    // stops waiting for the others, and the save is given up (nothing of it is committed).
    abort_ = true;
    thread_.join();
  }
  if (fc_) fc_->set_before_rows_change(nullptr);
}

void AsyncCheckpointWriter::copy_rows_on_write(PartialFC& fc) {
  fc_ = &fc;
  fc.set_before_rows_change(
      [this](int64_t first, int64_t count, const at::Tensor& index) { rows_.before_change(first, count, index); });
}

double AsyncCheckpointWriter::reserve(const CheckpointContents& contents) {
  const auto t0 = Clock::now();
  if (rank_ == 0) {
    staging_.reserve(contents.backbone, "backbone");
    staging_.reserve(contents.train_state, "train_state");
  }
  staging_.reserve(contents.shard, "shard");
  return seconds_since(t0);
}

std::optional<CheckpointOutcome> AsyncCheckpointWriter::save(const TrainState& state, bool last) {
  // train.checkpoint_when_busy skip: while the previous write is in flight on any rank, this
  // checkpoint is not taken (the same answer on every rank: one collective at this step).
  if (all_done_ && !last && thread_.joinable() && !all_done_(written_.load())) {
    log_info("checkpoint step ", state.progress().step, " skipped: the one of step ", in_flight_.step,
             " is still being written in the background (train.checkpoint_when_busy skip); the next interval tries again");
    return std::nullopt;
  }
  const auto t0 = Clock::now();
  // One save in flight: the previous one is finished first (its outcome goes back to the
  // trainer, which applies the failure policy to it at this step on every rank).
  std::optional<CheckpointOutcome> previous = finish();
  const double previous_s = seconds_since(t0);
  // Staging: the copies are taken here, before the next optimiser step can change anything.
  const auto t_stage = Clock::now();
  const CheckpointContents live = state.contents();
  auto staged = std::make_shared<CheckpointContents>();
  staged->step = live.step;
  staged->num_classes = live.num_classes;
  // Only rank 0 writes the backbone and the train state (checkpoint.h): the others stage their shard.
  if (rank_ == 0) {
    staged->backbone = staging_.stage(live.backbone, "backbone");
    staged->train_state = staging_.stage(live.train_state, "train_state");
  }
  // The classifier's rows on the CPU: copied by the writer, or by the training before it
  // changes them (copy_rows_on_write); the rest of the shard now.
  std::vector<std::pair<at::Tensor, at::Tensor>> on_write;
  const int64_t rows = fc_ ? fc_->state().front().second.size(0) : 0;
  staged->shard = staging_.stage(
      live.shard, "shard",
      [&](const std::string& name, const at::Tensor& t) {
        return fc_ && name.rfind("rows/", 0) == 0 && RowStaging::stageable(t, rows);
      },
      &on_write);
  if (!on_write.empty()) rows_.begin(std::move(on_write), rows);
  staging_.fence();
  in_flight_ = CheckpointOutcome{};
  in_flight_.step = live.step;
  written_ = false;
  in_flight_.background = true;
  in_flight_.stage_s = seconds_since(t_stage);
  in_flight_.previous_s = previous_s;
  in_flight_.wait_s = seconds_since(t0);
  staged_at_ = Clock::now();
  const double later = rows_.active() ? rows_.bytes() : 0.0;
  log_info("checkpoint step ", live.step, ": the training waited ", format_sig(in_flight_.wait_s), " s (staging ",
           format_bytes(staging_.bytes() - later), " in ", format_sig(in_flight_.stage_s), " s, ", format_sig(previous_s),
           " s for the previous write", later > 0 ? ", the classifier's " + format_bytes(later) + " copied on write" : "",
           "); written in the background");
  thread_ = std::thread([this, staged] {
    CheckpointOutcome& o = in_flight_;
    const auto t_write = Clock::now();
    try {
      if (before_write_) before_write_(staged->step);
      // The classifier rows not copied yet (the training copies those it changes first).
      if (!rows_.complete(&abort_)) throw runtime_error("the run ended before its staging was complete");
      // The training's own copies are part of its wait for this checkpoint.
      o.rows_on_write = rows_.rows_copied_by_training();
      o.wait_s += rows_.training_seconds();
      o.stage_s += rows_.training_seconds();
      staging_.ready();
      StoreAgreement agreement(store_, "faceshard/ckpt/" + run_id_ + "/" + std::to_string(staged->step), rank_, world_,
                               timeout_, &abort_);
      agreement.set_hang_judge(judge_);
      if (before_stage_) agreement.set_before_stage([this, step = staged->step](int stage) { before_stage_(step, stage); });
      o.committed = checkpoints_.save(staged->step, staged->num_classes, staged->backbone, staged->train_state,
                                      staged->shard, agreement);
      o.problem = o.committed ? "" : checkpoints_.last_problem();
      o.bytes = o.committed ? checkpoints_.last_bytes() : 0;
      if (o.committed)
        log_info("checkpoint saved: ", checkpoints_.root(), " step ", staged->step, " (in the background",
                 o.rows_on_write > 0 ? "; the training copied " + std::to_string(o.rows_on_write) +
                                           " classifier rows itself before changing them, in " +
                                           format_sig(rows_.training_seconds()) + " s"
                                     : std::string(),
                 ")");
    } catch (const std::exception& e) {
      o.committed = false;
      o.problem = "rank " + std::to_string(rank_) + ": " + one_line(e);
    }
    o.write_s = seconds_since(t_write);
    if (after_write_) after_write_(staged->step);
    {
      std::lock_guard<std::mutex> lock(written_mutex_);
      written_ = true;
    }
    written_cv_.notify_all();
  });
  return previous;
}

std::optional<CheckpointOutcome> AsyncCheckpointWriter::finish() {
  if (!thread_.joinable()) return std::nullopt;
  if (before_wait_) before_wait_();
  if (!written_.load()) {
    const auto t0 = Clock::now();
    const int64_t step = in_flight_.step;
    log_info("waiting for the checkpoint of step ", step, ", written in the background since ",
             format_sig(seconds_since(staged_at_)), " s (", format_bytes(staging_.bytes()), " on this rank)");
    std::unique_lock<std::mutex> lock(written_mutex_);
    while (!written_cv_.wait_for(lock, std::chrono::seconds(10), [this] { return written_.load(); }))
      log_info("still waiting for the checkpoint of step ", step, ": ", format_sig(seconds_since(t0)), " s so far");
    lock.unlock();
    log_info("the checkpoint of step ", step, " is written: the training waited ", format_sig(seconds_since(t0)),
             " s for it");
  }
  thread_.join();
  return in_flight_;
}

std::unique_ptr<CheckpointWriter> make_checkpoint_writer(const TrainJob& job, const TrainState& state,
                                                         CheckpointManager& checkpoints) {
  Distributed& d = *job.dist;
  const std::string& choice = job.cfg.train.checkpoint_async;
  double per_rank = staging_bytes(state.contents(), d.rank());
  // The backbone optimiser's state at its largest, for every parameter: a fresh run has none
  // before its first step, and a frozen part gets its momentum only at the thaw
  // (optim.freeze_backbone_steps), after this decision (SGD's momentum: one fp32 value a
  // parameter; AdamW's moments: two).
  if (d.rank() == 0) {
    double params = 0, held = 0;
    for (const at::Tensor& t : job.backbone_params) params += tensor_bytes(t);
    for (const auto& kv : job.opt->state()) held += tensor_bytes(kv.second);
    const double full = params * (job.cfg.optim.optimizer == "adamw" ? 2.0 : job.cfg.optim.momentum != 0 ? 1.0 : 0.0);
    per_rank += std::max(0.0, full - held);
  }
  const int local = std::max(1, d.env().local_world_size);
  const double per_host = per_rank * local;
  const std::optional<AvailableMemory> avail = device_available_memory(torch::kCPU);
  const double limit = avail ? (choice == "on" ? 1.0 : 0.5) * avail->bytes : 0.0;
  bool fits = choice != "off" && avail && per_host <= limit;
  // Every rank the same: one host short of memory makes the whole job synchronous.
  at::Tensor all = torch::tensor({static_cast<float>(fits)});
  if (d.world_size() > 1) d.all_reduce(all, ReduceOp::Min);
  const bool background = all.item<float>() > 0;
  std::ostringstream why;
  why << "train.checkpoint_async " << choice;
  if (choice != "off") {
    why << ": staging " << format_bytes(per_rank) << " a rank, " << format_bytes(per_host) << " for this host's " << local
        << " rank" << (local > 1 ? "s" : "");
    if (!avail)
      why << ", the host's available memory unknown";
    else
      why << (fits ? ", within " : ", more than ") << (choice == "on" ? "the " : "half the ")
          << format_bytes(avail->bytes) << " available (" << avail->what << ")";
    if (fits && !background) why << "; another host's ranks cannot hold theirs";
  }
  if (!background) {
    log_info("checkpoints: synchronous (", why.str(), ")");
    return std::make_unique<SyncCheckpointWriter>(checkpoints);
  }
  log_info("checkpoints: written in the background (", why.str(), ")");
  // The run's id, rank 0's, names its keys in the store: a store that outlives a restart
  // (an elastic agent's) never mixes two runs' saves.
  at::Tensor id = torch::tensor({static_cast<int64_t>(std::random_device{}() & 0x7fffffff)}, torch::kLong);
  if (d.world_size() > 1) d.broadcast(id, 0);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(std::max(600.0, job.cfg.dist.timeout_s) * 1000));
  // Each store operation fails after the collectives' timeout (5-60 s): a frozen store host
  // must not hold the writer (and a run that ends on an error, which waits for it) for the
  // whole agreement's time; the agreement waits for slow peers in slices of its own.
  const auto op_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(std::clamp(job.cfg.dist.timeout_s, 5.0, 60.0) * 1000));
  c10::intrusive_ptr<c10d::Store> store = d.world_size() > 1 ? d.connect_side_store(op_timeout) : nullptr;
  auto writer = std::make_unique<AsyncCheckpointWriter>(checkpoints, d.rank(), d.world_size(), std::move(store),
                                                        std::to_string(id.item<int64_t>()), timeout);
  if (d.world_size() > 1) writer->set_before_wait([&d] { d.barrier(); });
  if (d.world_size() > 1)
    writer->set_hang_judge({[&d] { return d.hang_limit(); },
                            [&d](const std::vector<int>& missing, int64_t since_ms) { return d.silent_peer(missing, since_ms); },
                            [] { return Distributed::clock_ms(); }});
  if (job.cfg.train.checkpoint_when_busy == "skip")
    writer->skip_when_busy([&d](bool mine) {
      if (d.world_size() == 1) return mine;
      at::Tensor done = torch::tensor({static_cast<float>(mine)});
      d.all_reduce(done, ReduceOp::Min);
      return done.item<float>() > 0;
    });
  // On the CPU the classifier's rows are copied on write: the step does not wait for them.
  if (job.device.is_cpu()) writer->copy_rows_on_write(*job.fc);
  // The staging buffers now, not at the first checkpoint's step (the plan counted them).
  const double reserve_s = writer->reserve(state.contents());
  log_info("checkpoint staging buffers: ", format_bytes(per_rank), " on this rank, allocated in ", format_sig(reserve_s),
           " s");
  return writer;
}

}  // namespace faceshard
