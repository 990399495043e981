// The rendezvous store's server: one thread, poll() over the listening socket and every
// connection (guard_store.h).
#include "partial_fc/distributed/guard_store.h"

#include <poll.h>
#include <netinet/tcp.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <list>
#include <thread>
#include <unordered_map>

#include <c10/util/Exception.h>

#include "base/error.h"
#include "partial_fc/distributed/guard_store_wire.h"
#include "base/log.h"
#include "partial_fc/distributed/network.h"

namespace faceshard {
using namespace guard_wire;

struct GuardStoreServer::Impl {
  struct Conn {
    int fd = -1;
    bool member = false;
    Clock::time_point deadline;  // pending connections only
    std::string nonce, in, out, peer;
    bool waiting = false;  // a request that waits for keys is held in `held`
    std::string held;
    bool close_after_write = false;
  };

  int listen_fd = -1;
  int wake[2] = {-1, -1};
  std::string token;
  std::atomic<bool> stop{false};
  std::thread thread;
  mutable std::mutex stats_mutex;
  GuardStoreStats st;
  std::unordered_map<std::string, std::string> kv;
  std::list<Conn> conns;
  Clock::time_point listen_paused_until{};
  int64_t next_report = 10;
  Clock::time_point last_refusal{};
  int64_t summed_up = 0;  // refusals the last "in all" line counted

  void refuse(std::list<Conn>::iterator it, const char* why) {
    int64_t n = 0;
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      n = ++st.refused;
    }
    // The first, then at 10, 100, 1000, ...: a flood costs the log a few lines.
    if (n == 1)
      log_warn("network: the rendezvous store closed a connection from ", it->peer, " (", why,
               "): it closes every connection that does not present the job's token within ",
               kHandshakeDeadline.count(), " ms");
    else if (n == next_report)
      log_warn("network: the rendezvous store has closed ", n, " connections that did not present the job's token");
    if (n >= next_report) next_report *= 10;
    last_refusal = Clock::now();
    ::close(it->fd);
    conns.erase(it);
  }

  void drop(std::list<Conn>::iterator it) {
    ::close(it->fd);
    conns.erase(it);
  }

  size_t pending_count() const {
    size_t n = 0;
    for (const auto& c : conns) n += c.member ? 0 : 1;
    return n;
  }

