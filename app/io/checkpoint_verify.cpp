#include "app/io/checkpoint_verify.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "models/torch_save/zip_archive.h"
#include "base/error.h"
#include "base/log.h"

namespace fs = std::filesystem;

namespace faceshard {

std::string verify_checkpoint_file(const std::string& path) {
  const std::string name = fs::path(path).filename().string();
  std::error_code ec;
  if (!fs::exists(path, ec)) return name + " is missing";
  try {
    const ZipArchive zip = ZipArchive::open_file(path, name);
    std::vector<uint8_t> buf(size_t(1) << 20);
    for (const ZipArchive::Entry& e : zip.entries()) {
      zip.check_stored(e);
      ZipEntryStream in(zip, e, 0, e.size);  // the last read checks the entry's CRC-32
      while (in.remaining() > 0) in.read(buf.data(), static_cast<size_t>(std::min<uint64_t>(buf.size(), in.remaining())));
    }
  } catch (const std::exception& e) {
    return one_line(e);
  }
  return "";
}

std::vector<std::string> checkpoint_file_names(const CheckpointInfo& info) {
  std::vector<std::string> names{"backbone.pt", "train_state.pt"};
  for (int64_t r = 0; r < info.world_size; ++r) names.push_back("fc_shard_" + std::to_string(r) + ".pt");
  return names;
}

std::string agree_on_problem(const std::string& mine, Distributed& d) {
  if (d.world_size() <= 1) return mine;
  // Fixed-size lines, gathered in one collective.
  constexpr int64_t kLen = 400;
  at::Tensor buf = torch::zeros({1, kLen}, torch::kUInt8);
  const std::string text = mine.substr(0, kLen - 1);
  std::copy(text.begin(), text.end(), buf.data_ptr<uint8_t>());
  const at::Tensor all = d.all_gather(buf).contiguous();
  for (int64_t r = 0; r < all.size(0); ++r) {
    const auto* p = all[r].data_ptr<uint8_t>();
    std::string s(reinterpret_cast<const char*>(p), strnlen(reinterpret_cast<const char*>(p), kLen));
    if (!s.empty()) return s;
  }
  return "";
}

std::string verify_checkpoint(const std::string& dir, Distributed& d) {
  std::string problem;
  try {
    const CheckpointInfo info = read_checkpoint_info(dir);
    const std::vector<std::string> names = checkpoint_file_names(info);
    for (size_t k = static_cast<size_t>(d.rank()); k < names.size() && problem.empty();
         k += static_cast<size_t>(d.world_size()))
      problem = verify_checkpoint_file(dir + "/" + names[k]);
  } catch (const std::exception& e) {
    problem = one_line(e);
  }
  return agree_on_problem(problem, d);
}

std::string choose_verified_checkpoint(const std::string& newest, bool walk_back, Distributed& d) {
  std::vector<std::pair<int64_t, std::string>> candidates{{0, newest}};
  if (walk_back) {
    const CheckpointInfo top = read_checkpoint_info(newest);
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(fs::path(newest).parent_path(), ec)) {
      if (!e.is_directory() || e.path().filename().string().rfind("step_", 0) != 0) continue;
      if (e.path() == fs::path(newest)) continue;
      try {
        const CheckpointInfo info = read_checkpoint_info(e.path().string());
        if (info.step < top.step) candidates.emplace_back(-info.step, e.path().string());
      } catch (const Error&) {
        // not committed, or its marker unreadable: not a candidate
      }
    }
    std::sort(candidates.begin() + 1, candidates.end());
  }
  std::string passed;
  for (const auto& [_, dir] : candidates) {
    const std::string problem = verify_checkpoint(dir, d);
    const std::string name = fs::path(dir).filename().string();
    if (problem.empty()) {
      if (!passed.empty() && d.rank() == 0)
        log_warn("resume: ", passed, "; resuming from ", name, ", the newest checkpoint that verifies");
      return dir;
    }
    passed += (passed.empty() ? "" : "; ") + name + " does not verify (" + problem + ")";
  }
  throw runtime_error("resume: no checkpoint under '", fs::path(newest).parent_path().string(), "' verifies: ", passed);
}

}  // namespace faceshard
