// The logger: one line per message, prefixed with the rank in multi-rank runs. Only rank 0
// prints info-level progress unless FACESHARD_LOG_ALL_RANKS=1; warnings and errors print
// on every rank.
#pragma once
#include <string>

#include "base/error.h"

namespace faceshard {

// Notice: informational like Info, but printed on every rank that logs it (a per-host
// line such as the network choice, logged by each host's local rank 0).
enum class LogLevel { Debug = 0, Info = 1, Notice = 2, Warn = 3, Error = 4 };

// Set once by the distributed runtime.
void set_log_rank(int rank, int world_size);
std::string log_prefix();  // "[rank 1/3] " or "" for one process
void log_message(LogLevel level, const std::string& msg);
// Every line this process logs from now on (and its fatal error) is also appended to `path`,
// each with its UTC time; "" stops. (The trainer's OUTPUT/training.log.)
void set_log_file(const std::string& path);
// Appends one line to the log file, if one is set (report_fatal's error line).
void append_to_log_file(const std::string& line);

// Numbers for log lines, rounded for a reader: 3 significant digits ("0.0171", "241"), and
// byte counts in the unit that suits them ("4.12 MB", "9.01 GB").
std::string format_sig(double v, int digits = 3);
std::string format_bytes(double bytes);

template <typename... Args>
void log_info(const Args&... args) { log_message(LogLevel::Info, detail::concat(args...)); }
template <typename... Args>
void log_notice(const Args&... args) { log_message(LogLevel::Notice, detail::concat(args...)); }
template <typename... Args>
void log_warn(const Args&... args) { log_message(LogLevel::Warn, detail::concat(args...)); }
template <typename... Args>
void log_debug(const Args&... args) { log_message(LogLevel::Debug, detail::concat(args...)); }

}  // namespace faceshard
