// metrics.jsonl: one JSON object per logged training step ({"step": 10, "loss": 1.5, ...}),
// appended and flushed line by line so that a crash loses at most the line being written
// and plots can follow a run while it trains.
#pragma once
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace faceshard {

// Escapes a string for use inside JSON double quotes (quote, backslash, control
// characters); UTF-8 bytes pass through unchanged.
std::string json_escape(const std::string& s);

// One JSON number for `value`: the shortest text that reads back as the same double,
// "null" for NaN and infinities (JSON has no literal for them).
std::string json_number(double value);

class MetricsLog {
 public:
  // Opens `path` (creating its directory); append=false starts a new file, append=true
  // continues one (a resumed run).
  explicit MetricsLog(const std::string& path, bool append);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  // Writes the fields in the given order as one line, whole or not at all (append_file.h:
  // a failed write throws and leaves no part of the line). "step", "epoch" and
  // "global_step" holding whole numbers are printed as integers. Thread-safe.
  void write(const std::vector<std::pair<std::string, double>>& fields);

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<class AppendFile> file_;
  std::mutex mu_;
};

}  // namespace faceshard
