#include "partial_fc/runtime/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace faceshard {
namespace {
std::atomic<int> g_rank{0};
std::atomic<int> g_world{1};
std::mutex g_mutex;

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
}

}  // namespace faceshard
