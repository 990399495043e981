#include "app/io/checkpoint.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "app/io/checkpoint_verify.h"
#include "base/error.h"
#include "base/log.h"

namespace fs = std::filesystem;

namespace faceshard {
namespace {

const char* kMarker = "COMMITTED";

std::string step_dir(const std::string& root, int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step_%08lld", static_cast<long long>(step));
  return root + "/" + buf;
}

// A failed fsync means the data may never reach the disk: the write has failed.
void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) throw runtime_error("cannot open '", path, "' to flush it: ", std::strerror(errno));
  if (::fsync(fd) != 0) {
    const int e = errno;
    ::close(fd);
    // Some file systems cannot flush a folder (EINVAL): nothing is lost by that.
    if (!(directory && e == EINVAL)) throw runtime_error("cannot flush '", path, "' to disk: ", std::strerror(e));
    return;
  }
  ::close(fd);
}

void durable_rename(const std::string& tmp, const std::string& path) {
  try {
    fsync_path(tmp, false);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    throw runtime_error("cannot rename '", tmp, "' to '", path, "': ", std::strerror(e));
  }
  fsync_path(parent_folder(path), true);
}

// A failed write in one line that says what the disk said: the library's own message (a
// zip writer's "unexpected pos 1344 vs 1240") often hides a full disk.
std::string describe_write_error(const std::exception& e, const std::string& dir) {
  std::string what = one_line(e);
  struct statvfs sv {};
  if (::statvfs(dir.c_str(), &sv) == 0) {
    const double free_bytes = static_cast<double>(sv.f_bavail) * static_cast<double>(sv.f_frsize);
    if (free_bytes < 64.0 * 1024 * 1024)
      what += " (the file system holding '" + dir + "' has " + format_bytes(free_bytes) + " free: full?)";
  }
  return what;
}

}  // namespace

std::string parent_folder(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

void write_state_dict_durably(const StateDict& weights, const std::string& path) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  try {
    write_state_dict(weights, tmp);
  } catch (...) {
    ::unlink(tmp.c_str());  // nothing partial stays behind, under any name
    throw;
  }
  durable_rename(tmp, path);
}

void write_text_durably(const std::string& text, const std::string& path) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw runtime_error("cannot write '", tmp, "': ", std::strerror(errno));
  int error = 0;
  for (size_t done = 0; done < text.size() && error == 0;) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w > 0) done += static_cast<size_t>(w);
    else if (!(w < 0 && errno == EINTR)) error = w < 0 ? errno : EIO;
  }
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error) {
    ::unlink(tmp.c_str());
    throw runtime_error("cannot write '", tmp, "': ", std::strerror(error));
  }
  durable_rename(tmp, path);
}

namespace {

// The entry `key` of a checkpoint file when it holds one value (read: a few bytes).
at::Tensor one_value(const TensorSource& file, const std::string& key, const std::string& source) {
  const size_t i = file.find(key);
  if (i == TensorSource::npos)
    throw usage_error(source, ": key '", key, "' is missing (not a faceshard checkpoint, or a different version)");
  if (file.numel(i) != 1) throw usage_error(source, ": key '", key, "' holds ", file.numel(i), " values, expected one");
  return file.read(i).reshape({});
}

}  // namespace

int64_t read_checkpoint_int(const TensorSource& file, const std::string& key, const std::string& source) {
  const at::Tensor v = one_value(file, key, source);
  if (at::isFloatingType(v.scalar_type()) || at::isComplexType(v.scalar_type()))
    throw usage_error(source, ": key '", key, "' is ", v.scalar_type(), ", expected an integer");
  return v.item<int64_t>();
}

double read_checkpoint_double(const TensorSource& file, const std::string& key, const std::string& source) {
  const at::Tensor v = one_value(file, key, source);
  if (at::isComplexType(v.scalar_type())) throw usage_error(source, ": key '", key, "' is complex, expected a number");
  return v.item<double>();
}

