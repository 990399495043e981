#include "app/io/resharded_rows.h"

#include <algorithm>
#include <filesystem>

#include "partial_fc/classifier/class_shard.h"
#include "base/error.h"

namespace faceshard {

namespace {

const std::string kRows = "rows/";

std::string shape_str(c10::IntArrayRef s) {
  std::string out = "[";
  for (size_t k = 0; k < s.size(); ++k) out += (k ? "," : "") + std::to_string(s[k]);
  return out + "]";
}

}  // namespace

ReshardedRows::ReshardedRows(const CheckpointInfo& ckpt, int64_t start, int64_t count, int64_t subcenters)
    : ckpt_path_(ckpt.path), count_(count), subcenters_(subcenters) {
  if (start < 0 || count < 0 || start + count > ckpt.num_classes)
    throw usage_error("checkpoint '", ckpt.path, "' has ", ckpt.num_classes, " classes; classes [", start, ", ",
                      start + count, ") are not among them");
  for (const ClassShard& saved : ClassShard::all(ckpt.num_classes, static_cast<int>(ckpt.world_size))) {
    const int64_t lo = std::max(start, saved.start), hi = std::min(start + count, saved.end());
    if (hi <= lo) continue;
    Part part;
    part.file = ckpt.path + "/fc_shard_" + std::to_string(saved.rank) + ".pt";
    if (!std::filesystem::exists(part.file))
      throw usage_error("checkpoint '", ckpt.path, "' has no fc_shard_", saved.rank, ".pt (saved on ", ckpt.world_size,
                        " ranks)");
    part.reader = std::make_unique<StateDictReader>(part.file);
    const StateDictReader& f = *part.reader;
    const int64_t s = read_checkpoint_int(f, "rows.start", part.file);
    const int64_t c = read_checkpoint_int(f, "rows.count", part.file);
    if (s != saved.start || c != saved.count)
      throw usage_error(part.file, ": holds classes [", s, ", ", s + c, "), expected [", saved.start, ", ", saved.end(),
                        ") (rank ", saved.rank, " of ", ckpt.world_size, " with ", ckpt.num_classes, " classes)");
    // Rows per class: K sub-centres, the same in every file and (unless the reader takes the
    // saved one) the reader's.
    const int64_t K = f.find("rows.subcenters") == TensorSource::npos ? 1 : read_checkpoint_int(f, "rows.subcenters", part.file);
    if (K < 1) throw usage_error(part.file, ": 'rows.subcenters' is ", K, ", expected at least 1");
    if (subcenters_ == 0) subcenters_ = K;
    if (K != subcenters_)
      throw usage_error("checkpoint '", ckpt.path, "' was saved with loss.subcenters ", K, " (", part.file, "), this run has ",
                        subcenters_, ": the classifier's centres cannot be resumed with another number per class");
    std::vector<std::string> names;
    for (size_t i = 0; i < f.size(); ++i) {
      const std::string& key = f.name(i);
      if (key.compare(0, kRows.size(), kRows) != 0) continue;
      const std::vector<int64_t> sizes = f.sizes(i);
      if (sizes.empty() || sizes[0] != c * K)
        throw usage_error(part.file, ": '", key, "' has ", sizes.empty() ? 0 : sizes[0], " rows, expected ", c * K,
                          K > 1 ? " (" + std::to_string(c) + " classes x " + std::to_string(K) + " sub-centres)" : "");
      names.push_back(key.substr(kRows.size()));
    }
    if (parts_.empty()) {
      names_ = names;
    } else if (names != names_) {
      throw usage_error(part.file, ": its classifier entries differ from those of ", parts_.front().file);
    }
    part.saved_start = saved.start;
    // In rows: a class's K sub-centres are contiguous, so a class range is one row range.
    part.first_row = (lo - saved.start) * K;
    part.dst_row = (lo - start) * K;
    part.rows = (hi - lo) * K;
    parts_.push_back(std::move(part));
  }
}

bool ReshardedRows::has(const std::string& name) const {
  return std::find(names_.begin(), names_.end(), name) != names_.end();
}

at::ScalarType ReshardedRows::dtype(const std::string& name) const {
  if (!has(name) || parts_.empty())
    throw usage_error("checkpoint '", ckpt_path_, "' has no classifier state '", kRows, name, "'");
  const StateDictReader& f = *parts_.front().reader;
  return f.dtype(f.find(kRows + name));
}

void ReshardedRows::read_into(const std::string& name, const at::Tensor& dst, bool non_negative) const {
  if (!has(name))
    throw usage_error("checkpoint '", ckpt_path_, "' has no classifier state '", kRows, name, "'");
  if (dst.dim() < 1 || dst.size(0) != count_ * subcenters_)
    throw usage_error("checkpoint '", ckpt_path_, "': '", kRows, name, "' is read into ", count_ * subcenters_, " rows, got a tensor of shape ",
                      shape_str(dst.sizes()));
  for (const Part& part : parts_) {
    const StateDictReader& f = *part.reader;
    const size_t i = f.find(kRows + name);
    const std::vector<int64_t> sizes = f.sizes(i);
    if (!std::equal(sizes.begin() + 1, sizes.end(), dst.sizes().begin() + 1, dst.sizes().end()))
      throw usage_error(part.file, ": '", kRows, name, "' has rows of shape ",
                        shape_str(c10::IntArrayRef(sizes).slice(1)), ", this run's classifier has ",
                        shape_str(dst.sizes().slice(1)));
    const at::ScalarType saved = f.dtype(i);
    const bool floating = at::isFloatingType(saved), integer = at::isIntegralType(saved, /*includeBool=*/false);
    if (dst.is_floating_point() ? !floating : !integer)
      throw usage_error(part.file, ": key '", kRows, name, "' is ", saved, ", expected ",
                        dst.is_floating_point() ? "floating-point" : "integer", " rows");
    const at::Tensor rows = dst.narrow(0, part.dst_row, part.rows);
    f.read_rows_into(i, part.first_row, rows);
    check_checkpoint_values(rows, part.file, kRows + name, non_negative, part.saved_start * subcenters_ + part.first_row);
  }
}

}  // namespace faceshard
