#include "partial_fc/distributed/collective_trace.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "base/error.h"

namespace faceshard {
namespace {

double wall_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') out += '\\', out += static_cast<char>(c);
    else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else out += static_cast<char>(c);
  }
  return out + "\"";
}

std::string number(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.3f", v);
  return buf;
}

// One line of a trace file: a flat JSON object of strings and numbers.
using Fields = std::map<std::string, std::string>;

Fields parse_line(const std::string& line, const std::string& where) {
  Fields f;
  size_t i = 0;
  auto bad = [&](const char* what) { return usage_error(where, ": not a trace line (", what, ")"); };
  auto skip = [&] {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
  };
  auto string_at = [&]() -> std::string {
    if (i >= line.size() || line[i] != '"') throw bad("expected a string");
    std::string s;
    for (++i; i < line.size() && line[i] != '"'; ++i) {
      if (line[i] != '\\') {
        s += line[i];
        continue;
      }
      if (++i >= line.size()) throw bad("a broken escape");
      if (line[i] == 'u') {
        if (i + 4 >= line.size()) throw bad("a broken escape");
        const unsigned v = static_cast<unsigned>(std::strtoul(line.substr(i + 1, 4).c_str(), nullptr, 16));
        s += v < 0x80 ? static_cast<char>(v) : '?';
        i += 4;
      } else {
        s += line[i];
      }
    }
    if (i >= line.size()) throw bad("an unterminated string");
    ++i;
    return s;
  };
  skip();
  if (i >= line.size() || line[i] != '{') throw bad("expected '{'");
  ++i;
  skip();
  if (i < line.size() && line[i] == '}') return f;
  while (true) {
    skip();
    const std::string key = string_at();
    skip();
    if (i >= line.size() || line[i] != ':') throw bad("expected ':'");
    ++i;
    skip();
    std::string value;
    if (i < line.size() && line[i] == '"') {
      value = string_at();
    } else {
      const size_t start = i;
      while (i < line.size() && line[i] != ',' && line[i] != '}' && line[i] != ' ') ++i;
      value = line.substr(start, i - start);
      if (value.empty()) throw bad("a missing value");
    }
    if (f.size() >= 64) throw bad("too many fields");
    f[key] = value;
    skip();
    if (i < line.size() && line[i] == ',') {
      ++i;
      continue;
    }
    if (i < line.size() && line[i] == '}') break;
    throw bad("expected ',' or '}'");
  }
  return f;
}

double num(const Fields& f, const char* key, const std::string& where) {
  auto it = f.find(key);
  if (it == f.end()) throw usage_error(where, ": trace line without '", key, "'");
  char* end = nullptr;
  const double v = std::strtod(it->second.c_str(), &end);
  if (it->second.empty() || *end || !std::isfinite(v)) throw usage_error(where, ": '", key, "' is not a number");
  return v;
}

std::string str(const Fields& f, const char* key) {
  auto it = f.find(key);
  return it == f.end() ? std::string() : it->second;
}

std::string rank_name(const RankTrace& t) { return "rank " + std::to_string(t.rank) + " (host " + t.host + ")"; }

std::string describe(const CollectiveRecord& r) {
  std::string s = "#" + std::to_string(r.seq) + " " + r.kind;
  if (r.step >= 0) s += " at step " + std::to_string(r.step);
  if (!r.phase.empty()) s += " (" + r.phase + ")";
  return s;
}

}  // namespace

CollectiveTrace::CollectiveTrace(size_t capacity) : capacity_(std::max<size_t>(1, capacity)) {
  ring_.reserve(capacity_);
}

void CollectiveTrace::set_context(int64_t step, const char* phase) {
  std::lock_guard<std::mutex> lock(m_);
  step_ = step;
  phase_ = phase ? phase : "";
}

void CollectiveTrace::begin(int64_t seq, const char* kind, const char* backend, const std::string& dtype,
                            int64_t numel) {
  CollectiveRecord r;
  r.seq = seq;
  r.kind = kind;
  r.backend = backend;
  r.dtype = dtype;
  r.numel = numel;
  r.issued_ms = wall_ms();
  std::lock_guard<std::mutex> lock(m_);
  r.step = step_;
  r.phase = phase_;
  if (ring_.size() < capacity_) {
    ring_.push_back(std::move(r));
  } else {
    ring_[next_] = std::move(r);
    next_ = (next_ + 1) % capacity_;
  }
}

