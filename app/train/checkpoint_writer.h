// How the trainer saves a checkpoint. SyncCheckpointWriter: every rank stops while its part
// is written (CheckpointManager::save over the training's collectives). AsyncCheckpointWriter
// (train.checkpoint_async): at the checkpoint step each rank copies what it saves into staging
// buffers (host memory kept across checkpoints, pinned for a GPU's tensors, copied on a side
// stream that the training stream waits for before its next kernel), then one background
// thread writes them with the same protocol (temporary files, fsync, rename, read-back,
// COMMITTED once every rank's part verified), the ranks agreeing through the rendezvous store
// (store_agreement.h), never over the training's process group. One save is in flight at a
// time: the next one waits for it. Outcomes are taken at the same step on every rank (the
// next save, or finish()), so that every rank applies the failure policy at the same point.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "app/io/checkpoint.h"
#include "app/io/store_agreement.h"
#include "app/train/row_staging.h"
#include "partial_fc/classifier/partial_fc.h"
#include "app/train/train_state.h"

namespace faceshard {

// One checkpoint as the training saw it.
struct CheckpointOutcome {
  int64_t step = 0;
  bool committed = false;
  std::string problem;     // why not, when not committed
  double wait_s = 0;       // the training's stop at the step: staging plus the wait for the previous write
  double stage_s = 0;      // of which the copy into staging buffers
  double previous_s = 0;   // of which the wait for the previous save still being written
  double write_s = 0;      // this rank's write (fsync and read-back included; the sync save's whole time)
  double bytes = 0;        // this rank's bytes written
  bool background = false;
  int64_t rows_on_write = 0;  // classifier rows the training copied itself before changing them (row_staging.h)
};

class CheckpointWriter {
 public:
  virtual ~CheckpointWriter() = default;
  // Saves the state as it is now (collective: every rank at the same step). Returns the
  // outcome of a save that ended during the call: this one (synchronous), or the previous one
  // that was still being written (asynchronous); nothing when none did. `last`: the run's
  // last checkpoint (its end, a stop), never skipped.
  virtual std::optional<CheckpointOutcome> save(const TrainState& state, bool last = false) = 0;
  // Waits for the save in flight (at the run's end, at a stop); its outcome, nothing when none.
  virtual std::optional<CheckpointOutcome> finish() = 0;
  virtual bool background() const = 0;
  // The step of the last save written in the background and not yet taken back (finish() or
  // the next save), nothing when none: the same on every rank (saves are taken at the same
  // steps everywhere).
  virtual std::optional<int64_t> in_flight_step() const { return std::nullopt; }
  // Whether that save's write is still going on on this rank (it may be done on another).
  virtual bool still_writing() const { return false; }
};

class SyncCheckpointWriter : public CheckpointWriter {
 public:
  explicit SyncCheckpointWriter(CheckpointManager& checkpoints) : checkpoints_(checkpoints) {}
  std::optional<CheckpointOutcome> save(const TrainState& state, bool last = false) override;
  std::optional<CheckpointOutcome> finish() override { return std::nullopt; }
  bool background() const override { return false; }

 private:
  CheckpointManager& checkpoints_;
};

// Host copies of a checkpoint's tensors, kept from one checkpoint to the next (allocated
// again only where an entry's shape or type changed).
class StagingBuffers {
 public:
  // `live`'s entries copied into the buffers of `file`; on a GPU the copies are queued on
  // a side stream (ready() waits for them). Entries for which `later` says so are not
  // copied: each (live tensor, its buffer) is added to `deferred` instead (row_staging.h).
  StateDict stage(const StateDict& live, const std::string& file,
                  const std::function<bool(const std::string& name, const at::Tensor&)>& later = nullptr,
                  std::vector<std::pair<at::Tensor, at::Tensor>>* deferred = nullptr);
  // Allocates (and first touches) the buffers `live` will be staged into, so that the first
  // checkpoint does not pay for the allocation and the page faults at its step.
  void reserve(const StateDict& live, const std::string& file);
  // Blocks until the copies queued by stage() are done (from any thread).
  void ready();
  // Called after the last stage() of a checkpoint: on a GPU, the training stream waits (on
  // the device, not the host) for the copies before its next kernel can change what they read.
  void fence();
  double bytes() const;

