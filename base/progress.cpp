#include "base/progress.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace faceshard {

Progress::Progress(std::string what, uint64_t total, std::string unit)
    : what_(std::move(what)),
      unit_(std::move(unit)),
      total_(total),
      terminal_(isatty(STDERR_FILENO) == 1),
      quiet_s_([] {
        const char* v = std::getenv("FACESHARD_PROGRESS_AFTER_S");
        char* end = nullptr;
        const double s = v ? std::strtod(v, &end) : 2.0;
        return v && (end == v || !(s >= 0)) ? 2.0 : s;
      }()),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

Progress::~Progress() {
  try {
    finish();
  } catch (...) {
  }
}

std::string Progress::format_seconds(double s) {
  if (!(s >= 0)) s = 0;
  const long long t = static_cast<long long>(s + 0.5);
  char buf[32];
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", t / 3600, (t / 60) % 60);
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%lldm%02llds", t / 60, t % 60);
  else std::snprintf(buf, sizeof buf, "%llds", t);
  return buf;
}

void Progress::update(uint64_t done) {
  if (finished_ || done < done_) return;
  done_ = done;
  const auto now = std::chrono::steady_clock::now();
  if (std::chrono::duration<double>(now - start_).count() < quiet_s_) return;
  if (terminal_) {
    // Redrawn at most 10 times a second.
    if (now - last_draw_ < std::chrono::milliseconds(100) && done_ != total_) return;
    last_draw_ = now;
    print(false);
  } else if (total_ > 0) {
    const int step = static_cast<int>(done_ * 20 / total_);  // 5% steps
    if (step > last_step_ && done_ < total_) {
      last_step_ = step;
      print(false);
    }
  }
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (printed_ || elapsed >= quiet_s_) print(true);
}

void Progress::print(bool final_line) {
  printed_ = true;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = elapsed > 0 ? done_ / elapsed : 0;
  std::string line = what_ + ": ";
  char buf[160];
  if (total_ > 0) {
    std::snprintf(buf, sizeof buf, "%llu/%llu %s (%.0f%%)", static_cast<unsigned long long>(done_),
                  static_cast<unsigned long long>(total_), unit_.c_str(), 100.0 * done_ / total_);
  } else {
    std::snprintf(buf, sizeof buf, "%llu %s", static_cast<unsigned long long>(done_), unit_.c_str());
  }
  line += buf;
  if (rate > 0) {
    std::snprintf(buf, sizeof buf, ", %.1f %s/s", rate, unit_.c_str());
    line += buf;
  }
  if (final_line) line += ", " + format_seconds(elapsed);
  else if (total_ > 0 && rate > 0) line += ", ETA " + format_seconds((total_ - done_) / rate);
  if (terminal_) {
    std::fprintf(stderr, "\r%s\033[K%s", line.c_str(), final_line ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

}  // namespace faceshard
