#include "base/log.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>

namespace faceshard {
namespace {
std::atomic<int> g_rank{0};
std::atomic<int> g_world{1};
std::mutex g_mutex;
FILE* g_file = nullptr;  // guarded by g_mutex

void write_file_line(const std::string& line) {
  if (!g_file) return;
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &utc);
  std::fprintf(g_file, "%s %s\n", stamp, line.c_str());
  std::fflush(g_file);
}

LogLevel min_level() {
  static const LogLevel level = [] {
    const char* v = std::getenv("FACESHARD_LOG_LEVEL");
    if (!v) return LogLevel::Info;
    std::string s(v);
    if (s == "debug") return LogLevel::Debug;
    if (s == "warn") return LogLevel::Warn;
    if (s == "error") return LogLevel::Error;
    return LogLevel::Info;
  }();
  return level;
}
bool all_ranks() {
  static const bool v = [] {
    const char* e = std::getenv("FACESHARD_LOG_ALL_RANKS");
    return e && std::string(e) == "1";
  }();
  return v;
}
}  // namespace

void set_log_rank(int rank, int world_size) {
  g_rank = rank;
  g_world = world_size;
}

std::string log_prefix() {
  if (g_world.load() <= 1) return "";
  return "[rank " + std::to_string(g_rank.load()) + "/" + std::to_string(g_world.load()) + "] ";
}

void log_message(LogLevel level, const std::string& msg) {
  if (level < min_level()) return;
  if (level <= LogLevel::Info && g_rank.load() != 0 && !all_ranks()) return;
  const char* tag = level == LogLevel::Warn ? "warning: " : level == LogLevel::Error ? "error: " : "";
  std::lock_guard<std::mutex> lock(g_mutex);
  FILE* out = level >= LogLevel::Warn ? stderr : stdout;
  std::fprintf(out, "%s%s%s\n", log_prefix().c_str(), tag, msg.c_str());
  std::fflush(out);
  write_file_line(log_prefix() + tag + msg);
}

std::string format_sig(double v, int digits) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  return buf;
}

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KB", "MB", "GB", "TB", "PB"};
  int u = 0;
  while (u < 5 && std::abs(bytes) >= 1000) bytes /= 1000, ++u;
  return format_sig(bytes) + " " + units[u];
}

void set_log_file(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_file) std::fclose(g_file);
  g_file = path.empty() ? nullptr : std::fopen(path.c_str(), "a");
  if (!path.empty() && !g_file) throw runtime_error(path, ": cannot open the log file for appending");
}

void append_to_log_file(const std::string& line) {
  std::lock_guard<std::mutex> lock(g_mutex);
  write_file_line(line);
}

}  // namespace faceshard
