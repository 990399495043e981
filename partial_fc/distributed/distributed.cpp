#include "partial_fc/distributed/distributed.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <c10/util/Logging.h>
#include <sys/resource.h>

#include <algorithm>
#include <csignal>
#include <condition_variable>
#include <filesystem>
#include <iomanip>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <sstream>
#include <thread>

#include "base/error.h"
#include "partial_fc/distributed/gloo_port_guard.h"
#include "partial_fc/distributed/guard_store.h"
#include "partial_fc/distributed/job_token.h"
#include "base/log.h"
#include "partial_fc/distributed/network.h"

namespace faceshard {
namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string key_hb(int r) { return "fs/hb/" + std::to_string(r); }
std::string key_host(int r) { return "fs/host/" + std::to_string(r); }

// SIGUSR1 asks every rank's heartbeat thread to write its collective trace.
std::atomic<bool> g_trace_requested{false};
extern "C" void on_trace_signal(int) { g_trace_requested = true; }
std::string key_err(int r) { return "fs/err/" + std::to_string(r); }

std::string to_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& x : v) out += (out.empty() ? "" : ",") + x;
  return out;
}
std::vector<uint8_t> to_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// What the failure diagnosis reads of each peer: its heartbeat (time, collective count)
// at the first and the last look, and the error it published, if any.
struct PeerBeat {
  int64_t first_ms = -1, last_ms = -1, seq = -1;
  std::string err;
};

// The diagnosis's store reads, shared between the reading thread and the rank that waits
// for them with a deadline (the thread may outlive the wait: the state is shared).
class HeartbeatReads {
 public:
  explicit HeartbeatReads(int world_size) : peers_(world_size) {}

  void run(c10d::Store& store, int rank, std::chrono::milliseconds pause) {
    std::string error;
    try {
      store.setTimeout(std::chrono::seconds(5));
      read(store, rank, true);
      std::this_thread::sleep_for(pause);
      read(store, rank, false);
    } catch (const std::exception& e) {
      error = e.what();
      if (error.empty()) error = "store error";
    }
    std::lock_guard<std::mutex> lock(m_);
    error_ = error;
    done_ = true;
    cv_.notify_all();
  }

  // False when the reads did not finish within `timeout`.
  bool wait(std::chrono::milliseconds timeout, std::vector<PeerBeat>& peers, std::string& error) {
    std::unique_lock<std::mutex> lock(m_);
    if (!cv_.wait_for(lock, timeout, [&] { return done_; })) return false;
    peers = peers_;
    error = error_;
    return true;
  }

 private:
  void read(c10d::Store& store, int rank, bool first) {
    for (int r = 0; r < static_cast<int>(peers_.size()); ++r) {
      if (r == rank) continue;
      std::istringstream is(to_string(store.get(key_hb(r))));
      int64_t ms = 0, seq = 0;
      is >> ms >> seq;
      std::string err = peers_[r].err.empty() && store.check({key_err(r)}) ? to_string(store.get(key_err(r))) : "";
      std::lock_guard<std::mutex> lock(m_);
      PeerBeat& p = peers_[r];
      if (first) p.first_ms = ms;
      p.last_ms = ms;
      p.seq = seq;
      if (p.err.empty()) p.err = err;
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  std::vector<PeerBeat> peers_;
};

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
    default: return c10d::ReduceOp::SUM;
  }
}

c10::intrusive_ptr<c10d::Store> connect_store(const DistEnv& env, bool server, std::chrono::milliseconds timeout) {
  c10::intrusive_ptr<c10d::Store> store;
  // torchrun's agent hosts its own TCPStore; otherwise rank 0 hosts faceshard's, which lets
  // in the job's members only (guard_store.h) and listens on MASTER_ADDR's address alone (a
  // loopback address keeps a one-host job off the network).
  const std::string token = env.agent_store ? std::string() : job_token().secret;
  try {
    if (env.agent_store) {
      c10d::TCPStoreOptions o;
      o.port = static_cast<uint16_t>(env.master_port);
      o.isServer = false;
      o.numWorkers = std::nullopt;
      o.waitWorkers = false;
      o.timeout = timeout;
      store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
    } else {
      std::shared_ptr<GuardStoreServer> host;
      if (server)
        host = std::make_shared<GuardStoreServer>(listen_socket(resolve_ipv4(env.master_addr), env.master_port), token);
      store = c10::make_intrusive<GuardStore>(env.master_addr, env.master_port, token, timeout, host);
    }
  } catch (const std::exception& e) {
    // A master name that means this very host here cannot be the other hosts' master.
    std::string hint;
    if (!server && env.local_world_size < env.world_size) {
      try {
        const std::string ip = resolve_ipv4(env.master_addr);
        if (is_loopback_ipv4(ip))
          hint = " (MASTER_ADDR '" + env.master_addr + "' is " + ip +
                 " on this host: give every host the master's address, e.g. torchrun's --local-addr on each node)";
      } catch (const Error&) {
      }
    }
    if (server) throw runtime_error("rank 0 cannot host the rendezvous store on port ", env.master_port, ": ", one_line(e));
    if (env.agent_store)
      throw runtime_error("cannot reach the rendezvous store at ", env.master_addr, ":", env.master_port, hint, ": ",
                          one_line(e));
    throw runtime_error(one_line(e), " (rank 0 hosts it)", hint);
  }
  if (env.agent_store) {
    store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(env.restart_count), store);
  }
  return c10::make_intrusive<c10d::PrefixStore>("faceshard", store);
}

