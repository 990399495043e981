#include "app/train/run_folder.h"

#include <ctime>
#include <filesystem>

#include "app/io/checkpoint.h"
#include "base/error.h"
#include "base/log.h"

namespace faceshard {
namespace fs = std::filesystem;

std::string absolute_text(const std::string& p) {
  std::error_code ec;
  const fs::path a = fs::absolute(p, ec);
  return ec ? p : a.lexically_normal().string();
}

namespace {

bool non_empty_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec) && fs::directory_iterator(p, ec) != fs::directory_iterator();
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

bool has_step_folders(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_directory(ec) && e.path().filename().string().rfind("step_", 0) == 0) return true;
  return false;
}

}  // namespace

const std::vector<std::string>& run_file_names() {
  static const std::vector<std::string> names = {"config.yaml", "metrics.jsonl", "training.log", "checkpoints",
                                                 "tensorboard", "model.pt",      "model.json",  "data_set.txt"};
  return names;
}

std::vector<std::string> run_files_in(const std::string& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return found;
  for (const std::string& name : run_file_names()) {
    const fs::path p = fs::path(dir) / name;
    if (fs::is_directory(p, ec) ? non_empty_dir(p) : fs::exists(p, ec)) found.push_back(name);
  }
  return found;
}

void check_output_free_for_fresh_run(const std::string& output, bool overwrite) {
  std::error_code ec;
  if (fs::exists(output, ec) && !fs::is_directory(output, ec))
    throw usage_error("output '", absolute_text(output), "' is a file, not a folder");
  if (overwrite) return;
  const std::vector<std::string> found = run_files_in(output);
  if (found.empty()) return;
  throw usage_error("output '", absolute_text(output), "' already holds a run (", join(found),
                    "): continue it with --resume, choose another output (--set output=DIR), or start afresh with "
                    "--overwrite (moves the old run into a replaced-<time> folder inside it)");
}

std::string move_previous_run_aside(const std::string& output) {
  const std::vector<std::string> found = run_files_in(output);
  if (found.empty()) return "";
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &utc);
  fs::path aside = fs::path(output) / (std::string("replaced-") + stamp);
  std::error_code ec;
  for (int n = 2; fs::exists(aside, ec); ++n)
    aside = fs::path(output) / (std::string("replaced-") + stamp + "-" + std::to_string(n));
  fs::create_directory(aside, ec);
  if (ec) throw runtime_error("--overwrite: cannot create '", absolute_text(aside.string()), "': ", ec.message());
  // Every entry of the old run moves, empty folders too: nothing of it stays to mix.
  for (const std::string& name : run_file_names()) {
    const fs::path from = fs::path(output) / name;
    if (!fs::exists(fs::symlink_status(from, ec))) continue;
    fs::rename(from, aside / name, ec);
    if (ec)
      throw runtime_error("--overwrite: cannot move '", absolute_text(from.string()), "' into '",
                          absolute_text(aside.string()), "': ", ec.message());
  }
  return aside.string();
}

std::string resolve_checkpoint_source(const std::string& dir, const std::string& what) {
  std::error_code ec;
  const fs::path p(dir);
  if (!fs::exists(p, ec)) throw usage_error(what, " '", absolute_text(dir), "': does not exist");
  if (!fs::is_directory(p, ec))
    throw usage_error(what, " '", absolute_text(dir), "': is a file; give a run folder or a checkpoint folder");
  if (fs::exists(p / "COMMITTED", ec) || fs::exists(p / "backbone.pt", ec)) return dir;  // one checkpoint
  fs::path root;
  if (fs::is_directory(p / "checkpoints", ec)) root = p / "checkpoints";  // a run folder
  else if (has_step_folders(p)) root = p;                                  // a checkpoints folder
  else
    throw usage_error(what, " '", absolute_text(dir),
                      "': is neither a run folder (with checkpoints/) nor a checkpoint (with COMMITTED)");
  const std::string latest = latest_checkpoint(root.string());
  if (latest.empty())
    throw usage_error(what, " '", absolute_text(dir), "': holds no committed checkpoint under '",
                      absolute_text(root.string()), "'");
  return latest;
}

std::string resolve_resume_source(const std::string& dir) { return resolve_checkpoint_source(dir, "--resume"); }

}  // namespace faceshard
