#include "app/io/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "partial_fc/runtime/error.h"
#include "partial_fc/runtime/log.h"

namespace fs = std::filesystem;

namespace faceshard {
namespace {

const char* kMarker = "COMMITTED";

std::string step_dir(const std::string& root, int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%08lld", static_cast<long long>(step));
  return root + "/" + buf;
}

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void durable_rename(const std::string& tmp, const std::string& path) {
  fsync_path(tmp, false);
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw runtime_error("cannot rename '", tmp, "' to '", path, "'");
  fsync_path(fs::path(path).parent_path().string(), true);
}

}  // namespace

void write_state_dict_durably(const StateDict& weights, const std::string& path) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  write_state_dict(weights, tmp);
  durable_rename(tmp, path);
}

void write_text_durably(const std::string& text, const std::string& path) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary);
    f << text;
    if (!f) throw runtime_error("cannot write '", tmp, "'");
  }
  durable_rename(tmp, path);
}

const at::Tensor& state_get(const StateDict& sd, const std::string& key, const std::string& source) {
  for (const auto& kv : sd)
    if (kv.first == key) return kv.second;
  throw usage_error(source, ": key '", key, "' is missing (not a faceshard checkpoint, or a different version)");
}

CheckpointManager::CheckpointManager(std::string root, Distributed& dist, int64_t keep)
    : root_(std::move(root)), dist_(dist), keep_(std::max<int64_t>(1, keep)) {}

void CheckpointManager::save(int64_t step, int64_t num_classes, const StateDict& backbone,
                             const StateDict& train_state, const StateDict& shard) {
  const std::string dir = step_dir(root_, step);
  if (dist_.rank() == 0) {
    std::error_code ec;
    fs::remove_all(dir, ec);  // an uncommitted leftover of a crashed save
    fs::create_directories(dir, ec);
    if (ec) throw runtime_error("cannot create checkpoint folder '", dir, "': ", ec.message());
  }
  dist_.barrier();
  if (dist_.rank() == 0) {
    write_state_dict_durably(backbone, dir + "/backbone.pt");
    write_state_dict_durably(train_state, dir + "/train_state.pt");
  }
  const std::string shard_path = dir + "/fc_shard_" + std::to_string(dist_.rank()) + ".pt";
  const std::string tmp = shard_path + ".tmp." + std::to_string(::getpid());
  write_state_dict(shard, tmp);
  if (mid_save_hook_) mid_save_hook_(step);
  durable_rename(tmp, shard_path);
  // Only when every rank has its files in place does the checkpoint exist.
  dist_.barrier();
  if (dist_.rank() == 0) {
    std::ostringstream os;
    os << "step " << step << "\nworld_size " << dist_.world_size() << "\nnum_classes " << num_classes << "\n";
    write_text_durably(os.str(), dir + "/" + kMarker);
    prune(dir);
  }
  dist_.barrier();
}

std::string CheckpointManager::latest() const { return latest_checkpoint(root_); }

std::string latest_checkpoint(const std::string& root) {
  std::string best;
  int64_t best_step = -1;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return "";
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (!e.is_directory() || !fs::exists(e.path() / kMarker)) continue;
    try {
      auto info = read_checkpoint_info(e.path().string());
      if (info.step > best_step) {
        best_step = info.step;
        best = e.path().string();
      }
    } catch (const Error&) {
    }
  }
  return best;
}

void CheckpointManager::prune(const std::string& newest) const {
  std::vector<std::pair<int64_t, std::string>> committed;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    if (!e.is_directory() || e.path().filename().string().rfind("step_", 0) != 0) continue;
    if (fs::exists(e.path() / kMarker)) {
      committed.emplace_back(read_checkpoint_info(e.path().string()).step, e.path().string());
    } else if (e.path().string() != newest) {
      fs::remove_all(e.path(), ec);  // a save that never committed
    }
  }
  std::sort(committed.rbegin(), committed.rend());
  for (size_t i = static_cast<size_t>(keep_); i < committed.size(); ++i) fs::remove_all(committed[i].second, ec);
}

CheckpointInfo read_checkpoint_info(const std::string& dir) {
  std::ifstream f(dir + "/" + kMarker);
  if (!f) throw usage_error("checkpoint '", dir, "' is not committed (no ", kMarker, " marker): an interrupted save?");
  CheckpointInfo info;
  info.path = dir;
  std::string key;
  int64_t value = 0;
  int seen = 0;
  while (f >> key >> value) {
    if (key == "step") info.step = value, seen |= 1;
    if (key == "world_size") info.world_size = value, seen |= 2;
    if (key == "num_classes") info.num_classes = value, seen |= 4;
  }
  if (seen != 7) throw usage_error("checkpoint '", dir, "': malformed ", kMarker, " marker");
  return info;
}

StateDict read_checkpoint_file(const CheckpointInfo& ckpt, const std::string& name) {
  const std::string path = ckpt.path + "/" + name;
  if (!fs::exists(path)) throw usage_error("checkpoint '", ckpt.path, "' has no ", name);
  return read_state_dict(path);
}

StateDict read_resharded_rows(const CheckpointInfo& ckpt, int64_t start, int64_t count, int rank) {
  const int own = rank < ckpt.world_size ? rank : 0;
  StateDict out;
  std::vector<std::string> row_keys;
  std::vector<std::vector<at::Tensor>> parts;
  for (int64_t r = 0; r < ckpt.world_size; ++r) {
    const std::string name = "fc_shard_" + std::to_string(r) + ".pt";
    StateDict sd = read_checkpoint_file(ckpt, name);
    const std::string src = ckpt.path + "/" + name;
    const int64_t s = state_get(sd, "rows.start", src).item<int64_t>();
    const int64_t c = state_get(sd, "rows.count", src).item<int64_t>();
    if (r == own)
      for (const auto& kv : sd)
        if (kv.first.rfind("rows/", 0) != 0) out.push_back(kv);
    const int64_t lo = std::max(start, s), hi = std::min(start + count, s + c);
    bool first_file = row_keys.empty();
    for (const auto& kv : sd) {
      if (kv.first.rfind("rows/", 0) != 0) continue;
      if (kv.second.dim() == 0 || kv.second.size(0) != c)
        throw usage_error(src, ": '", kv.first, "' has ", kv.second.dim() ? kv.second.size(0) : 0, " rows, expected ", c);
      size_t k = std::find(row_keys.begin(), row_keys.end(), kv.first) - row_keys.begin();
      if (k == row_keys.size()) {
        if (!first_file) throw usage_error(src, ": unexpected key '", kv.first, "'");
        row_keys.push_back(kv.first);
        parts.emplace_back();
      }
      if (hi > lo) parts[k].push_back(kv.second.narrow(0, lo - s, hi - lo));
    }
  }
  for (size_t k = 0; k < row_keys.size(); ++k) {
    at::Tensor rows = parts[k].empty() ? at::Tensor() : torch::cat(parts[k]);
    if (!rows.defined() || rows.size(0) != count)
      throw usage_error("checkpoint '", ckpt.path, "': rows of classes [", start, ", ", start + count,
                        ") are incomplete for '", row_keys[k], "'");
    out.emplace_back(row_keys[k], rows);
  }
  return out;
}

}  // namespace faceshard