void CollectiveTrace::end(int64_t seq) {
  const double now = wall_ms();
  std::lock_guard<std::mutex> lock(m_);
  // The newest records first: a collective ends soon after it begins.
  for (size_t k = 0; k < ring_.size(); ++k) {
    CollectiveRecord& r = ring_[(next_ + ring_.size() - 1 - k) % ring_.size()];
    if (r.seq == seq) {
      r.finished_ms = now;
      return;
    }
  }
}

std::vector<CollectiveRecord> CollectiveTrace::records() const {
  std::lock_guard<std::mutex> lock(m_);
  std::vector<CollectiveRecord> out;
  out.reserve(ring_.size());
  for (size_t k = 0; k < ring_.size(); ++k) out.push_back(ring_[(next_ + k) % ring_.size()]);
  return out;
}

std::optional<CollectiveRecord> CollectiveTrace::oldest_pending() const {
  std::lock_guard<std::mutex> lock(m_);
  for (size_t k = 0; k < ring_.size(); ++k) {
    const CollectiveRecord& r = ring_[(next_ + k) % ring_.size()];
    if (r.pending()) return r;
  }
  return std::nullopt;
}

bool CollectiveTrace::write(const std::string& path, int rank, int world_size, const std::string& host,
                            const std::string& reason) const {
  const std::vector<CollectiveRecord> rs = records();
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) return false;
    f << "{\"rank\":" << rank << ",\"world_size\":" << world_size << ",\"host\":" << quoted(host)
      << ",\"reason\":" << quoted(reason) << ",\"written_ms\":" << number(wall_ms()) << ",\"records\":" << rs.size()
      << "}\n";
    for (const CollectiveRecord& r : rs)
      f << "{\"seq\":" << r.seq << ",\"kind\":" << quoted(r.kind) << ",\"backend\":" << quoted(r.backend)
        << ",\"dtype\":" << quoted(r.dtype) << ",\"numel\":" << r.numel << ",\"step\":" << r.step
        << ",\"phase\":" << quoted(r.phase) << ",\"issued_ms\":" << number(r.issued_ms)
        << ",\"finished_ms\":" << number(r.finished_ms) << "}\n";
    f.flush();
    if (!f) {
      f.close();
      std::remove(tmp.c_str());
      return false;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

RankTrace read_rank_trace(const std::string& path) {
  constexpr std::uintmax_t kMaxBytes = 64ull << 20;
  constexpr size_t kMaxRecords = 100000;
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) throw usage_error(path, ": cannot read the trace file (", ec.message(), ")");
  if (size > kMaxBytes) throw usage_error(path, ": ", size, " bytes is more than a trace file holds (64 MiB)");
  std::ifstream f(path);
  if (!f) throw usage_error(path, ": cannot open the trace file");
  RankTrace t;
  t.path = path;
  std::string line;
  int64_t n = 0;
  while (std::getline(f, line)) {
    ++n;
    const std::string where = path + ":" + std::to_string(n);
    if (line.empty()) continue;
    const Fields fl = parse_line(line, where);
    if (n == 1) {
      t.rank = static_cast<int>(num(fl, "rank", where));
      t.world_size = static_cast<int>(num(fl, "world_size", where));
      if (t.rank < 0 || t.world_size < 1 || t.rank >= t.world_size || t.world_size > 1000000)
        throw usage_error(where, ": rank ", t.rank, " of ", t.world_size, " is not a rank of a job");
      t.host = str(fl, "host");
      t.reason = str(fl, "reason");
      continue;
    }
    if (t.records.size() >= kMaxRecords) throw usage_error(where, ": more than ", kMaxRecords, " records");
    CollectiveRecord r;
    r.seq = static_cast<int64_t>(num(fl, "seq", where));
    r.kind = str(fl, "kind");
    r.backend = str(fl, "backend");
    r.dtype = str(fl, "dtype");
    r.numel = static_cast<int64_t>(num(fl, "numel", where));
    r.step = static_cast<int64_t>(num(fl, "step", where));
    r.phase = str(fl, "phase");
    r.issued_ms = num(fl, "issued_ms", where);
    r.finished_ms = num(fl, "finished_ms", where);
    t.records.push_back(std::move(r));
  }
  if (n == 0) throw usage_error(path, ": an empty trace file");
  return t;
}

