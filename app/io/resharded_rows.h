// A checkpoint's classifier rows for the classes one rank owns, read straight into that
// rank's own tensors, on any number of ranks. The saved shards hold classes [0, C) in the
// ranges ClassShard gives the saved number of ranks; only the files whose range overlaps
// the rank's are opened, and of each only the bytes of the overlapping rows are read (a
// contiguous run of rows is one byte range of its storage), so resuming costs the shard's
// own memory and each byte of the checkpoint is read by one rank once. What is checked:
// every file's rows.start and rows.count against the saved layout, every rows/ entry's row
// count and row shape, the same entries in every file, and the byte range of every read
// against its zip entry and the file. A rank that reads a whole storage (a resume on the
// saved number of ranks) has its CRC-32 checked as it streams; a rank that reads part of
// one cannot check the entry's CRC, only those bounds.
// Sub-centres (loss.subcenters K): a shard file's rows/ entries hold rows.count x K rows,
// class-major (class c's sub-centre k at row (c - rows.start) x K + k), and the file says
// K in "rows.subcenters" (absent: 1, as written before sub-centres); classes move with all
// their K rows, and a checkpoint saved with another K than the run's is a usage error.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "app/io/checkpoint.h"
#include "models/torch_save/state_dict_reader.h"

namespace faceshard {

class ReshardedRows {
 public:
  // Opens the saved shards that hold classes of [start, start + count). Usage errors name
  // the checkpoint or the file and key. `subcenters`: the reader's K (rows per class), which
  // every saved shard must have; 0 takes the checkpoint's (subcenters() then says it).
  ReshardedRows(const CheckpointInfo& ckpt, int64_t start, int64_t count, int64_t subcenters = 1);
  // Rows per class of the saved shards.
  int64_t subcenters() const { return subcenters_; }

  // The per-class entries ("rows/<name>") of the saved shards, by name without "rows/"
  // ("weight", "opt.momentum", ...), in the files' order.
  const std::vector<std::string>& names() const { return names_; }
  bool has(const std::string& name) const;
  // The dtype rows/<name> was saved in (that of the first saved shard read; has(name) first).
  // read_into converts to the destination's dtype: an optimiser state saved in bf16 resumes
  // into an fp32 one and the other way round (optim.fc_state_dtype may change on resume).
  at::ScalarType dtype(const std::string& name) const;
  // Classes [start, start + count) of rows/<name> into dst ([count x K, ...] of the saved row
  // shape; any dtype and device). Usage error when the checkpoint lacks the entry, its
  // rows have another shape or another kind of number (floating-point rows for a
  // floating-point dst, integers for an integer one), or a value read is not finite (or,
  // with non_negative, below 0): naming the file, the key and the class.
  void read_into(const std::string& name, const at::Tensor& dst, bool non_negative = false) const;

 private:
  struct Part {
    std::string file;
    std::unique_ptr<StateDictReader> reader;
    int64_t saved_start = 0;  // the saved shard's first class
    int64_t first_row = 0;    // in the saved shard
    int64_t dst_row = 0;    // in this rank's shard
    int64_t rows = 0;
  };
  std::string ckpt_path_;
  int64_t count_ = 0;
  int64_t subcenters_ = 1;
  std::vector<Part> parts_;
  std::vector<std::string> names_;
};

}  // namespace faceshard