void check_checkpoint_values(const at::Tensor& t, const std::string& source, const std::string& key,
                             bool non_negative, int64_t first_row) {
  if (!t.defined() || t.numel() == 0) return;
  const bool floating = t.is_floating_point();
  if (!floating && !non_negative) return;
  if (t.is_complex() || t.scalar_type() == at::kBool)
    throw usage_error(source, ": key '", key, "' is ", t.scalar_type(), ", expected real numbers");
  at::NoGradGuard no_grad;
  const at::Tensor all = t.dim() == 0 ? t.reshape({1}) : t.detach();
  // Rows at a time, about 4M values per chunk: the masks of a chunk (4 MB each) are all that
  // is made, and what a resume leaves to the CPU block cache stays small.
  const int64_t per_row = std::max<int64_t>(1, all.numel() / all.size(0));
  const int64_t rows = std::max<int64_t>(1, (int64_t(1) << 22) / per_row);
  for (int64_t r = 0; r < all.size(0); r += rows) {
    const at::Tensor c = all.narrow(0, r, std::min(rows, all.size(0) - r));
    at::Tensor bad = floating ? at::isfinite(c).logical_not() : at::zeros_like(c, c.options().dtype(at::kBool));
    if (non_negative) bad = bad.logical_or(c < 0);
    if (!bad.any().item<bool>()) continue;
    const int64_t at = bad.reshape(-1).nonzero()[0][0].item<int64_t>();
    const at::Tensor v = c.reshape(-1)[at].to(at::kCPU, at::kDouble);
    const double value = v.item<double>();
    std::ostringstream where;
    if (first_row >= 0)
      where << "class " << first_row + r + at / per_row;
    else
      where << "index " << r * per_row + at;
    throw usage_error(source, ": key '", key, "': the value at ", where.str(), " is ", value, ", expected ",
                      std::isfinite(value) ? "a value >= 0" : "a finite number");
  }
}

CheckpointManager::CheckpointManager(std::string root, Distributed& dist, int64_t keep)
    : root_(std::move(root)), dist_(dist), keep_(std::max<int64_t>(1, keep)) {}

std::string CollectiveAgreement::agree(const std::string& mine) { return agree_on_problem(mine, dist_); }
void CollectiveAgreement::barrier() { dist_.barrier(); }

bool CheckpointManager::save(int64_t step, int64_t num_classes, const StateDict& backbone,
                             const StateDict& train_state, const StateDict& shard) {
  CollectiveAgreement collectives(dist_);
  return save(step, num_classes, backbone, train_state, shard, collectives);
}