 private:
  std::map<std::string, at::Tensor> buffers_;
  struct Device;
  std::shared_ptr<Device> device_;  // the side stream and its event (GPU only)
};

// The bytes one checkpoint of `c` stages on `rank` (what its StagingBuffers take from the
// host): rank 0 the backbone, the train state and its shard; the others their shard; a GPU
// tensor's buffer counted as its pinned block (pinned_block_bytes).
double staging_bytes(const CheckpointContents& c, int rank);
// The host memory a pinned buffer of `bytes` takes: LibTorch's caching host allocator gives
// blocks of the next power of two.
double pinned_block_bytes(double bytes);

class AsyncCheckpointWriter : public CheckpointWriter {
 public:
  // `store`: a connection of its own to the rendezvous store (unused with one rank);
  // `run_id`: the same on every rank, unique to this run; `timeout`: how long a stage of the
  // save waits for the other ranks, and finish() for the write.
  AsyncCheckpointWriter(CheckpointManager& checkpoints, int rank, int world_size, c10::intrusive_ptr<c10d::Store> store,
                        std::string run_id, std::chrono::milliseconds timeout);
  ~AsyncCheckpointWriter() override;
  std::optional<CheckpointOutcome> save(const TrainState& state, bool last = false) override;
  // While the write is still going on, one line says what the training waits for, and one
  // line every 10 s how long it has waited so far.
  std::optional<CheckpointOutcome> finish() override;
  bool background() const override { return true; }
  std::optional<int64_t> in_flight_step() const override {
    return thread_.joinable() ? std::optional<int64_t>(in_flight_.step) : std::nullopt;
  }
  bool still_writing() const override { return thread_.joinable() && !written_.load(); }

  // Allocates the staging buffers for `contents`' tensors (this rank's part) now, at the
  // run's start, instead of at the first checkpoint step. Returns the seconds it took.
  double reserve(const CheckpointContents& contents);
  // train.checkpoint_when_busy skip: a checkpoint due while the previous write is still in
  // flight is skipped. `all_done(mine)` tells whether every rank's previous write is done
  // (collective, at the same step on every rank: the same answer everywhere).
  void skip_when_busy(std::function<bool(bool)> all_done) { all_done_ = std::move(all_done); }
  // A classifier shard on the CPU: its rows are staged copy-on-write (row_staging.h) instead
  // of copied at the checkpoint's step: the writer copies them in the background, and `fc`
  // has the training copy the rows it is about to change first. Uninstalled with the writer.
  void copy_rows_on_write(PartialFC& fc);

  // Called on the background thread before it writes a checkpoint: where tests hold the
  // write back until the training has taken its next step.
  void set_before_write_hook(std::function<void(int64_t step)> hook) { before_write_ = std::move(hook); }
  // Called on the background thread after the write (committed or not), before the write
  // counts as done: where tests keep one rank's write in flight after the others' are done.
  void set_after_write_hook(std::function<void(int64_t step)> hook) { after_write_ = std::move(hook); }
  // The ranks' agreement on each stage of a background save waits for a dead or frozen
  // peer no longer than the training's hang detection would (store_agreement.h).
  void set_hang_judge(AgreementHangJudge judge) { judge_ = std::move(judge); }
  // Called on the background thread before this rank reports a stage of the agreement of
  // `step`'s save (stage index from 0): where fault tests freeze a rank inside it.
  void set_before_agreement_stage(std::function<void(int64_t step, int stage)> hook) { before_stage_ = std::move(hook); }
  // Called by finish() (every rank at the same point) before it waits for the write in
  // flight: a collective of the training's (a barrier) whose hang detection ends the run when
  // a peer is frozen or gone, instead of the wait lasting the agreement's whole timeout (the
  // store, on rank 0's host, may be the one frozen).
  void set_before_wait(std::function<void()> check) { before_wait_ = std::move(check); }

 private:
  CheckpointManager& checkpoints_;
  int rank_, world_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string run_id_;
  std::chrono::milliseconds timeout_;
  StagingBuffers staging_;
  RowStaging rows_;
  PartialFC* fc_ = nullptr;  // copy_rows_on_write's
  std::thread thread_;
  CheckpointOutcome in_flight_;  // the thread's, read after it is joined (its step: set before the thread starts)
  std::function<void(int64_t)> before_write_, after_write_;
  AgreementHangJudge judge_;
  std::function<void(int64_t, int)> before_stage_;
  std::function<void()> before_wait_;
  std::function<bool(bool)> all_done_;
  std::atomic<bool> abort_{false};
  std::atomic<bool> written_{false};  // the thread's write is over (committed or not)
  std::mutex written_mutex_;
  std::condition_variable written_cv_;  // notified when written_ turns true
  std::chrono::steady_clock::time_point staged_at_;  // when the save in flight was staged
};

// The writer train.checkpoint_async picks for this job, the same on every rank (collective:
// one all-reduce at the start), with one line saying which and why. auto: in the background
// where this host's ranks' staging (local_world_size x this rank's) fits in half the host's
// available memory; on: in the background wherever that staging fits in the available
// memory at all; off (or not enough memory): synchronous.
std::unique_ptr<CheckpointWriter> make_checkpoint_writer(const TrainJob& job, const TrainState& state,
                                                         CheckpointManager& checkpoints);

}  // namespace faceshard