  void accept_all() {
    for (;;) {
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors: the oldest pending connection goes, or the listener rests.
          auto oldest = std::find_if(conns.begin(), conns.end(), [](const Conn& c) { return !c.member; });
          if (oldest != conns.end()) refuse(oldest, "out of file descriptors");
          else listen_paused_until = Clock::now() + std::chrono::milliseconds(100);
        }
        return;  // EAGAIN, or an error that the next poll retries
      }
      if (pending_count() >= kMaxPending) {
        auto oldest = std::find_if(conns.begin(), conns.end(), [](const Conn& c) { return !c.member; });
        if (oldest != conns.end()) refuse(oldest, "too many connections without the token");
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      Conn c;
      c.fd = fd;
      c.deadline = Clock::now() + kHandshakeDeadline;
      c.nonce = random_bytes(kNonce);
      c.peer = peer_name(fd);
      c.out.assign(kMagic, sizeof kMagic);
      c.out.push_back(static_cast<char>(kVersion));
      c.out += c.nonce;
      conns.push_back(std::move(c));
    }
  }

  // The member's answer to the greeting: refuses anything else.
  bool handshake(std::list<Conn>::iterator it) {
    Conn& c = *it;
    const size_t head = std::min(c.in.size(), sizeof kMagic + 1);
    std::string expect(kMagic, sizeof kMagic);
    expect.push_back(static_cast<char>(kVersion));
    if (c.in.compare(0, head, expect, 0, head) != 0) {
      refuse(it, "not a faceshard store member");
      return false;
    }
    if (c.in.size() < kAnswer) return true;
    const std::string want = proof(token, kClientLabel, c.nonce);
    if (!digests_equal(reinterpret_cast<const uint8_t*>(c.in.data() + 5), reinterpret_cast<const uint8_t*>(want.data()),
                       want.size())) {
      refuse(it, "it did not present the job's token");
      return false;
    }
    const std::string member_nonce = c.in.substr(5 + 32, kNonce);
    c.in.erase(0, kAnswer);
    c.member = true;
    c.out += proof(token, kServerLabel, member_nonce);
    std::lock_guard<std::mutex> lock(stats_mutex);
    ++st.members;
    return true;
  }

  static std::string ok() { return std::string(1, static_cast<char>(kOk)); }
  static std::string failed(const std::string& why) {
    std::string r(1, static_cast<char>(kFailed));
    put_str(r, why);
    return r;
  }

  bool all_present(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!kv.count(k)) return false;
    return true;
  }

  // Answers one request (`reply` empty: a set, which is not answered), or returns false
  // when it waits for keys. `mutated` is set when the request changed the store (held
  // requests are looked at again).
  bool answer(const std::string& body, std::string& reply, bool& mutated) {
    Reader r(body);
    const uint8_t op = r.u8();
    switch (op) {
      case kSet: {
        std::string k = r.str(), v = r.str();
        r.end();
        kv[k] = std::move(v);
        mutated = true;
        reply.clear();  // a set is not answered (a member that is failing must not wait on it)
        return true;
      }
      case kGet: {
        std::string k = r.str();
        r.end();
        auto f = kv.find(k);
        if (f == kv.end()) return false;
        reply = ok();
        put_str(reply, f->second);
        return true;
      }
      case kCompareSet: {
        std::string k = r.str(), expected = r.str(), desired = r.str();
        r.end();
        auto f = kv.find(k);
        reply = ok();
        if (f == kv.end()) {
          if (expected.empty()) {
            kv[k] = desired;
            mutated = true;
            put_str(reply, desired);
          } else {
            put_str(reply, expected);
          }
        } else if (f->second == expected) {
          f->second = desired;
          mutated = true;
          put_str(reply, desired);
        } else {
          put_str(reply, f->second);
        }
        return true;
      }
      case kAdd: {
        std::string k = r.str();
        const int64_t delta = r.i64();
        r.end();
        int64_t v = 0;
        auto f = kv.find(k);
        if (f != kv.end()) {
          try {
            size_t used = 0;
            v = std::stoll(f->second, &used);
            if (used != f->second.size()) throw std::invalid_argument("");
          } catch (const std::exception&) {
            reply = failed("add: the value of '" + detail::printable(k) + "' is not a number");
            return true;
          }
        }
        v = static_cast<int64_t>(static_cast<uint64_t>(v) + static_cast<uint64_t>(delta));
        kv[k] = std::to_string(v);
        mutated = true;
        reply = ok();
        put_i64(reply, v);
        return true;
      }
      case kDelete: {
        std::string k = r.str();
        r.end();
        reply = ok();
        reply.push_back(static_cast<char>(kv.erase(k) ? 1 : 0));
        return true;
      }
      case kCheck: {
        const auto keys = r.keys();
        r.end();
        reply = ok();
        reply.push_back(static_cast<char>(all_present(keys) ? 1 : 0));
        return true;
      }
      case kNumKeys: {
        r.end();
        reply = ok();
        put_i64(reply, static_cast<int64_t>(kv.size()));
        return true;
      }
      case kWait: {
        const auto keys = r.keys();
        r.end();
        if (!all_present(keys)) return false;
        reply = ok();
        return true;
      }
      case kAppend: {
        std::string k = r.str(), v = r.str();
        r.end();
        kv[k] += v;
        mutated = true;
        reply = ok();
        return true;
      }
      case kMultiGet: {
        const auto keys = r.keys();
        r.end();
        if (!all_present(keys)) return false;
        reply = ok();
        put_u32(reply, static_cast<uint32_t>(keys.size()));
        for (const auto& k : keys) put_str(reply, kv.at(k));
        return true;
      }
      case kMultiSet: {
        const auto keys = r.keys();
        const uint32_t n = r.u32();
        if (n != keys.size()) throw Malformed{};
        std::vector<std::string> values;
        for (uint32_t i = 0; i < n; ++i) values.push_back(r.str());
        r.end();
        for (uint32_t i = 0; i < n; ++i) kv[keys[i]] = std::move(values[i]);
        mutated = true;
        reply = ok();
        return true;
      }
      default:
        throw Malformed{};
    }
  }

  // Runs the complete frames a member sent (one at a time: a member waits for each answer).
  bool serve(std::list<Conn>::iterator it, bool& mutated) {
    Conn& c = *it;
    while (!c.waiting && c.in.size() >= 4) {
      uint32_t n = 0;
      for (int i = 0; i < 4; ++i) n |= uint32_t(static_cast<uint8_t>(c.in[i])) << (8 * i);
      if (n > kMaxFrame) {
        log_warn("network: rendezvous store: a member at ", c.peer, " sent a request of ", n,
                 " bytes (the limit is ", kMaxFrame, "): connection closed");
        drop(it);
        return false;
      }
      if (c.in.size() < 4 + size_t(n)) break;
      std::string body = c.in.substr(4, n);
      c.in.erase(0, 4 + size_t(n));
      std::string reply;
      try {
        if (answer(body, reply, mutated)) {
          if (!reply.empty()) c.out += frame(reply);
        } else {
          c.waiting = true;
          c.held = std::move(body);
        }
      } catch (const Malformed&) {
        log_warn("network: rendezvous store: a malformed request from ", c.peer, ": connection closed");
        drop(it);
        return false;
      }
    }
    return true;
  }

  // Requests waiting for keys that now exist are answered.
  void release_held() {
    bool again = true;
    while (again) {
      again = false;
      for (auto& c : conns) {
        if (!c.waiting) continue;
        std::string reply;
        bool mutated = false;
        try {
          if (answer(c.held, reply, mutated)) {
            c.waiting = false;
            c.held.clear();
            c.out += frame(reply);
          }
        } catch (const Malformed&) {
          c.waiting = false;
          c.close_after_write = true;
        }
        again = again || mutated;
      }
    }
  }

  bool flush(std::list<Conn>::iterator it) {
    Conn& c = *it;
    while (!c.out.empty()) {
      const ssize_t n = ::send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.out.erase(0, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (n < 0 && errno == EINTR) continue;
      if (c.member) drop(it);
      else refuse(it, "it went away");
      return false;
    }
    if (c.close_after_write) {
      drop(it);
      return false;
    }
    return true;
  }

  // Reads what arrived; false when the connection is gone.
  bool receive(std::list<Conn>::iterator it, bool& mutated) {
    Conn& c = *it;
    char buf[65536];
    for (;;) {
      // Before the handshake a connection may send the answer and nothing more.
      const size_t room = c.member ? sizeof buf : std::min(sizeof buf, kAnswer + 1 - std::min(kAnswer + 1, c.in.size()));
      if (room == 0) break;
      const ssize_t n = ::recv(c.fd, buf, room, 0);
      if (n == 0) {
        // A member's last requests (a set, sent just before it closed) still count.
        if (!c.member) refuse(it, "it closed before the handshake");
        else if (serve(it, mutated)) drop(it);  // (serve drops it itself on a malformed request)
        return false;
      }
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        if (c.member) drop(it);
        else refuse(it, std::strerror(errno));
        return false;
      }
      c.in.append(buf, static_cast<size_t>(n));
      if (!c.member) {
        if (!handshake(it)) return false;
        if (!c.member) continue;
      }
      if (c.in.size() > kMaxFrame + 4 + sizeof buf) break;  // serve what is there first
    }
    if (!c.member && c.in.size() > kAnswer) {
      refuse(it, "it sent more than the handshake");
      return false;
    }
    return c.member ? serve(it, mutated) : true;
  }

  void run() {
    std::vector<pollfd> fds;
    std::vector<std::list<Conn>::iterator> of;
    while (!stop) {
      const auto now = Clock::now();
      // A burst of refusals is summed up once it has been quiet for a second: the lines above
      // come at the 1st, 10th, 100th...; this one says how many in all, once per burst.
      if (st.refused != summed_up && now - last_refusal >= std::chrono::seconds(1)) {
        summed_up = st.refused;  // (written by this thread alone)
        log_warn("network: the rendezvous store has refused ", summed_up, summed_up == 1 ? " connection" : " connections",
                 " in all that did not present the job's token");
      }
      // Pending connections past their deadline are refused.
      for (auto it = conns.begin(); it != conns.end();) {
        auto next = std::next(it);
        if (!it->member && now >= it->deadline) refuse(it, "no token within the handshake's deadline");
        it = next;
      }
      fds.clear();
      of.clear();
      fds.push_back({wake[0], POLLIN, 0});
      const bool listening = now >= listen_paused_until;
      fds.push_back({listening ? listen_fd : -1, POLLIN, 0});
      auto next_deadline = now + std::chrono::milliseconds(250);
      if (!listening) next_deadline = std::min(next_deadline, listen_paused_until);
      for (auto it = conns.begin(); it != conns.end(); ++it) {
        // Read even while a request waits for keys: a member that gave up closes.
        short ev = POLLIN;
        if (!it->out.empty()) ev |= POLLOUT;
        fds.push_back({it->fd, ev, 0});
        of.push_back(it);
        if (!it->member) next_deadline = std::min(next_deadline, it->deadline);
      }
      const auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline - now).count() + 1;
      const int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait_ms, 0)));
      if (rc < 0) {
        if (errno == EINTR) continue;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (fds[0].revents) {
        char b[64];
        while (::read(wake[0], b, sizeof b) > 0) {
        }
      }
      bool mutated = false;
      for (size_t i = 0; i < of.size(); ++i) {
        const short re = fds[i + 2].revents;
        if (!re) continue;
        auto it = of[i];
        if (re & (POLLIN | POLLHUP | POLLERR)) {
          if (!receive(it, mutated)) continue;
        }
        if (!it->out.empty()) flush(it);
      }
      if (mutated) release_held();
      for (auto it = conns.begin(); it != conns.end();) {
        auto next = std::next(it);
        if (!it->out.empty() || it->close_after_write) flush(it);
        it = next;
      }
      if (fds[1].revents & POLLIN) {
        accept_all();
        for (auto it = conns.begin(); it != conns.end();) {
          auto next = std::next(it);
          if (!it->member && !it->out.empty()) flush(it);
          it = next;
        }
      }
      std::lock_guard<std::mutex> lock(stats_mutex);
      st.open = static_cast<int64_t>(conns.size());
      st.keys = static_cast<int64_t>(kv.size());
    }
  }
};

