// Gloo's listening sockets have nothing left to accept once its full mesh has formed (every
// pair connects at start-up), yet they stay open for the whole run, and Gloo holds whatever
// connects to them for good: a connection that sends nothing waits for its first 8 bytes,
// one that sent them is kept in a table, and once the process is out of descriptors the
// next accept ends it. The guard notes, right after the mesh formed, which listening ports
// are Gloo's and which connections on them are the mesh's own; from then on it shuts down
// (shutdown(2): the descriptor stays Gloo's to close) every other connection accepted on
// those ports, within one period of its arrival.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace faceshard {

class GlooPortGuard {
 public:
  // Takes the snapshot now: this process's listening TCP sockets, except those on
  // `other_ports` (the rendezvous store's), are Gloo's.
  GlooPortGuard(const std::vector<int>& other_ports, std::chrono::milliseconds period);
  ~GlooPortGuard();
  GlooPortGuard(const GlooPortGuard&) = delete;
  GlooPortGuard& operator=(const GlooPortGuard&) = delete;

  const std::vector<int>& ports() const { return ports_; }
  int64_t closed() const { return closed_.load(); }
  // One pass now (the thread does one every period).
  void sweep();

 private:
  std::vector<int> ports_;
  std::set<unsigned long> known_;  // socket inodes of the mesh's own connections
  std::set<unsigned long> shut_;   // strangers' connections shut down and still open
  std::atomic<int64_t> closed_{0};
  std::mutex sweep_m_;  // known_ is fixed; shut_ belongs to whoever sweeps
  std::mutex m_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace faceshard
