// Checkpoints of a training run: <output>/checkpoints/step_<N>/ holds backbone.pt and
// train_state.pt (rank 0) and fc_shard_<r>.pt (every rank: its classifier rows with their
// optimiser state). Each file is written to a temporary name, flushed and renamed; the
// checkpoint counts only once rank 0 writes COMMITTED after every rank has finished, so a
// crash during a save leaves the previous checkpoint usable. Loading reads each value
// straight into its destination (models/torch_save/state_dict_reader.h); with a different number of
// ranks the classifier rows are resharded by class range (resharded_rows.h).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "models/torch_save/state_dict_io.h"
#include "models/torch_save/state_dict_reader.h"
#include "partial_fc/distributed/distributed.h"

namespace faceshard {

struct CheckpointInfo {
  std::string path;  // the step directory
  int64_t step = 0;
  int64_t world_size = 0;
  int64_t num_classes = 0;
};

// How the ranks of a save agree at each of its stages: every rank gives its problem ("" for
// none) and gets the same verdict back (rank 0's unless empty, else the first other rank's).
// A save at a checkpoint step agrees over the training's collectives; a save written in the
// background agrees through the rendezvous store (app/io/store_agreement.h), never over the
// training's process group, so that it cannot interleave with a training collective.
class SaveAgreement {
 public:
  // The stages of CheckpointManager::save, in order: the folder made, every rank's files
  // written and read back, rank 0's COMMITTED marker written (then a barrier).
  static constexpr int kFolderStage = 0, kFilesStage = 1, kCommitStage = 2;
  virtual ~SaveAgreement() = default;
  virtual std::string agree(const std::string& mine) = 0;
  // Every rank has reached this point.
  virtual void barrier() { agree(""); }
};

// The training's collectives (agree_on_problem, Distributed::barrier).
class CollectiveAgreement : public SaveAgreement {
 public:
  explicit CollectiveAgreement(Distributed& dist) : dist_(dist) {}
  std::string agree(const std::string& mine) override;
  void barrier() override;

 private:
  Distributed& dist_;
};

class CheckpointManager {
 public:
  CheckpointManager(std::string root, Distributed& dist, int64_t keep);

  // Collective: every rank calls it with its shard; rank 0's backbone/train_state are the
  // ones written. Shard files carry "rows.start" and "rows.count"; tensors whose first
  // dimension equals rows.count and whose name starts with "rows/" are per-class rows.
  // Each rank reads its files back (CRC-32 of every entry) before rank 0 commits. A save
  // that fails on any rank (a full disk, a quota, an I/O error, a read-back that does not
  // match) is given up by every rank at the same point: nothing of it stays, the previous
  // committed checkpoint is untouched, and it returns false (last_problem() says why).
  bool save(int64_t step, int64_t num_classes, const StateDict& backbone, const StateDict& train_state,
            const StateDict& shard);
  // The same protocol (temporary files, fsync, rename, read-back, COMMITTED by rank 0 only
  // once every rank's part verified), its stages agreed through `agreement`: what a save
  // written by a background thread calls (every rank's thread, with the same step).
  bool save(int64_t step, int64_t num_classes, const StateDict& backbone, const StateDict& train_state,
            const StateDict& shard, SaveAgreement& agreement);
  // This rank's bytes and seconds (fsync and read-back included) of the last save that committed.
  double last_bytes() const { return last_bytes_; }
  double last_write_seconds() const { return last_write_s_; }
  // Saves that failed since the last one that committed, and the last one's reason.
  int64_t failed_in_a_row() const { return failed_in_a_row_; }
  const std::string& last_problem() const { return last_problem_; }

  // The newest committed checkpoint under root ("" when none).
  std::string latest() const;
  const std::string& root() const { return root_; }

  // Called by save() on every rank after its shard's temporary file is written and before
  // the rename: where fault-injection tests kill a rank mid-save.
  void set_mid_save_hook(std::function<void(int64_t step)> hook) { mid_save_hook_ = std::move(hook); }

 private:
  void prune(const std::string& keep_from) const;
  std::string root_;
  Distributed& dist_;
  int64_t keep_;
  std::function<void(int64_t)> mid_save_hook_;
  int64_t failed_in_a_row_ = 0;
  std::string last_problem_;
  double last_bytes_ = 0, last_write_s_ = 0;
};

// The newest committed checkpoint (step folder) under root, "" when none; folders with an
// unreadable marker are passed over.
std::string latest_checkpoint(const std::string& root);

// Reads the COMMITTED marker of a step directory (usage error when it is missing or not a
// faceshard checkpoint).
CheckpointInfo read_checkpoint_info(const std::string& dir);

// One file of a checkpoint ("backbone.pt", "train_state.pt", "fc_shard_<r>.pt"), opened
// for reading (its directory and pickle; no value is read yet). Usage error when missing.
StateDictReader open_checkpoint_file(const CheckpointInfo& ckpt, const std::string& name);

// A one-value entry of a checkpoint file: usage error naming the file and key when it is
// missing or is not one value (of an integer type for read_checkpoint_int).
int64_t read_checkpoint_int(const TensorSource& file, const std::string& key, const std::string& source);
double read_checkpoint_double(const TensorSource& file, const std::string& key, const std::string& source);

// Checks values read from a checkpoint's entry `key` of `source` (a file): every value of
// a floating tensor finite, and with non_negative every value >= 0 (integer tensors are
// only checked for that). Usage error naming the file, the key, the first bad value and
// its index (with first_row >= 0, a tensor of classifier rows: class first_row + r). Reads the tensor in
// chunks (no copy of its size, on any device).
void check_checkpoint_values(const at::Tensor& values, const std::string& source, const std::string& key,
                             bool non_negative = false, int64_t first_row = -1);

// Writes `weights` to path atomically: temporary file, fsync, rename, fsync of the folder
// that holds it (parent_folder: "." for a bare file name).
void write_state_dict_durably(const StateDict& weights, const std::string& path);
void write_text_durably(const std::string& text, const std::string& path);

// The folder a file lives in, as the file system resolves it: "emb.npy" and "./emb.npy" are in
// ".", "/data/emb.npy" is in "/data", "/emb.npy" in "/". (std::filesystem's parent_path()
// of a bare name is empty, which no system call takes for the current folder.)
std::string parent_folder(const std::string& path);

}  // namespace faceshard
