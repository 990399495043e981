// The distributed runtime: TCPStore rendezvous, a Gloo backend for CPU tensors and an
// NCCL backend for CUDA tensors (one GPU per rank; or Gloo for them too, see CudaBackend),
// blocking collectives with a timeout,
// and failure diagnosis: when a collective fails, the error names the rank that died,
// hung or threw, using heartbeats every rank publishes in the store.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/torch.h>

#include "partial_fc/distributed/collective_trace.h"
#include "partial_fc/distributed/dist_env.h"
#include "partial_fc/distributed/link_watch.h"

namespace faceshard {

// What carries CUDA tensors (dist.backend). Nccl: one GPU per rank. Gloo: the CUDA tensors
// go over Gloo's TCP transport through host memory, so that several ranks may share one GPU
// (the only multi-rank CUDA run a one-GPU machine can do: NCCL refuses two ranks on one
// device). Gloo has CUDA implementations of all_reduce (every ReduceOp), broadcast and
// all_gather, which copy to pinned host memory on a stream of their own, ordered after the
// caller's current stream, and back; reduce_scatter is staged through the host by
// Distributed itself (see there). Far slower than NCCL: a check, not a way to train.
enum class CudaBackend { Nccl, Gloo };

// The GPU a rank uses: its local rank; with Gloo carrying CUDA tensors, local ranks beyond
// the visible GPUs wrap around (local rank mod GPU count), so that ranks share GPUs.
int cuda_device_of(const DistEnv& env, CudaBackend backend);

struct DistOptions {
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // each collective
  // All ranks joining: the store connection, Gloo's full mesh, NCCL's communicator. A rank
  // that cannot complete it exits within this time naming what failed.
  std::chrono::milliseconds rendezvous_timeout{std::chrono::seconds(300)};
  std::chrono::milliseconds heartbeat_interval{500};
  // Bind this rank's GPU (cuda_device_of) and, with cuda_backend Nccl, create an NCCL backend.
  bool use_cuda = false;
  CudaBackend cuda_backend = CudaBackend::Nccl;
  // Hang detection, once set_step_seconds() has a measured step time: a collective pending
  // for longer than 3 x the median step + 5 s (at least hang_floor, at most `timeout`) while
  // a rank not past it has stopped beating (frozen, or its host cut off) ends this rank at
  // once, naming that rank and its host. A slow rank that beats is waited for.
  std::chrono::milliseconds hang_floor{std::chrono::seconds(5)};
};

enum class ReduceOp { Sum, Max, Min };

class Distributed {
 public:
  // Joins the job described by env (a single process needs no store and no network).
  static std::shared_ptr<Distributed> init(const DistEnv& env, const DistOptions& opts = {});
  ~Distributed();
  Distributed(const Distributed&) = delete;
  Distributed& operator=(const Distributed&) = delete;

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  int local_rank() const { return env_.local_rank; }
  const DistEnv& env() const { return env_; }
  const DistOptions& options() const { return opts_; }
  bool has_nccl() const { return static_cast<bool>(nccl_); }
  c10::intrusive_ptr<c10d::Store> store() const { return store_; }

  // Blocking collectives (in place where it makes sense). All tensors must be contiguous.
  void all_reduce(at::Tensor& t, ReduceOp op = ReduceOp::Sum);
  void broadcast(at::Tensor& t, int root = 0);
  // Gathers along dim 0; rows may differ per rank. counts (optional) receives every
  // rank's row count.
  at::Tensor all_gather(const at::Tensor& t, std::vector<int64_t>* counts = nullptr);
  // Rows of `in` are the concatenation of every rank's block (block r has counts[r] rows);
  // returns the element-wise sum over ranks of this rank's block. A CUDA tensor without NCCL
  // goes through host memory (Gloo's CPU reduce-scatter, the same sums as a CPU run).
  at::Tensor reduce_scatter(const at::Tensor& in, const std::vector<int64_t>& counts);
  void barrier();

  // Asynchronous all-reduce (SUM) for overlapping communication with computation; finish
  // it with wait(), which applies the timeout and the failure diagnosis.
  c10::intrusive_ptr<c10d::Work> all_reduce_async(at::Tensor& t);
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what, bool on_gpu = false);

  // Orderly end of the job: all ranks meet, the store host stays up until every rank has
  // left. Called by the destructor when not called explicitly.
  void shutdown();

  // Records this rank's fatal error in the store so the other ranks can name it.
  void publish_failure(const std::string& message);