// A fatal error is usually reported after the Distributed object is gone (its scope was
// left by the exception), so the connection used to publish it outlives the object.
std::mutex g_fatal_mutex;
c10::intrusive_ptr<c10d::Store> g_fatal_store;
// Rank 0's store, kept past its Distributed object when the job failed (see linger_for_peers).
c10::intrusive_ptr<c10d::Store> g_fatal_server;
int g_fatal_rank = 0;
// The trace a fatal error writes (set by set_trace_dir).
std::shared_ptr<CollectiveTrace> g_fatal_trace;
std::string g_fatal_trace_path, g_fatal_host;
int g_fatal_world = 1;
bool g_fatal_hosts_store = false;
std::chrono::milliseconds g_fatal_beat{500};

// Rank 0 hosts the store that the other ranks' failure diagnosis reads. Before it exits on
// an error it stays, bounded, until every other rank has published its own error or stopped
// beating, so that they name the rank that failed first rather than the vanished store host.
// (Ranks blocked in a collective keep beating until their own timeout: the bound applies.)
void linger_for_peers(c10d::Store& store) {
  const auto stale_after = g_fatal_beat * 3;
  const auto deadline = Clock::now() + stale_after + std::chrono::seconds(10);
  std::vector<std::string> beat(g_fatal_world);
  std::vector<Clock::time_point> changed(g_fatal_world, Clock::now());
  while (Clock::now() < deadline) {
    bool settled = true;
    for (int r = 0; r < g_fatal_world; ++r) {
      if (r == g_fatal_rank || store.check({key_err(r)})) continue;
      std::string b = store.check({key_hb(r)}) ? to_string(store.get(key_hb(r))) : "";
      if (b != beat[r]) beat[r] = b, changed[r] = Clock::now();
      if (Clock::now() - changed[r] < stale_after) settled = false;
    }
    if (settled) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// Installed as the fatal-error hook (error.h) so that a rank's fatal error reaches the others.
void publish_fatal_to_peers(const std::string& line) {
  std::lock_guard<std::mutex> lock(g_fatal_mutex);
  if (g_fatal_trace && !g_fatal_trace_path.empty())
    g_fatal_trace->write(g_fatal_trace_path, g_fatal_rank, g_fatal_world, g_fatal_host, line);
  if (!g_fatal_store) return;
  try {
    g_fatal_store->set(key_err(g_fatal_rank), to_bytes(line));
    if (g_fatal_hosts_store) linger_for_peers(*g_fatal_store);
  } catch (...) {
  }
}

// The backstop of rendezvous: whatever still blocks a stage a little past the rendezvous
// timeout (a TCPStore client waits for a frozen store host's answer with no deadline of its
// own, already in its constructor) ends this rank with one line naming the stage.
class RendezvousDeadline {
 public:
  RendezvousDeadline(const DistEnv& env, std::chrono::milliseconds limit) {
    thread_ = std::thread([this, limit, addr = env.master_addr, port = env.master_port, rank = env.rank,
                           agent = env.agent_store] {
      std::unique_lock<std::mutex> lock(m_);
      while (!done_) {
        const auto until = since_ + limit;
        if (Clock::now() >= until)
          exit_fatal(detail::concat("rendezvous at ", addr, ":", port, " failed on rank ", rank, " (", stage_,
                                    "): still blocked after ",
                                    std::chrono::duration_cast<std::chrono::seconds>(limit).count(),
                                    " s: the rendezvous store or a peer does not answer",
                                    agent ? "" : " (rank 0 hosts the store: a frozen or cut-off rank 0 leaves every rank here)"));
        cv_.wait_until(lock, until);
      }
    });
  }
  ~RendezvousDeadline() {
    {
      std::lock_guard<std::mutex> lock(m_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Each stage has the whole limit of its own.
  void stage(const char* what) {
    std::lock_guard<std::mutex> lock(m_);
    stage_ = what;
    since_ = Clock::now();
    cv_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  const char* stage_ = "store connect";
  Clock::time_point since_ = Clock::now();
  std::thread thread_;
};

// The heartbeat thread: every interval it writes this rank's beat (epoch ms and collective
// count) and makes one round trip to the store, which proves the store still answers (a
// set is not answered). While a collective has waited a second or more, that round trip
// reads every rank's beat (the hang check judges them), as it does while silent_peer() asks
// for them (a wait outside the collectives). Its connection's requests fail
// within a few beats, after which it connects afresh; a request that blocks for good (a
// partition) blocks only this thread, which is never joined.
void beat_loop(DistEnv env, std::chrono::milliseconds interval, std::shared_ptr<LinkWatch> links,
               std::shared_ptr<CollectiveTrace> trace, std::shared_ptr<std::atomic<int64_t>> seq,
               std::shared_ptr<std::atomic<bool>> stop, std::shared_ptr<std::atomic<int64_t>> peers_wanted_until) {
  const auto timeout = std::max(interval * 4, std::chrono::milliseconds(2000));
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r) keys.push_back(key_hb(r));
  c10::intrusive_ptr<c10d::Store> beat;
  while (!*stop) {
    try {
      if (!beat) beat = connect_store(env, false, timeout);
      const auto t0 = Clock::now();
      beat->set(key_hb(env.rank), to_bytes(std::to_string(now_ms()) + " " + std::to_string(seq->load())));
      const std::optional<CollectiveRecord> pending = trace->oldest_pending();
      if ((pending && now_ms() - pending->issued_ms >= 1000) || now_ms() < peers_wanted_until->load()) {
        LinkWatch::PeerBeats peers;
        for (const auto& v : beat->multiGet(keys)) {
          std::istringstream is(to_string(v));
          int64_t ms = 0, n = 0;
          is >> ms >> n;
          peers.beats.emplace_back(ms, n);
        }
        peers.read_ms = now_ms();
        links->peers_read(std::move(peers));
      } else {
        beat->check({key_hb(env.rank)});
      }
      links->store_answered(now_ms(), std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    } catch (...) {
      beat.reset();  // the store host may be gone or cut off: the hang check judges it
    }
    const auto until = Clock::now() + interval;
    while (!*stop && Clock::now() < until) {
      // A 20 ms sleep that lasted over a second more: this process was not running (stopped
      // or starved), which the trainer does not count as a wait for the network.
      const auto t = Clock::now();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      const double over = std::chrono::duration<double>(Clock::now() - t).count() - 0.02;
      if (over >= 1.0) links->self_stopped(over);
    }
  }
}

// Gloo ends the process when an accept finds no descriptor left, and each peer, stranger
// or member, holds a few: the soft limit on open files goes up to the hard one.
void allow_many_descriptors() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur >= r.rlim_max) return;
  const rlim_t before = r.rlim_cur;
  r.rlim_cur = r.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &r) == 0)
    log_debug("open files: the soft limit went from ", before, " to ", r.rlim_cur);
}

std::string join_ints(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s.empty() ? "none" : s;
}

}  // namespace

int cuda_device_of(const DistEnv& env, CudaBackend backend) {
  if (backend == CudaBackend::Nccl) return env.local_rank;
  const int n = static_cast<int>(torch::cuda::device_count());
  return n > 0 ? env.local_rank % n : env.local_rank;
}

Distributed::Distributed(const DistEnv& env, const DistOptions& opts) : env_(env), opts_(opts) {}

std::shared_ptr<Distributed> Distributed::init(const DistEnv& env, const DistOptions& opts) {
  std::shared_ptr<Distributed> d(new Distributed(env, opts));
  set_log_rank(env.rank, env.world_size);
  // LibTorch's store warnings span a C++ backtrace each; the runtime reports failures in one
  // line itself. TORCH_CPP_LOG_LEVEL still wins when set.
  if (!std::getenv("TORCH_CPP_LOG_LEVEL")) FLAGS_caffe2_log_level = 2;
  if (env.world_size > 1 || opts.use_cuda) {
    // Decided before anything connects: a MASTER_ADDR that does not resolve fails at once.
    const NetworkPlan net = plan_network(env, std::getenv("GLOO_SOCKET_IFNAME"), std::getenv("NCCL_SOCKET_IFNAME"));
    if (env.local_rank == 0 && env.world_size > 1)
      log_notice("network: Gloo on ", net.gloo_interfaces.empty() ? net.gloo_address : "interfaces " + join(net.gloo_interfaces),
                 ": ", net.reason);
    const bool host = !env.agent_store && env.rank == 0;
    const JobToken& token = job_token();  // a bad token file is a usage error before anything connects
    if (env.rank == 0 && env.local_world_size < env.world_size) {
      if (env.agent_store)
        log_notice("network: the rendezvous store is torchrun's: it lets in anyone who reaches ", env.master_addr, ":",
                   env.master_port, " (keep that port private to the job's hosts)");
      else if (token.empty())
        log_notice("network: no FACESHARD_JOB_TOKEN: the rendezvous store at ", env.master_addr, ":", env.master_port,
                   " lets in any faceshard process that reaches it; set FACESHARD_JOB_TOKEN or FACESHARD_JOB_TOKEN_FILE",
                   " on every host to keep other jobs out");
    }
    allow_many_descriptors();
    // A peer that dies leaves sockets that a write then finds closed: that must be an error
    // this rank reports naming the peer (Gloo writes without MSG_NOSIGNAL), not SIGPIPE.
    std::signal(SIGPIPE, SIG_IGN);
    RendezvousDeadline deadline(env, opts.rendezvous_timeout + std::chrono::seconds(5));
    try {
      d->store_ = connect_store(env, host, opts.rendezvous_timeout);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::Usage || host) throw;
      throw runtime_error("rendezvous at ", env.master_addr, ":", env.master_port, " failed on rank ", env.rank,
                          " (store connect): ", e.what());
    }
    d->hb_store_ = connect_store(env, false, opts.rendezvous_timeout);
    {
      // From here on a fatal error of this rank reaches the others (also during rendezvous).
      std::lock_guard<std::mutex> lock(g_fatal_mutex);
      g_fatal_store = connect_store(env, false, opts.rendezvous_timeout);
      g_fatal_rank = env.rank;
      g_fatal_world = env.world_size;
      g_fatal_hosts_store = host;
      g_fatal_beat = opts.heartbeat_interval;
    }
    set_fatal_hook(&publish_fatal_to_peers);
    // Host names alone may repeat (containers, namespaces): a job of several hosts adds the
    // address its collectives use.
    const std::string me = env.local_world_size < env.world_size && !net.gloo_address.empty()
                               ? this_host() + " (" + net.gloo_address + ")"
                               : this_host();
    d->hb_store_->set(key_host(env.rank), to_bytes(me));
    d->hb_store_->set(key_hb(env.rank), to_bytes(std::to_string(now_ms()) + " 0"));
    std::signal(SIGUSR1, on_trace_signal);
    std::thread(beat_loop, env, opts.heartbeat_interval, d->links_, d->trace_, d->seq_, d->beat_stop_,
                d->peers_wanted_until_).detach();
    d->watch_ = std::thread([p = d.get()] { p->watch_loop(); });
    deadline.stage("Gloo full mesh");
    d->rendezvous("Gloo full mesh", [&] {
      d->gloo_ = make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("gloo", d->store_), env.rank, env.world_size,
                                   net, opts.rendezvous_timeout);
    });
    // The mesh has formed: whatever connects to Gloo's ports from now on is no member.
    d->gloo_guard_ = std::make_shared<GlooPortGuard>(host ? std::vector<int>{env.master_port} : std::vector<int>{},
                                                     std::chrono::milliseconds(250));
    log_debug("Gloo listens on port(s) ", join_ints(d->gloo_guard_->ports()), "; later connections to them are closed");
    // Every rank published its host before the mesh formed: read them all in one request.
    try {
      std::vector<std::string> keys;
      for (int r = 0; r < env.world_size; ++r) keys.push_back(key_host(r));
      std::vector<std::string> hosts;
      for (const auto& v : d->store_->multiGet(keys)) hosts.push_back(to_string(v));
      std::lock_guard<std::mutex> lock(d->trace_mutex_);
      d->hosts_ = std::move(hosts);
    } catch (const std::exception& e) {
      log_debug("the ranks' host names: ", one_line(e));
    }
    if (opts.use_cuda && opts.cuda_backend == CudaBackend::Gloo) {
      if (!nccl_compiled()) throw usage_error("CUDA requested but faceshard was built without CUDA support");
      const int device = cuda_device_of(env, CudaBackend::Gloo);
      bind_cuda_device(device, env.local_rank);
      if (env.local_rank == 0)
        log_notice("dist.backend gloo: CUDA tensors go over Gloo through host memory (no NCCL); local rank ",
                   env.local_rank, " on GPU ", device, " of ", torch::cuda::device_count(),
                   env.local_world_size > static_cast<int>(torch::cuda::device_count()) ? " (ranks share GPUs)" : "");
    } else if (opts.use_cuda) {
      if (!nccl_compiled()) throw usage_error("CUDA requested but faceshard was built without CUDA support");
      if (!net.nccl_interface.empty()) {
        setenv("NCCL_SOCKET_IFNAME", net.nccl_interface.c_str(), 1);
        if (env.local_rank == 0) log_notice("network: NCCL_SOCKET_IFNAME=", net.nccl_interface, " (", net.reason, ")");
      }
      deadline.stage("NCCL communicator");
      d->rendezvous("NCCL communicator", [&] {
        d->nccl_ = make_nccl_backend(c10::make_intrusive<c10d::PrefixStore>("nccl", d->store_), env.rank,
                                     env.world_size, env.local_rank, opts.timeout);
      });
    }
  }
  log_debug("distributed runtime up: ", env.describe());
  return d;
}

