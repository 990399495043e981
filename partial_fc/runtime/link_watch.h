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
    bool empty() const { return silent_s.empty(); }
  };
  // What was seen since the last call, and a fresh start.
  Stall take_stall();
  // The round trips since the last call (ms), in the order they came; empty if the store
  // did not answer.
  std::vector<double> take_round_trips_ms();

 private:
  mutable std::mutex m_;
  int64_t last_answer_ms_ = 0;
  std::vector<double> round_trips_;
  Stall stall_;
  PeerBeats peers_;
};

// "rank 1 (host h) was silent for 2.1 s; the rendezvous store (host g) did not answer for
// 2.0 s", or "every rank kept beating" when nobody fell silent.
std::string describe_stall(const LinkWatch::Stall& stall, const std::function<std::string(int)>& host_of,
                           const std::string& store_host);

// Whether a step that waited `blocked_s` in collectives stalled: at least 1 s, and either
// someone fell silent meanwhile (a beat missed by a second: never the case on a healthy
// network) or the wait was at least 3 times the median step (seconds; 0 while unknown).
bool is_stall(double blocked_s, double median_step_s, bool someone_silent = false);

}  // namespace faceshard
