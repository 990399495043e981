// The rendezvous store's members: one connection, one request at a time (guard_store.h).
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

// ---------------------------------------------------------------------------------------
// The member's side: one connection, one request at a time.

namespace {

// Waits until `fd` is ready for `events` or `until` passes (false).
bool ready(int fd, short events, Clock::time_point until) {
  for (;;) {
    const auto now = Clock::now();
    int ms = -1;
    if (until != Clock::time_point::max()) {
      if (now >= until) return false;
      ms = static_cast<int>(std::min<int64_t>(
          std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count() + 1, 1 << 30));
    }
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, ms);
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) return true;  // the following call reports the error
  }
}

enum class Io { Ok, Timeout, Closed, Failed };

Io send_all(int fd, const std::string& s, Clock::time_point until, int& err) {
  size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::send(fd, s.data() + done, s.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!ready(fd, POLLOUT, until)) return Io::Timeout;
      continue;
    }
    err = errno;
    return Io::Failed;
  }
  return Io::Ok;
}

Io recv_all(int fd, std::string& out, size_t n, Clock::time_point until, int& err) {
  out.resize(n);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::recv(fd, &out[done], n - done, 0);
    if (r > 0) {
      done += static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return Io::Closed;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!ready(fd, POLLIN, until)) return Io::Timeout;
      continue;
    }
    err = errno;
    return Io::Failed;
  }
  return Io::Ok;
}

Clock::time_point deadline_in(std::chrono::milliseconds d) {
  if (d <= std::chrono::milliseconds::zero()) return Clock::time_point::max();  // kNoTimeout
  return Clock::now() + d;
}

[[noreturn]] void fail_network(const std::string& msg) { C10_THROW_ERROR(DistNetworkError, msg); }
[[noreturn]] void fail_store(const std::string& msg) { C10_THROW_ERROR(DistStoreError, msg); }

}  // namespace

GuardStore::GuardStore(std::string host, int port, std::string token, std::chrono::milliseconds timeout,
                       std::shared_ptr<GuardStoreServer> server)
    : c10d::Store(timeout), host_(std::move(host)), port_(port), token_(std::move(token)), server_(std::move(server)) {
  std::lock_guard<std::mutex> lock(m_);
  connect_locked(timeout_);
}

GuardStore::~GuardStore() {
  std::lock_guard<std::mutex> lock(m_);
  drop_locked();
}

void GuardStore::drop_locked() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void GuardStore::connect_locked(std::chrono::milliseconds within) {
  const std::string where = "the rendezvous store at " + host_ + ":" + std::to_string(port_);
  const std::string ip = resolve_ipv4(host_);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port_));
  ::inet_pton(AF_INET, ip.c_str(), &sa.sin_addr);
  const auto until = deadline_in(within);
  auto pause = std::chrono::milliseconds(50);
  int refusals = 0;
  std::string last = "nothing answered";
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) fail_network(where + ": cannot make a socket: " + std::strerror(errno));
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int err = 0;
    bool connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0;
    if (!connected && errno == EINPROGRESS) {
      // Each attempt has a few seconds at most: a dropped SYN is tried again.
      const auto attempt = std::min(until, Clock::now() + std::chrono::seconds(5));
      if (ready(fd, POLLOUT, attempt)) {
        socklen_t len = sizeof err;
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        connected = err == 0;
      } else {
        err = ETIMEDOUT;
      }
    } else if (!connected) {
      err = errno;
    }
    if (connected) {
      // The greeting, our proof and nonce, the store's proof.
      std::string greeting, server_proof;
      // The store greets at once; a port that stays silent is tried again.
      Io io = recv_all(fd, greeting, kGreeting, std::min(until, Clock::now() + std::chrono::seconds(10)), err);
      if (io == Io::Ok) {
        if (greeting.compare(0, 4, std::string(kMagic, 4)) != 0 || static_cast<uint8_t>(greeting[4]) != kVersion) {
          ::close(fd);
          fail_network(where + " answered like no faceshard store (another program, or another version of faceshard, "
                               "listens on that port)");
        }
        const std::string nonce = random_bytes(kNonce);
        std::string answer(kMagic, 4);
        answer.push_back(static_cast<char>(kVersion));
        answer += proof(token_, kClientLabel, greeting.substr(5, kNonce));
        answer += nonce;
        io = send_all(fd, answer, until, err);
        if (io == Io::Ok) io = recv_all(fd, server_proof, kServerProof, until, err);
        if (io == Io::Ok) {
          const std::string want = proof(token_, kServerLabel, nonce);
          if (!digests_equal(reinterpret_cast<const uint8_t*>(server_proof.data()),
                             reinterpret_cast<const uint8_t*>(want.data()), want.size())) {
            ::close(fd);
            fail_network(where + " belongs to another job: it does not know this job's token");
          }
          fd_ = fd;
          return;
        }
        if (io == Io::Closed && ++refusals >= 3) {
          ::close(fd);
          fail_network(where + " refused this process: its job token (FACESHARD_JOB_TOKEN or FACESHARD_JOB_TOKEN_FILE) "
                               "is not rank 0's, or the port belongs to another job");
        }
      }
      last = io == Io::Timeout  ? "the connection was accepted but nothing answered (the store's host frozen or overloaded?)"
             : io == Io::Closed ? "the store closed the connection"
                                : std::strerror(err);
    } else {
      last = std::strerror(err);
    }
    ::close(fd);
    if (Clock::now() + pause >= until)
      fail_network("cannot reach the rendezvous store at " + host_ + ":" + std::to_string(port_) + ": " + last);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(1000));
  }
}