void Distributed::rendezvous(const char* what, const std::function<void()>& connect) {
  // A peer that fails to join publishes its error (the fatal hook), and a peer that dies
  // stops its heartbeat; this rank, blocked in `connect` until the rendezvous timeout (or,
  // in NCCL's communicator set-up, for good), stops instead and names it.
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    c10::intrusive_ptr<c10d::Store> store;
    try {
      store = connect_store(env_, false, opts_.rendezvous_timeout);
    } catch (const std::exception&) {
      return;  // the store host is gone: `connect` fails by itself
    }
    const std::string where = detail::concat("rendezvous at ", env_.master_addr, ":", env_.master_port,
                                             " failed on rank ", env_.rank, " (", what, "): ");
    // A heartbeat that has not moved for this long belongs to a process that is gone.
    const auto silent_limit = std::max(opts_.heartbeat_interval * 10, std::chrono::milliseconds(3000));
    std::vector<std::string> last_beat(env_.world_size);
    std::vector<Clock::time_point> since(env_.world_size, Clock::now());
    std::unique_lock<std::mutex> lock(mu);
    while (!cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return done; })) {
      std::string peer_error;
      int peer = -1;
      try {
        for (int r = 0; r < env_.world_size && peer < 0; ++r) {
          if (r == env_.rank) continue;
          if (store->check({key_err(r)})) {
            peer = r, peer_error = "rank " + std::to_string(r) + " failed: " + to_string(store->get(key_err(r)));
          } else if (store->check({key_hb(r)})) {
            std::string beat = to_string(store->get(key_hb(r)));
            if (beat != last_beat[r]) last_beat[r] = beat, since[r] = Clock::now();
            else if (Clock::now() - since[r] > silent_limit)
              peer = r, peer_error = "rank " + std::to_string(r) + " died (its heartbeat stopped)";
          }
        }
      } catch (const std::exception&) {
        // Rank 0 hosts the store: it failed or exited, and nobody can join any more.
        exit_fatal(where + (env_.agent_store ? "the rendezvous store is gone"
                                             : "the rendezvous store is gone (rank 0 hosts it: rank 0 failed or exited)"));
      }
      if (peer >= 0) exit_fatal(where + peer_error);
    }
  });
  auto stop = [&] {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
    }
    cv.notify_all();
    watchdog.join();
  };
  try {
    connect();
  } catch (const std::exception& e) {
    stop();
    // Which ranks never arrived, and what did the others say?
    std::string missing, causes;
    try {
      for (int r = 0; r < env_.world_size; ++r) {
        if (!hb_store_->check({key_hb(r)})) missing += (missing.empty() ? "" : ",") + std::to_string(r);
        if (r != env_.rank && hb_store_->check({key_err(r)}))
          causes += "; rank " + std::to_string(r) + " failed: " + to_string(hb_store_->get(key_err(r)));
      }
    } catch (const std::exception&) {
      causes += "; the rendezvous store is gone";
    }
    failed_ = true;
    throw runtime_error("rendezvous at ", env_.master_addr, ":", env_.master_port, " failed on rank ", env_.rank, " (",
                        what, ")", missing.empty() ? "" : ": ranks never joined: " + missing, causes, " [",
                        one_line(e), "]");
  }
  stop();
}

