// Every rank's record of its last collectives: a ring of the last `capacity` (4,096 by
// default) with each one's sequence number (the same collective has the same number on
// every rank), kind, backend, element count and type, the training step and phase it was
// issued in, and when it was issued and finished (wall clock, ms). When a collective hangs
// or fails, on SIGUSR1 and at a fatal error, each rank writes its ring to a small file
// (`<dir>/rank<r>.jsonl`); trace_verdict() reads a run's files and names the ranks (and
// hosts) that never entered the collective the others wait in. `faceshard-dist-check
// --trace DIR` prints that verdict.
#pragma once
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace faceshard {

struct CollectiveRecord {
  int64_t seq = 0;
  std::string kind, backend, dtype;
  int64_t numel = 0;
  int64_t step = -1;  // the training step (1-based) it belongs to; -1 outside steps
  std::string phase;  // "forward", "backward", "optimizer", "checkpoint", ... ("" unknown)
  double issued_ms = 0, finished_ms = -1;  // wall clock; finished -1: still pending
  bool pending() const { return finished_ms < 0; }
};

class CollectiveTrace {
 public:
  explicit CollectiveTrace(size_t capacity = 4096);

  // What the following collectives belong to (the trainer sets it; phase a static string).
  void set_context(int64_t step, const char* phase);
  void begin(int64_t seq, const char* kind, const char* backend, const std::string& dtype, int64_t numel);
  void end(int64_t seq);

  // Oldest first.
  std::vector<CollectiveRecord> records() const;
  // The oldest collective still pending (the one this rank waits in), if any.
  std::optional<CollectiveRecord> oldest_pending() const;

  // Writes `path` (JSON lines: a header with rank, host, world size and the time, then one
  // line per record, oldest first) through a temporary file renamed into place. Returns
  // false (and leaves no partial file) when it cannot.
  bool write(const std::string& path, int rank, int world_size, const std::string& host,
             const std::string& reason) const;

 private:
  mutable std::mutex m_;
  size_t capacity_;
  std::vector<CollectiveRecord> ring_;
  size_t next_ = 0;  // where the next record goes once the ring is full
  int64_t step_ = -1;
  const char* phase_ = "";
};

// One rank's trace file, read back.
struct RankTrace {
  std::string path;
  int rank = -1, world_size = 0;
  std::string host, reason;
  std::vector<CollectiveRecord> records;
};

// Reads a trace file: one clear line (file:line) for anything that is not one; at most
// 64 MiB and 100,000 records are read.
RankTrace read_rank_trace(const std::string& path);
// Every rank*.jsonl under `dir`.
std::vector<RankTrace> read_run_traces(const std::string& dir);

// The verdict on a run's traces, one line per finding: the collective some ranks wait in
// and the ranks (with their hosts) that never entered it (with what they last entered), or
// that nothing was pending; ranks of the world without a file are named too.
std::vector<std::string> trace_verdict(const std::vector<RankTrace>& traces);

// The host name this process reports (gethostname).
std::string this_host();

}  // namespace faceshard
