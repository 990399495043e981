#include "app/io/metrics_log.h"

#include "app/io/append_file.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "base/error.h"

namespace faceshard {

namespace {

constexpr const char* kFile = "metrics_log";

bool is_counter_key(const std::string& key) { return key == "step" || key == "epoch" || key == "global_step"; }

}  // namespace

std::string json_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 2);
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(ch);
        }
    }
  }
  return out;
}

std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  // Shortest %g that reads back exactly: "0.1" rather than "0.10000000000000001".
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, value);
    if (std::strtod(buf, nullptr) == value) break;
  }
  return buf;
}

MetricsLog::MetricsLog(const std::string& path, bool append) : path_(path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) throw runtime_error(kFile, ": cannot create directory '", parent.string(), "': ", ec.message());
  }
  file_ = std::make_unique<AppendFile>(path, append);
}

MetricsLog::~MetricsLog() = default;

void MetricsLog::write(const std::vector<std::pair<std::string, double>>& fields) {
  std::string line = "{";
  for (size_t i = 0; i < fields.size(); ++i) {
    const auto& [key, value] = fields[i];
    if (i) line += ", ";
    line += '"' + json_escape(key) + "\": ";
    // Counters read as integers (1e+06 would be a valid but odd step number); 2^53 is
    // where doubles stop holding every integer.
    if (is_counter_key(key) && std::isfinite(value) && value == std::trunc(value) && std::fabs(value) <= 9007199254740992.0)
      line += std::to_string(static_cast<long long>(value));
    else
      line += json_number(value);
  }
  line += "}\n";
  std::lock_guard<std::mutex> lock(mu_);
  file_->append(line);  // the whole line or nothing
}

}  // namespace faceshard