Distributed::~Distributed() {
  // Leaving scope through an exception: no barrier (the peers learn of the failure from
  // the error this rank publishes next, or from its silence).
  if (std::uncaught_exceptions() > 0) failed_ = true;
  try {
    if (!shut_down_) shutdown();
  } catch (const std::exception& e) {
    log_warn("distributed shutdown: ", one_line(e));
  }
  stop_ = true;
  *beat_stop_ = true;
  if (watch_.joinable()) watch_.join();
}

void Distributed::watch_loop() {
  while (!stop_) {
    if (g_trace_requested.exchange(false)) {
      const bool ok = write_trace("SIGUSR1");
      log_info("SIGUSR1: collective trace ", ok ? "written to " + trace_dir_ : std::string("not written (no folder)"));
    }
    check_for_hang();
    for (int k = 0; k < 12 && !stop_; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::chrono::milliseconds Distributed::hang_limit() const {
  const double step = step_seconds_.load();
  if (step <= 0) return opts_.timeout;
  const auto scaled = std::chrono::milliseconds(static_cast<int64_t>((3.0 * step + 5.0) * 1000));
  return std::min(opts_.timeout, std::max(opts_.hang_floor, scaled));
}

void Distributed::check_for_hang() {
  // Any phase once the pace is known (a checkpoint's or a verification's collectives too):
  // only a peer that has stopped beating is judged, and a slow but live one never is. No
  // store request here: the heartbeat thread reads, this judges what it read.
  if (env_.world_size <= 1 || failed_ || step_seconds_.load() <= 0) return;
  const std::optional<CollectiveRecord> pending = trace_->oldest_pending();
  if (!pending) return;
  const double waited_ms = static_cast<double>(now_ms()) - pending->issued_ms;
  if (waited_ms < 1000) return;
  // A collective that waits: who is silent meanwhile (the trainer names them for a stalled
  // step; the hang check below, when the wait passes the limit)?
  const auto silent_after = std::max(opts_.heartbeat_interval * 6, std::chrono::milliseconds(3000));
  const bool store_here = !env_.agent_store && env_.rank == 0;
  const int64_t answered = links_->last_answer_ms();
  const int64_t store_silent_ms = store_here || answered == 0 ? 0 : now_ms() - answered;
  if (store_silent_ms >= 1000) links_->silent(-1, store_silent_ms / 1000.0);
  std::vector<std::string> culprits;
  // The peers' beats, as read during this wait (an older read says nothing of it).
  const LinkWatch::PeerBeats peers = links_->peers();
  if (peers.read_ms >= pending->issued_ms && static_cast<int>(peers.beats.size()) == env_.world_size) {
    for (int r = 0; r < env_.world_size; ++r) {
      if (r == env_.rank) continue;
      const auto [ms, seq] = peers.beats[r];
      const int64_t silent_ms = peers.read_ms - ms;
      if (silent_ms >= 1000 && seq <= pending->seq) links_->silent(r, silent_ms / 1000.0);
      // Silent, and not past this collective (its heartbeat may lag its counter by a beat).
      if (seq <= pending->seq && silent_ms >= silent_after.count())
        culprits.push_back("rank " + std::to_string(r) + " died (no heartbeat for " +
                           std::to_string(silent_ms / 100 / 10.0).substr(0, 4) + " s: dead, frozen or cut off; host " +
                           host_of(r) + ") and " + (seq < pending->seq ? "never entered it" : "stopped inside it") +
                           " (its last heartbeat was at #" + std::to_string(seq) + ")");
    }
  }
  const auto limit = hang_limit();
  if (waited_ms < static_cast<double>(limit.count()) || limit >= opts_.timeout) return;
  // This rank cannot reach the store's host: a partition, or that host froze.
  if (culprits.empty() && store_silent_ms >= silent_after.count())
    culprits.push_back("no answer from the rendezvous store " + env_.master_addr + ":" +
                       std::to_string(env_.master_port) + " for " + std::to_string(store_silent_ms / 100 / 10.0).substr(0, 4) +
                       " s: this host is cut off from host " + store_host() +
                       (env_.agent_store ? " (the agent's store)" : " (rank 0 hosts it), or rank 0 is frozen"));
  if (culprits.empty()) return;
  std::ostringstream os;
  os << pending->kind << " #" << pending->seq << " failed on rank " << env_.rank << " (host " << host_of(env_.rank)
     << ", step " << pending->step << ", " << pending->phase << "): waited " << std::fixed << std::setprecision(1)
     << waited_ms / 1000 << " s, more than 3 x the median step (" << std::setprecision(3) << step_seconds_.load()
     << " s) + 5 s = " << std::setprecision(1) << limit.count() / 1000.0 << " s; ";
  for (size_t k = 0; k < culprits.size(); ++k) os << (k ? "; " : "") << culprits[k];
  failed_ = true;
  write_trace(os.str());
  exit_fatal(os.str());
}

std::string Distributed::silent_peer(const std::vector<int>& ranks, int64_t since_ms) {
  const auto silent_after = std::max(opts_.heartbeat_interval * 6, std::chrono::milliseconds(3000));
  // The heartbeat thread reads the beats for the next few intervals (each call extends it).
  peers_wanted_until_->store(now_ms() + 4 * opts_.heartbeat_interval.count());
  const LinkWatch::PeerBeats peers = links_->peers();
  if (peers.read_ms < since_ms || static_cast<int>(peers.beats.size()) != env_.world_size) return "";
  for (int r : ranks) {
    if (r == env_.rank || r < 0 || r >= env_.world_size) continue;
    const int64_t silent_ms = peers.read_ms - peers.beats[static_cast<size_t>(r)].first;
    if (silent_ms >= silent_after.count())
      return "rank " + std::to_string(r) + " (host " + host_of(r) + "): no heartbeat for " +
             std::to_string(silent_ms / 100 / 10.0).substr(0, 4) + " s: dead, frozen or cut off";
  }
  return "";
}

int64_t Distributed::clock_ms() { return now_ms(); }

std::string Distributed::store_host() {
  return env_.agent_store ? env_.master_addr : host_of(0);
}

c10::intrusive_ptr<c10d::Store> Distributed::connect_side_store(std::chrono::milliseconds timeout) const {
  return connect_store(env_, false, timeout);
}

std::vector<std::string> Distributed::hosts() {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  return hosts_;
}

std::string Distributed::host_of(int rank) {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  if (rank < 0 || rank >= static_cast<int>(hosts_.size()) || hosts_[rank].empty()) return "?";
  return hosts_[rank];
}

void Distributed::set_trace_dir(const std::string& dir) {
  {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    trace_dir_ = dir;
  }
  std::lock_guard<std::mutex> lock(g_fatal_mutex);
  g_fatal_trace = trace_;
  g_fatal_trace_path = dir.empty() ? "" : dir + "/rank" + std::to_string(env_.rank) + ".jsonl";
  g_fatal_host = this_host();
  g_fatal_rank = env_.rank;
  g_fatal_world = env_.world_size;
}

bool Distributed::write_trace(const std::string& reason) {
  std::string dir;
  {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    dir = trace_dir_;
  }
  if (dir.empty()) return false;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  return trace_->write(dir + "/rank" + std::to_string(env_.rank) + ".jsonl", env_.rank, env_.world_size, this_host(),
                       reason);
}

void Distributed::publish_failure(const std::string& message) {
  if (!hb_store_ || env_.world_size <= 1) return;
  try {
    hb_store_->set(key_err(env_.rank), to_bytes(message));
  } catch (...) {
  }
}

std::string Distributed::diagnose(const std::string& what, const std::string& error) {
  std::ostringstream os;
  os << what << " failed on rank " << env_.rank << ": ";
  if (env_.world_size <= 1 || !hb_store_) {
    os << error;
    return os.str();
  }
  // Watch the heartbeats for a few intervals: a dead rank's stops moving. A store host that
  // is frozen (rank 0 stopped, or its machine cut off) answers nothing, and a TCPStore
  // client waits for an answer with no deadline: the reads run on a thread of their own,
  // which this rank leaves behind when they take too long. They use the rendezvous
  // connection, idle once the backends are up (a connection serves one request at a time:
  // the heartbeat's keeps beating meanwhile).
  auto reads = std::make_shared<HeartbeatReads>(env_.world_size);
  std::thread([reads, store = store_, rank = env_.rank, pause = opts_.heartbeat_interval * 3] {
    reads->run(*store, rank, pause);
  }).detach();
  const auto answer_within = opts_.heartbeat_interval * 3 + std::chrono::seconds(5);
  std::vector<PeerBeat> peers;
  std::string store_error;
  if (!reads->wait(answer_within, peers, store_error)) {
    os << "the rendezvous store " << env_.master_addr << ":" << env_.master_port << " did not answer within "
       << std::chrono::duration_cast<std::chrono::seconds>(answer_within).count() << " s"
       << (env_.agent_store ? "" : " (rank 0 hosts it: rank 0 is frozen or cut off)") << "; " << error;
    return os.str();
  }
  if (!store_error.empty()) {
    os << "the rendezvous store " << env_.master_addr << ":" << env_.master_port << " is gone"
       << (env_.agent_store ? "" : " (rank 0 hosts it: rank 0 died or exited)") << "; " << error;
    return os.str();
  }
  std::vector<std::string> causes;
  // A rank that published an error that is not itself a communication failure threw first.
  for (int r = 0; r < env_.world_size; ++r)
    if (!peers[r].err.empty() && peers[r].err.find("failed on rank") == std::string::npos)
      causes.push_back("rank " + std::to_string(r) + " failed: " + peers[r].err + " (on host " + host_of(r) + ")");
  if (causes.empty())
    for (int r = 0; r < env_.world_size; ++r)
      if (r != env_.rank && peers[r].err.empty() && peers[r].last_ms == peers[r].first_ms)
        causes.push_back("rank " + std::to_string(r) + " died (no heartbeat for " +
                         std::to_string((now_ms() - peers[r].last_ms) / 1000.0).substr(0, 4) + " s, host " + host_of(r) +
                         ")");
  if (causes.empty()) {
    const int64_t mine = seq_->load();
    for (int r = 0; r < env_.world_size; ++r)
      if (r != env_.rank && peers[r].seq < mine && peers[r].err.empty())
        causes.push_back("rank " + std::to_string(r) + " did not join collective #" + std::to_string(mine) +
                         " (it is at #" + std::to_string(peers[r].seq) + ", host " + host_of(r) + ")");
  }
  if (causes.empty()) {
    os << error;
  } else {
    for (size_t i = 0; i < causes.size(); ++i) os << (i ? "; " : "") << causes[i];
    os << " [" << error << "]";
  }
  return os.str();
}

c10d::Backend& Distributed::backend_for(const at::Tensor& t) {
  if (t.is_cuda() && nccl_) return *nccl_;
  return *gloo_;
}

int64_t Distributed::begin_collective(const char* what, const at::Tensor& t) {
  const int64_t seq = ++*seq_;
  trace_->begin(seq, what, t.is_cuda() && nccl_ ? "nccl" : "gloo", std::string(c10::toString(t.scalar_type())),
                t.numel());
  return seq;
}

template <typename F>
void Distributed::run_collective(const char* what, const at::Tensor& t, F&& launch) {
  if (failed_) throw runtime_error(what, ": an earlier collective failed on this rank");
  const int64_t seq = begin_collective(what, t);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = launch();
  } catch (const std::exception& e) {
    failed_ = true;
    const std::string line = diagnose(what, one_line(e));
    write_trace(line);
    throw runtime_error(line);
  }
  {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    async_seq_[work.get()] = seq;
  }
  wait(work, what, t.is_cuda());
}

void Distributed::wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what, bool on_gpu) {
  const auto t0 = Clock::now();
  struct Blocked {
    std::atomic<int64_t>& us;
    Clock::time_point t0;
    ~Blocked() { us += std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count(); }
  } blocked{blocked_us_, t0};
  try {
    // NCCL: a wait with a timeout blocks the host until the GPU is done; without one it only
    // orders the current stream after the collective, and NCCL's watchdog enforces the
    // backend's timeout. Gloo (CPU) works carry their own per-operation timeout as well.
    if (on_gpu && nccl_) work->wait();
    else work->wait(opts_.timeout);
  } catch (const std::exception& e) {
    failed_ = true;
    const std::string line = diagnose(what, one_line(e));
    write_trace(line);
    throw runtime_error(line);
  }
  // Finished (on a GPU: ordered on the stream; the trace's time is the host's).
  int64_t seq = -1;
  {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    auto it = async_seq_.find(work.get());
    if (it != async_seq_.end()) seq = it->second, async_seq_.erase(it);
  }
  if (seq >= 0) trace_->end(seq);
}

void Distributed::all_reduce(at::Tensor& t, ReduceOp op) {
  if (env_.world_size == 1) return;
  TORCH_CHECK(t.is_contiguous(), "all_reduce needs a contiguous tensor");
  run_collective("all_reduce", t, [&] {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    o.timeout = opts_.timeout;
    return backend_for(t).allreduce(v, o);
  });
}

c10::intrusive_ptr<c10d::Work> Distributed::all_reduce_async(at::Tensor& t) {
  TORCH_CHECK(env_.world_size > 1, "all_reduce_async needs more than one rank");
  TORCH_CHECK(t.is_contiguous(), "all_reduce_async needs a contiguous tensor");
  const int64_t seq = begin_collective("all_reduce", t);
  try {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.timeout = opts_.timeout;
    c10::intrusive_ptr<c10d::Work> work = backend_for(t).allreduce(v, o);
    std::lock_guard<std::mutex> lock(trace_mutex_);
    async_seq_[work.get()] = seq;
    return work;
  } catch (const std::exception& e) {
    failed_ = true;
    const std::string line = diagnose("all_reduce", one_line(e));
    write_trace(line);
    throw runtime_error(line);
  }
}

void Distributed::broadcast(at::Tensor& t, int root) {
  if (env_.world_size == 1) return;
  TORCH_CHECK(t.is_contiguous(), "broadcast needs a contiguous tensor");
  run_collective("broadcast", t, [&] {
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = opts_.timeout;
    return backend_for(t).broadcast(v, o);
  });
}

at::Tensor Distributed::all_gather(const at::Tensor& t_in, std::vector<int64_t>* counts_out) {
  at::Tensor t = t_in.contiguous();
  const int W = env_.world_size;
  if (W == 1) {
    if (counts_out) *counts_out = {t.size(0)};
    return t;
  }
  // Row counts first (ranks may differ), then one gather of blocks padded to the largest.
  at::Tensor n = torch::zeros({W}, torch::kLong);
  n[env_.rank] = t.size(0);
  all_reduce(n);
  std::vector<int64_t> counts(n.data_ptr<int64_t>(), n.data_ptr<int64_t>() + W);
  if (counts_out) *counts_out = counts;
  const int64_t mx = *std::max_element(counts.begin(), counts.end());
  auto shape = t.sizes().vec();
  shape[0] = mx;
  at::Tensor block = t;
  if (t.size(0) < mx) {
    auto pad = shape;
    pad[0] = mx - t.size(0);
    block = torch::cat({t, torch::zeros(pad, t.options())});
  }
  auto out_shape = shape;
  out_shape[0] = mx * W;
  at::Tensor out = torch::empty(out_shape, t.options());
  run_collective("all_gather", block, [&] {
    c10d::AllgatherOptions o;
    o.timeout = opts_.timeout;
    return backend_for(t)._allgather_base(out, block, o);
  });
  bool equal = std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == mx; });
  if (equal) return out;
  std::vector<at::Tensor> parts;
  for (int r = 0; r < W; ++r) parts.push_back(out.narrow(0, r * mx, counts[r]));
  return torch::cat(parts);
}