bool CheckpointManager::save(int64_t step, int64_t num_classes, const StateDict& backbone,
                             const StateDict& train_state, const StateDict& shard, SaveAgreement& agreement) {
  const std::string dir = step_dir(root_, step);
  const std::string shard_path = dir + "/fc_shard_" + std::to_string(dist_.rank()) + ".pt";
  const std::string tmp = shard_path + ".tmp." + std::to_string(::getpid());
  // Every stage ends with the ranks agreeing on what failed (one small all-gather), so that
  // a disk error on one rank makes every rank give the save up at the same point.
  std::string problem;
  if (dist_.rank() == 0) {
    std::error_code ec;
    fs::remove_all(dir, ec);  // an uncommitted leftover of a crashed save
    fs::create_directories(dir, ec);
    if (ec) problem = "cannot create checkpoint folder '" + dir + "': " + ec.message();
  }
  problem = agreement.agree(problem);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> written;
  if (problem.empty()) {
    try {
      if (dist_.rank() == 0) {
        write_state_dict_durably(backbone, dir + "/backbone.pt");
        written.push_back(dir + "/backbone.pt");
        write_state_dict_durably(train_state, dir + "/train_state.pt");
        written.push_back(dir + "/train_state.pt");
      }
      write_state_dict(shard, tmp);
      if (mid_save_hook_) mid_save_hook_(step);
      durable_rename(tmp, shard_path);
      written.push_back(shard_path);
      // Read back before the commit: what is committed verifies.
      for (const std::string& f : written) {
        const std::string bad = verify_checkpoint_file(f);
        if (!bad.empty()) throw runtime_error("read back: ", bad);
      }
    } catch (const std::exception& e) {
      problem = "rank " + std::to_string(dist_.rank()) + ": " + describe_write_error(e, dir);
    }
    problem = agreement.agree(problem);
  }
  if (problem.empty()) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::error_code ec;
    double gb = 0;
    for (const auto& f : written) gb += static_cast<double>(fs::file_size(f, ec)) / 1e9;
    last_bytes_ = gb * 1e9;
    last_write_s_ = s;
    log_info("checkpoint step ", step, ": this rank wrote ", format_bytes(gb * 1e9), " in ", format_sig(s), " s (",
             format_bytes(gb * 1e9 / std::max(s, 1e-9)), "/s, fsync and read-back included)");
    // Every rank has its files in place and read back: rank 0 commits.
    bool marker_written = false;
    if (dist_.rank() == 0) {
      try {
        std::ostringstream os;
        os << "step " << step << "\nworld_size " << dist_.world_size() << "\nnum_classes " << num_classes << "\n";
        write_text_durably(os.str(), dir + "/" + kMarker);
        marker_written = true;
      } catch (const std::exception& e) {
        problem = "rank 0: " + describe_write_error(e, dir);
      }
    }
    problem = agreement.agree(problem);
    if (!problem.empty() && marker_written) {
      // Every rank's files were in place and verified (the stage before) and the marker is
      // durable: the checkpoint is whole, although a rank did not confirm its commit (it died
      // or froze since). It stays, the newest committed one.
      log_warn("checkpoint step ", step, ": committed, but not every rank confirmed it: ", problem);
      failed_in_a_row_ = 0;
      prune(dir);
      return true;
    }
  }
  if (!problem.empty()) {
    // Nothing of this save stays: the previous committed checkpoint is the newest.
    std::error_code ec;
    fs::remove(tmp, ec);
    if (dist_.rank() == 0) fs::remove_all(dir, ec);
    agreement.barrier();
    failed_in_a_row_++;
    last_problem_ = problem;
    return false;
  }
  failed_in_a_row_ = 0;
  if (dist_.rank() == 0) prune(dir);
  agreement.barrier();
  return true;
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
  const std::string marker = dir + "/" + kMarker;
  CheckpointInfo info;
  info.path = dir;
  // Bounds on what the marker says: the classifier's layout is computed from them.
  struct Key {
    const char* name;
    int64_t* value;
    int64_t min, max;
    bool seen;
  };
  Key keys[] = {{"step", &info.step, 0, int64_t(1) << 53, false},
                {"world_size", &info.world_size, 1, int64_t(1) << 20, false},
                {"num_classes", &info.num_classes, 1, int64_t(1) << 40, false}};
  std::string line;
  for (int n = 1; std::getline(f, line) && n <= 64; ++n) {
    std::istringstream in(line);
    std::string key, value;
    if (!(in >> key)) continue;
    in >> value;
    for (Key& k : keys) {
      if (key != k.name) continue;
      char* end = nullptr;
      errno = 0;
      const long long v = std::strtoll(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || errno == ERANGE || v < k.min || v > k.max)
        throw usage_error(marker, ":", n, ": key '", k.name, "' is '", detail::printable(value, 40),
                          "', expected an integer in [", k.min, ", ", k.max, "]");
      *k.value = v;
      k.seen = true;
    }
  }
  for (const Key& k : keys)
    if (!k.seen) throw usage_error(marker, ": key '", k.name, "' is missing (a malformed ", kMarker, " marker)");
  if (info.num_classes < info.world_size)
    throw usage_error(marker, ": key 'num_classes' is ", info.num_classes, ", fewer than its world_size ", info.world_size);
  return info;
}

StateDictReader open_checkpoint_file(const CheckpointInfo& ckpt, const std::string& name) {
  const std::string path = ckpt.path + "/" + name;
  if (!fs::exists(path)) throw usage_error("checkpoint '", ckpt.path, "' has no ", name);
  return StateDictReader(path);
}

}  // namespace faceshard
