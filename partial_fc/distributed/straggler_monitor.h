// Slow ranks, found without a collective on the step path. Each rank times its steps on
// the host: the time it waited for its batch ("data") and the time it worked ("compute":
// the step less its data wait and less the time it was blocked in collectives, where a fast
// rank waits for a slow one). Every `window` steps, or sooner once the window's steps add up
// to `window_s` seconds (whichever comes first: a slow rank's windows last no longer than
// a fast one's), its medians go into the rendezvous store
// from a thread of the monitor's own; rank 0 reads every rank's, scores each rank per phase
// as the fastest rank's median over this rank's (1: as fast as the fastest), and a rank
// below 0.75 in two consecutive windows is reported (the trainer logs it and writes
// straggler/<rank> to metrics.jsonl). The same windows carry each rank's heartbeat round
// trips to the store, as their 90th percentile over the window: a link that is slow because
// its queue fills while the step's collectives send (a rate-limited or congested link) delays
// the heartbeats that meet the queue, and between bursts not at all, so a window's median
// swings around any threshold while its upper tail stays high. A rank whose figure is at
// least 10 ms and 10 times the fastest rank's median (+1 ms) in two consecutive windows, while its
// own work is not slow (a starved CPU delays its heartbeat too), has a slow link between its
// host and the store's (reported with the phase "link", its figures in seconds).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace faceshard {

// A step's own work per phase in seconds, its time blocked in collectives left out (-1:
// not measured; the trainer measures it on the CPU, where the host's clock is the work's).
struct StepPhases {
  double forward = -1, backward = -1, optimizer = -1;
};

struct StragglerReport {
  int rank = 0;
  std::string host, phase;  // "compute", "data", "forward", "backward", "optimizer" or "link"
  double score = 0;         // fastest rank's median / this rank's, in the window
  double median_s = 0, fastest_s = 0;
  int64_t first_step = 0, last_step = 0;  // the two windows
};

// The scores of one window: per rank and phase, fastest median / the rank's, with 5% of the
// fastest step (at least 2 ms; 10% for forward, backward and optimizer) added to both. medians[r] = {compute, data[, forward,
// backward, optimizer]}; a phase that some rank did not measure (< 0) scores 1.
std::vector<std::vector<double>> straggler_scores(const std::vector<std::vector<double>>& medians);
// Per rank: whether its store round trip (ms; < 0: none measured) is a slow link's; a rank
// marked in `computing_slowly` (its compute phases score below the threshold) never is.
// round_trip_ms: each rank's window figure; the fastest rank is the one with the lowest
// baseline_ms (each rank's median round trip; empty: round_trip_ms itself).
std::vector<char> slow_links(const std::vector<double>& round_trip_ms, const std::vector<char>& computing_slowly = {},
                             const std::vector<double>& baseline_ms = {});
// The window's figure for a link: the 90th percentile (nearest rank) of its round trips, -1
// when there are none.
double round_trip_figure(std::vector<double> round_trips_ms);

class StragglerMonitor {
 public:
  static constexpr double kThreshold = 0.75;
  // Steps 1..kWarmupSteps are not timed (the same warm-up the hang detection waits out).
  static constexpr int64_t kWarmupSteps = 10;
  // A window also closes once its steps' wall times add up to this many seconds (and it holds
  // at least kMinWindowSteps steps): counted in steps alone, a window of a rank slowed to
  // 1.5 s a step would last 75 s at 50 steps, and a slowdown shorter than two windows would
  // go unnamed. The ranks step together (each waits for the slowest in its collectives), so
  // their windows close at the same step or one apart.
  static constexpr double kWindowSeconds = 10;
  static constexpr int64_t kMinWindowSteps = 3;

  // `store`: a connection of the monitor's own (its thread's operations should time out
  // within seconds: Distributed::connect_side_store). `hosts[r]`: rank r's host (for the
  // reports). window >= 2 steps; window_s: the seconds that close a window sooner.
  StragglerMonitor(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, std::vector<std::string> hosts,
                   int64_t window, double window_s = kWindowSeconds);
  ~StragglerMonitor();
  StragglerMonitor(const StragglerMonitor&) = delete;
  StragglerMonitor& operator=(const StragglerMonitor&) = delete;

  // One step of this rank (1-based step number): its wall time, data wait and time blocked
  // in collectives, in seconds; the heartbeat round trips to the store during it (ms).
  void add_step(int64_t step, double step_s, double data_s, double blocked_s,
                const std::vector<double>& round_trips_ms = {}, const StepPhases& phases = {});
  // Rank 0: the ranks flagged since the last call (two consecutive windows below the
  // threshold; a rank stays reported while it stays slow, once per window).
  std::vector<StragglerReport> take_reports();
  // The latest window's scores (rank 0; empty before the first):
  // [rank][compute, data, forward, backward, optimizer].
  std::vector<std::vector<double>> last_scores();
  // Rank 0: how many windows it has judged.
  int64_t windows_judged();

 private:
  void run();
  void judge(int64_t window_index, int64_t first_step, int64_t last_step);

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, world_;
  std::vector<std::string> hosts_;
  int64_t window_;
  double window_s_;
  double elapsed_s_ = 0;      // this window's steps' wall time so far
  int64_t first_step_ = -1;   // this window's first step (-1: none yet)
  int64_t judged_first_ = -1; // rank 0's thread: the first step of the window judged last
  std::vector<double> compute_, data_, round_trip_;  // this window's steps
  std::vector<double> phase_[3];                      // forward, backward, optimizer
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::pair<int64_t, std::vector<double>>> to_publish_;  // (window index, medians + last step)
  bool stop_ = false;
  int64_t windows_ = 0;
  std::vector<std::vector<char>> below_;  // [rank][phase]: below the threshold in the last window
  std::vector<char> slow_link_;            // [rank]: a slow link in the last window
  std::vector<StragglerReport> reports_;
  std::vector<std::vector<double>> last_scores_;
  int64_t judged_ = 0;
  std::thread thread_;
};

}  // namespace faceshard