  // The ring of this rank's last collectives (collective_trace.h). set_trace_dir() names the
  // folder its file goes to (rank<r>.jsonl) when a collective fails or hangs, on SIGUSR1
  // and at a fatal error; without one nothing is written.
  CollectiveTrace& trace() { return *trace_; }
  void set_trace_dir(const std::string& dir);
  bool write_trace(const std::string& reason);
  // What the next collectives belong to: a training step (1-based) and its phase
  // ("forward", "backward", "optimizer", "step"), or another part of the run ("checkpoint",
  // "validation", ...): the trace records it.
  void set_context(int64_t step, const char* phase) { trace_->set_context(step, phase); }
  // The median step time measured so far (seconds; 0: none yet): the hang detection's scale.
  void set_step_seconds(double seconds) { step_seconds_ = seconds; }
  // How long a collective of a step may wait while a peer that has not entered it is silent.
  std::chrono::milliseconds hang_limit() const;
  // For a wait outside the training's collectives (the background checkpoint's agreement
  // through the store) that began at `since_ms` (the clock of now_ms): of `ranks`, the first
  // whose heartbeat, as read since then, has been silent as long as a collective's hang check
  // requires, described ("rank 1 (host h): no heartbeat for 6.5 s: dead, frozen or cut off");
  // "" when none is (or no read since `since_ms` says so).
  std::string silent_peer(const std::vector<int>& ranks, int64_t since_ms);
  // The clock the trace and the heartbeat reads use (ms).
  static int64_t clock_ms();
  // The host each rank reported at start-up: its name and, on a job of several hosts, the
  // address its collectives use ("node7 (10.0.0.7)"; "?" when unknown).
  std::string host_of(int rank);
  // The host of the rendezvous store (rank 0's, or MASTER_ADDR under an agent's store).
  std::string store_host();
  // What the heartbeat thread saw of the network: store round trips, silent peers.
  LinkWatch& links() { return *links_; }
  std::vector<std::string> hosts();
  // A connection of its own to the rendezvous store, for a helper thread that must never
  // wait long: its operations fail after `timeout` (a frozen or vanished store host).
  c10::intrusive_ptr<c10d::Store> connect_side_store(std::chrono::milliseconds timeout) const;
  // Seconds this rank's host spent blocked waiting for collectives since the last call.
  double take_blocked_seconds() {
    const int64_t now = blocked_us_.load(), since = now - taken_us_;
    taken_us_ = now;
    return static_cast<double>(since) * 1e-6;
  }
  // All of it since the start (seconds).
  double blocked_seconds_total() const { return static_cast<double>(blocked_us_.load()) * 1e-6; }

  // Explains a failed collective: which rank died, threw, or hung.
  std::string diagnose(const std::string& what, const std::string& error);

 private:
  Distributed(const DistEnv& env, const DistOptions& opts);
  c10d::Backend& backend_for(const at::Tensor& t);
  template <typename F>
  void run_collective(const char* what, const at::Tensor& t, F&& launch);
  int64_t begin_collective(const char* what, const at::Tensor& t);
  void check_for_hang();
  // Runs one step of joining the job (`connect` blocks until every rank is there or the
  // rendezvous timeout passes) with a watchdog for peers that fail meanwhile.
  void rendezvous(const char* what, const std::function<void()>& connect);
  void watch_loop();

  DistEnv env_;
  DistOptions opts_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Store> hb_store_;  // separate connection for the heartbeat thread
  c10::intrusive_ptr<c10d::Backend> gloo_;
  c10::intrusive_ptr<c10d::Backend> nccl_;
  std::shared_ptr<class GlooPortGuard> gloo_guard_;  // closes strangers' connections to Gloo's ports
  // Shared with the heartbeat thread, which is never joined: in a partition a store request
  // can block for good, and the job must still be able to end.
  std::shared_ptr<std::atomic<int64_t>> seq_ = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<std::atomic<bool>> beat_stop_ = std::make_shared<std::atomic<bool>>(false);
  // Until when (now_ms) the heartbeat thread reads the peers' beats although no collective
  // waits: silent_peer() asks for them.
  std::shared_ptr<std::atomic<int64_t>> peers_wanted_until_ = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<CollectiveTrace> trace_ = std::make_shared<CollectiveTrace>();
  std::mutex trace_mutex_;  // trace_dir_, async_seq_, hosts_
  std::string trace_dir_;
  std::map<const c10d::Work*, int64_t> async_seq_;
  std::vector<std::string> hosts_;
  std::atomic<double> step_seconds_{0};
  std::atomic<int64_t> blocked_us_{0};  // grows only
  int64_t taken_us_ = 0;                  // take_blocked_seconds()'s last reading
  std::shared_ptr<LinkWatch> links_ = std::make_shared<LinkWatch>();
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  bool shut_down_ = false;
  std::thread watch_;  // the hang check and SIGUSR1, from what the heartbeat thread saw
};

// Backend factories (gloo_backend.cpp, nccl_backend.cpp).
struct NetworkPlan;
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, const NetworkPlan& net,
                                                    std::chrono::milliseconds rendezvous_timeout);
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, int device, std::chrono::milliseconds timeout);
bool nccl_compiled();
// Makes GPU `device` this process's current one; a usage error naming the local rank when
// it is not visible (or the build has no CUDA).
void bind_cuda_device(int device, int local_rank);

}  // namespace faceshard