std::string GuardStore::call(const std::string& request, const char* what, const std::string& key,
                             std::optional<std::chrono::milliseconds> wait_for) {
  std::lock_guard<std::mutex> lock(m_);
  const std::string where = "rendezvous store at " + host_ + ":" + std::to_string(port_) + ": " + what +
                            (key.empty() ? "" : " '" + detail::printable(key) + "'");
  if (fd_ < 0) connect_locked(timeout_);
  int err = 0;
  const auto send_until = deadline_in(timeout_);
  Io io = send_all(fd_, frame(request), send_until, err);
  std::string head, body;
  // A request answers within the store's timeout; one that waits for keys, within its wait.
  const auto until = wait_for ? deadline_in(*wait_for) : send_until;
  const auto limit = wait_for ? *wait_for : timeout_;
  if (io == Io::Ok) io = recv_all(fd_, head, 4, until, err);
  if (io == Io::Ok) {
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i) n |= uint32_t(static_cast<uint8_t>(head[i])) << (8 * i);
    if (n == 0 || n > kMaxFrame) {
      drop_locked();
      fail_network(where + ": a malformed answer");
    }
    io = recv_all(fd_, body, n, until, err);
  }
  if (io != Io::Ok) {
    drop_locked();
    if (io == Io::Timeout)
      fail_store(where + ": no answer within " + std::to_string(limit.count()) + " ms");
    fail_network(where + ": " + (io == Io::Closed ? std::string("the store closed the connection") : std::strerror(err)));
  }
  if (static_cast<uint8_t>(body[0]) != kOk) {
    std::string why = "failed";
    try {
      Reader r(body);
      r.u8();
      why = r.str();
    } catch (const Malformed&) {
    }
    fail_store(where + ": " + why);
  }
  return body.substr(1);
}

namespace {
std::string op_key(Op op, const std::string& key) {
  std::string s(1, static_cast<char>(op));
  put_str(s, key);
  return s;
}
std::string op_keys(Op op, const std::vector<std::string>& keys) {
  std::string s(1, static_cast<char>(op));
  put_keys(s, keys);
  return s;
}
std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

template <typename T, typename F>
T parse(const std::string& body, F&& f) {
  try {
    Reader r(body);
    T v = f(r);
    r.end();
    return v;
  } catch (const Malformed&) {
    fail_network("rendezvous store: a malformed answer");
  }
}
}  // namespace

c10::intrusive_ptr<c10d::Store> GuardStore::clone() {
  return c10::make_intrusive<GuardStore>(host_, port_, token_, timeout_, server_);
}

void GuardStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  std::string req = op_key(kSet, key);
  put_bytes(req, value);
  // Not answered (as TCPStore's): a rank publishing its failure to a frozen or cut-off store
  // host must not wait for it. The requests that follow on this connection see the value.
  std::lock_guard<std::mutex> lock(m_);
  if (fd_ < 0) connect_locked(timeout_);
  int err = 0;
  const Io io = send_all(fd_, frame(req), deadline_in(timeout_), err);
  if (io != Io::Ok) {
    drop_locked();
    fail_network("rendezvous store at " + host_ + ":" + std::to_string(port_) + ": set '" + detail::printable(key) +
                 "': " + (io == Io::Timeout ? std::string("the store takes nothing") : std::strerror(err)));
  }
}

std::vector<uint8_t> GuardStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                            const std::vector<uint8_t>& desired) {
  std::string req = op_key(kCompareSet, key);
  put_bytes(req, expected);
  put_bytes(req, desired);
  return parse<std::vector<uint8_t>>(call(req, "compareSet", key, std::nullopt),
                                     [](Reader& r) { return bytes_of(r.str()); });
}

std::vector<uint8_t> GuardStore::get(const std::string& key) {
  return parse<std::vector<uint8_t>>(call(op_key(kGet, key), "get", key, std::optional<std::chrono::milliseconds>(timeout_)),
                                     [](Reader& r) { return bytes_of(r.str()); });
}

int64_t GuardStore::add(const std::string& key, int64_t value) {
  std::string req = op_key(kAdd, key);
  put_i64(req, value);
  return parse<int64_t>(call(req, "add", key, std::nullopt), [](Reader& r) { return r.i64(); });
}

bool GuardStore::deleteKey(const std::string& key) {
  return parse<bool>(call(op_key(kDelete, key), "deleteKey", key, std::nullopt),
                     [](Reader& r) { return r.u8() != 0; });
}

bool GuardStore::check(const std::vector<std::string>& keys) {
  return parse<bool>(call(op_keys(kCheck, keys), "check", keys.empty() ? "" : keys[0], std::nullopt),
                     [](Reader& r) { return r.u8() != 0; });
}

int64_t GuardStore::getNumKeys() {
  return parse<int64_t>(call(std::string(1, static_cast<char>(kNumKeys)), "getNumKeys", "", std::nullopt),
                        [](Reader& r) { return r.i64(); });
}

void GuardStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void GuardStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  const std::string reply = call(op_keys(kWait, keys), "wait", keys.empty() ? "" : keys[0], std::optional<std::chrono::milliseconds>(timeout));
  if (!reply.empty()) fail_network("rendezvous store: a malformed answer");
}

void GuardStore::append(const std::string& key, const std::vector<uint8_t>& value) {
  std::string req = op_key(kAppend, key);
  put_bytes(req, value);
  call(req, "append", key, std::nullopt);
}

std::vector<std::vector<uint8_t>> GuardStore::multiGet(const std::vector<std::string>& keys) {
  return parse<std::vector<std::vector<uint8_t>>>(
      call(op_keys(kMultiGet, keys), "multiGet", keys.empty() ? "" : keys[0], std::optional<std::chrono::milliseconds>(timeout_)), [&](Reader& r) {
        const uint32_t n = r.u32();
        if (n != keys.size()) throw Malformed{};
        std::vector<std::vector<uint8_t>> out;
        for (uint32_t i = 0; i < n; ++i) out.push_back(bytes_of(r.str()));
        return out;
      });
}

void GuardStore::multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) {
  if (keys.size() != values.size()) fail_store("multiSet: " + std::to_string(keys.size()) + " keys but " +
                                               std::to_string(values.size()) + " values");
  std::string req = op_keys(kMultiSet, keys);
  put_u32(req, static_cast<uint32_t>(values.size()));
  for (const auto& v : values) put_bytes(req, v);
  call(req, "multiSet", keys.empty() ? "" : keys[0], std::nullopt);
}

}  // namespace faceshard