at::Tensor Distributed::reduce_scatter(const at::Tensor& in_t, const std::vector<int64_t>& counts) {
  const int W = env_.world_size;
  TORCH_CHECK(static_cast<int>(counts.size()) == W, "reduce_scatter: one count per rank expected");
  at::Tensor in = in_t.contiguous();
  if (W == 1) return in;
  if (in.is_cuda() && !nccl_) {
    // Gloo and CUDA: LibTorch's Gloo has CUDA works for all_reduce, broadcast, all_gather,
    // gather, scatter, reduce and all_to_all, none for reduce-scatter. Staged through the
    // host here with two blocking copies (the copy out waits for the current stream's work;
    // the copy back, from pageable memory, returns once the host's bytes are taken), so the
    // CPU path below computes the same sums as a CPU run does.
    return reduce_scatter(in.cpu(), counts).to(in.device());
  }
  const int64_t mx = *std::max_element(counts.begin(), counts.end());
  bool equal = std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == mx; });
  at::Tensor padded = in;
  if (!equal) {
    auto shape = in.sizes().vec();
    shape[0] = mx * W;
    padded = torch::zeros(shape, in.options());
    int64_t off = 0;
    for (int r = 0; r < W; ++r) {
      padded.narrow(0, r * mx, counts[r]).copy_(in.narrow(0, off, counts[r]));
      off += counts[r];
    }
  }
  auto shape = in.sizes().vec();
  shape[0] = mx;
  at::Tensor out = torch::empty(shape, in.options());
  if (in.is_cuda() && nccl_) {
    run_collective("reduce_scatter", padded, [&] {
      c10d::ReduceScatterOptions o;
      o.timeout = opts_.timeout;
      return nccl_->_reduce_scatter_base(out, padded, o);
    });
  } else {
    // Gloo's reduce-scatter takes a list of blocks.
    std::vector<at::Tensor> outs{out};
    std::vector<std::vector<at::Tensor>> ins(1);
    for (int r = 0; r < W; ++r) ins[0].push_back(padded.narrow(0, r * mx, mx));
    run_collective("reduce_scatter", padded, [&] {
      c10d::ReduceScatterOptions o;
      o.timeout = opts_.timeout;
      return gloo_->reduce_scatter(outs, ins, o);
    });
  }
  return equal ? out : out.narrow(0, 0, counts[env_.rank]);
}

void Distributed::barrier() {
  if (env_.world_size == 1) return;
  at::Tensor t = torch::zeros({1});
  all_reduce(t);
}

void Distributed::shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (env_.world_size <= 1 && !nccl_) return;
  if (!failed_) {
    barrier();
    // The store host must outlive every client's last use of it.
    store_->add("exit", 1);
    if (!env_.agent_store && env_.rank == 0) {
      auto deadline = Clock::now() + opts_.timeout;
      while (store_->add("exit", 0) < env_.world_size && Clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  stop_ = true;
  *beat_stop_ = true;
  if (watch_.joinable()) watch_.join();
  if (nccl_) nccl_->shutdown();
  std::lock_guard<std::mutex> lock(g_fatal_mutex);
  if (!failed_) g_fatal_store.reset();
  else if (g_fatal_hosts_store) g_fatal_server = store_;  // the other ranks still read it
}

}  // namespace faceshard