GuardStoreServer::GuardStoreServer(int listen_fd, std::string token) : impl_(new Impl) {
  impl_->listen_fd = listen_fd;
  impl_->token = std::move(token);
  ::fcntl(listen_fd, F_SETFL, ::fcntl(listen_fd, F_GETFL) | O_NONBLOCK);
  if (::pipe2(impl_->wake, O_NONBLOCK | O_CLOEXEC) != 0) {
    ::close(listen_fd);
    throw runtime_error("rendezvous store: cannot make a pipe: ", std::strerror(errno));
  }
  impl_->thread = std::thread([p = impl_.get()] { p->run(); });
}

GuardStoreServer::~GuardStoreServer() {
  impl_->stop = true;
  const char b = 1;
  if (::write(impl_->wake[1], &b, 1) < 0) {
  }
  impl_->thread.join();
  for (auto& c : impl_->conns) ::close(c.fd);
  ::close(impl_->listen_fd);
  ::close(impl_->wake[0]);
  ::close(impl_->wake[1]);
}

int GuardStoreServer::port() const { return local_port(impl_->listen_fd); }

GuardStoreStats GuardStoreServer::stats() const {
  std::lock_guard<std::mutex> lock(impl_->stats_mutex);
  return impl_->st;
}

}  // namespace faceshard
