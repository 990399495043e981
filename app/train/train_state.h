// Everything a resume needs, saved and restored in one place. A checkpoint
// (<output>/checkpoints/step_<N>/, see app/io/checkpoint.h) holds:
//   backbone.pt     the backbone's state_dict (insightface names)
//   train_state.pt  step, world_size, data.epoch and data.epoch_samples (the data position
//                   in global samples), data.global_batch, data.batch_size and
//                   optim.grad_accumulation (the batch a resume keeps), schedule.total_steps,
//                   schedule.warmup_steps and schedule.lr (the learning rate of the next
//                   step: what a changed batch changes), opt/* (the backbone optimiser), scaler/* (the loss
//                   scaler), best/<set> (best verification accuracies)
//   fc_shard_<r>.pt this rank's classifier rows: rows.start, rows.count, rows.subcenters (K,
//                   loss.subcenters), rows/weight and rows/opt.* (its optimiser state; rows.count
//                   x K rows, class-major: row (c - rows.start) x K + k), rng.cpu (and rng.cuda)
// Loading reads each value straight into the job's own tensors (no copy of a file, no host
// buffer of a shard's size on a GPU); on another number of ranks rows/* are resharded by
// class range, each rank reading only its rows' bytes; the data continues in the same
// epoch at the same fraction of it.
#pragma once
#include <map>
#include <optional>
#include <string>

#include "app/io/checkpoint.h"
#include "app/train/train_job.h"

namespace faceshard {

struct TrainProgress {
  int64_t step = 0;            // optimiser steps done
  int64_t epoch = 0;           // the loader's epoch
  int64_t batch_in_epoch = 0;  // micro-batches this rank consumed in that epoch
  std::map<std::string, double> best_accuracy;  // per verification set
};

// What a checkpoint of the state holds, as the three files' entries (rank 0's backbone and
// train state, this rank's shard). Its tensors are the live ones: a copy of them taken before
// the next step (checkpoint_writer.h) can be written while training goes on.
struct CheckpointContents {
  int64_t step = 0, num_classes = 0;
  StateDict backbone, train_state, shard;
};

class TrainState {
 public:
  explicit TrainState(TrainJob& job) : job_(job) {}

  TrainProgress& progress() { return progress_; }
  const TrainProgress& progress() const { return progress_; }

  // Collective: every rank writes its shard, rank 0 the rest.
  // False when the save failed on some rank (nothing of it stays; checkpoints.last_problem()).
  bool save(CheckpointManager& checkpoints) const;
  // The entries save() writes, taken now.
  CheckpointContents contents() const;
  // Restores everything from a committed checkpoint folder (errors name its files).
  void load(const std::string& dir);

 private:
  TrainJob& job_;
  TrainProgress progress_;
};

// The batch the checkpoint `dir` (a committed step folder) was trained with; with walk_back,
// the newest older committed checkpoint beside it that records one when `dir` does not or
// cannot be read (a resume may walk back to it). Nothing when none records it (checkpoints
// written before the batch was saved: the config's batch is then used). Reads a few scalars
// only; a checkpoint's problems are reported when it is verified and loaded.
std::optional<CheckpointBatch> read_checkpoint_batch(const std::string& dir, bool walk_back);

// The run's final backbone on rank 0: <output>/model.pt (a state_dict Python's torch.load
// reads) and model.json (network, embedding size, input convention, step, precision).
void export_model(const TrainJob& job, int64_t step);

}  // namespace faceshard
