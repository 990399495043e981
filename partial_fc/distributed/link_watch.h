// What one rank sees of the network from its heartbeat thread: the round trips of its
// heartbeats to the rendezvous store, and the peers (or the store) that fell silent while
// one of its collectives waited. The trainer reads it to say who held up a stalled step; the
// straggler monitor reads the round trips to name a slow link (this rank's host <-> the
// store's host); the hang detection reads when the store last answered.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace faceshard {

class LinkWatch {
 public:
  // The store answered a heartbeat at `now_ms` (epoch ms) after `round_trip_ms`.
  void store_answered(int64_t now_ms, double round_trip_ms);
  // Epoch ms of the store's last answer (0: none yet).
  int64_t last_answer_ms() const;
  // While a collective waits: a peer (or, with rank -1, the store) silent for `silent_s`.
  void silent(int rank, double silent_s);
  // This process itself did not run for `s` seconds (stopped, SIGSTOP, or starved of the
  // CPU): the heartbeat thread's own sleep overran by that much. Time this rank spent
  // stopped inside a collective is not a wait for the network or a peer.
  void self_stopped(double s);

  // Every rank's heartbeat as read from the store at `read_ms` (epoch ms): (the beat's
  // epoch ms, its collective count) per rank.
  struct PeerBeats {
    int64_t read_ms = 0;
    std::vector<std::pair<int64_t, int64_t>> beats;
  };
  void peers_read(PeerBeats beats);
  PeerBeats peers() const;

  struct Stall {
    std::map<int, double> silent_s;  // rank (-1: the store) -> the longest silence seen
    double self_stopped_s = 0;       // seconds this process did not run (self_stopped)
    bool empty() const { return silent_s.empty(); }
  };
  // What was seen since the last call, and a fresh start.
  Stall take_stall();
  // The round trips since the last call (ms), in the order they came; empty if the store
  // did not answer.
  std::vector<double> take_round_trips_ms();
  // While scheduled work runs (ScheduledWork): the round trips measured meanwhile are left
  // out of take_round_trips_ms(). A verification that keeps one host's cores busy delays the
  // store's answers to every rank on that host: a measure of the work, not of a link.
  void set_scheduled_work(bool running);

 private:
  mutable std::mutex m_;
  bool scheduled_ = false;
  int64_t last_answer_ms_ = 0;
  std::vector<double> round_trips_;
  Stall stall_;
  PeerBeats peers_;
};

// "rank 1 (host h) was silent for 2.1 s; the rendezvous store (host g) did not answer for
// 2.0 s", or "every rank kept beating" when nobody fell silent.
std::string describe_stall(const LinkWatch::Stall& stall, const std::function<std::string(int)>& host_of,
                           const std::string& store_host);

// Work the training loop schedules on some ranks only: a verification (rank 0 embeds the
// sets while the other ranks wait in its barrier) and a checkpoint (rank 0 also writes the
// backbone). The ranks that wait for it wait in collectives, and that wait is neither a slow
// link nor a slow peer. The trainer brackets the work (scope()); each step is then judged
// (the stall line, the straggler windows) with what fell inside the brackets taken out
// (judged_step()).
class ScheduledWork {
 public:
  // blocked_total_s: this rank's running total of seconds blocked in collectives
  // (Distributed::blocked_seconds_total). links: told while work runs (may be null).
  explicit ScheduledWork(std::function<double()> blocked_total_s, LinkWatch* links = nullptr);

  class Scope {
   public:
    Scope(ScheduledWork& owner, const char* what);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    ScheduledWork& owner_;
  };
  // Brackets one piece of work ("verification", "checkpoint") until the scope ends.
  Scope scope(const char* what) { return Scope(*this, what); }

  // The same with the readings given: the clock (seconds) and the blocked total at each end.
  void begin(const char* what, double now_s, double blocked_total_s);
  void end(double now_s, double blocked_total_s);

  struct Share {
    double wall_s = 0, blocked_s = 0;
    std::string what;  // "verification", "verification and checkpoint", ...; "" when none
  };
  // What fell inside the brackets since the last call, and a fresh start.
  Share take();

 private:
  friend class Scope;
  static double now_s();
  std::function<double()> blocked_total_s_;
  LinkWatch* links_;
  const char* open_ = nullptr;  // the work now running
  double begin_s_ = 0, begin_blocked_s_ = 0;
  Share share_;
};

// A step as the slow-link and straggler judgement sees it: its wall time and its time
// blocked in collectives, less the scheduled work that fell inside it.
struct JudgedStep {
  double step_s = 0, blocked_s = 0;
};
JudgedStep judged_step(double step_s, double blocked_s, const ScheduledWork::Share& scheduled);

// Whether a step that waited `blocked_s` in collectives stalled: at least 1 s, and either
// someone fell silent meanwhile (a beat missed by a second: never the case on a healthy
// network) or the wait was at least 3 times the median step (seconds; 0 while unknown).
bool is_stall(double blocked_s, double median_step_s, bool someone_silent = false);

}  // namespace faceshard