std::vector<RankTrace> read_run_traces(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) throw usage_error(dir, ": not a folder of trace files");
  std::vector<std::string> paths;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("rank", 0) == 0 && name.size() > 10 && name.substr(name.size() - 6) == ".jsonl") paths.push_back(e.path().string());
  }
  if (ec) throw usage_error(dir, ": cannot list the folder (", ec.message(), ")");
  if (paths.empty()) throw usage_error(dir, ": no trace files (rank<r>.jsonl) in it");
  std::sort(paths.begin(), paths.end());
  std::vector<RankTrace> out;
  for (const std::string& p : paths) out.push_back(read_rank_trace(p));
  return out;
}

std::vector<std::string> trace_verdict(const std::vector<RankTrace>& traces) {
  std::vector<std::string> lines;
  if (traces.empty()) return {"no trace files"};
  int world = 0;
  std::map<int, const RankTrace*> by_rank;
  for (const RankTrace& t : traces) {
    world = std::max(world, t.world_size);
    by_rank[t.rank] = &t;
  }
  std::vector<int> silent;
  for (int r = 0; r < world; ++r)
    if (!by_rank.count(r)) silent.push_back(r);
  // The collective the job hangs in: the lowest sequence number some rank issued and never
  // finished.
  std::optional<CollectiveRecord> stuck;
  for (const auto& kv : by_rank)
    for (const CollectiveRecord& r : kv.second->records)
      if (r.pending() && (!stuck || r.seq < stuck->seq)) stuck = r;
  if (!stuck) {
    int64_t last = -1;
    for (const auto& kv : by_rank)
      if (!kv.second->records.empty()) last = std::max(last, kv.second->records.back().seq);
    lines.push_back("no collective was pending: every rank with a trace finished its last one (the newest #" +
                    std::to_string(last) + ")");
  } else {
    std::vector<std::string> waiting, missing;
    for (const auto& kv : by_rank) {
      const RankTrace& t = *kv.second;
      const CollectiveRecord* last = nullptr;
      bool entered = false;
      for (const CollectiveRecord& r : t.records) {
        if (r.seq == stuck->seq) entered = true;
        if (!last || r.seq > last->seq) last = &r;
      }
      if (entered) {
        waiting.push_back(std::to_string(t.rank));
      } else {
        missing.push_back(rank_name(t) + ", whose last was " + (last ? describe(*last) : std::string("none")) +
                          (last && last->pending() ? ", still pending" : ""));
      }
    }
    for (int r : silent) missing.push_back("rank " + std::to_string(r) + " (no trace file: killed or frozen)");
    std::string line = "collective " + describe(*stuck) + ": rank" + (waiting.size() > 1 ? "s " : " ");
    for (size_t k = 0; k < waiting.size(); ++k) line += (k ? "," : "") + waiting[k];
    line += " entered it and waited";
    if (missing.empty()) {
      line += "; every rank entered it (a slow or cut link, not a missing rank)";
    } else {
      line += "; never entered by ";
      for (size_t k = 0; k < missing.size(); ++k) line += (k ? "; " : "") + missing[k];
    }
    lines.push_back(line);
  }
  for (const auto& kv : by_rank)
    if (!kv.second->reason.empty()) lines.push_back(rank_name(*kv.second) + " wrote its trace: " + kv.second->reason);
  if (!silent.empty() && !stuck) {
    std::string line = "no trace from rank";
    line += silent.size() > 1 ? "s " : " ";
    for (size_t k = 0; k < silent.size(); ++k) line += (k ? "," : "") + std::to_string(silent[k]);
    line += " (killed, frozen, or on a host whose output folder is not this one)";
    lines.push_back(line);
  }
  return lines;
}

std::string this_host() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

}  // namespace faceshard
