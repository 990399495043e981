// faceshard's rendezvous store: a c10d::Store whose server lets in the job's members only.
//
// Every connection starts with a challenge. The server sends a fresh random nonce; the
// member answers with HMAC-SHA-256(token, nonce) and a nonce of its own, which the server
// answers with its own proof (so that a member knows it reached its own job's store). The
// token is the job's (job_token.h): it never crosses the network. Anything else that
// connects, a port scanner, random bytes, a length prefix of 2^63, a slow drip of bytes, a
// recorded handshake replayed, is closed within kHandshakeDeadline having cost the server
// the greeting's few bytes; at most kMaxPending such connections are held at once (the
// oldest goes first).
//
// Members send length-prefixed frames (at most kMaxFrame bytes each). A set is not answered
// (as with TCPStore); requests that wait for keys (get, wait, multiGet) are answered once
// the keys exist. Every request of a
// member has a deadline (the store's timeout, for waits the wait's own): a store host
// that stops answering fails the request instead of blocking it for good, and the
// connection is dropped (the next request connects afresh).
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace faceshard {

constexpr std::chrono::milliseconds kHandshakeDeadline{1500};
constexpr size_t kMaxPending = 256;
constexpr size_t kMaxFrame = 16u << 20;

struct GuardStoreStats {
  int64_t members = 0;   // connections that presented the token
  int64_t refused = 0;   // connections closed before or at the handshake
  int64_t open = 0;      // connections open now (members and pending)
  int64_t keys = 0;
};

class GuardStoreServer {
 public:
  // Listens on `listen_fd` (a bound, listening socket; the server owns it from now on).
  GuardStoreServer(int listen_fd, std::string token);
  ~GuardStoreServer();  // stops its thread and closes every connection
  GuardStoreServer(const GuardStoreServer&) = delete;
  GuardStoreServer& operator=(const GuardStoreServer&) = delete;
  int port() const;
  GuardStoreStats stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

class GuardStore : public c10d::Store {
 public:
  // Connects to host:port (retrying until `timeout` while nothing listens there yet, as
  // ranks may start before rank 0) and presents `token`. `server`, when given, is kept alive
  // as long as this store and its clones.
  GuardStore(std::string host, int port, std::string token, std::chrono::milliseconds timeout,
             std::shared_ptr<GuardStoreServer> server = nullptr);
  ~GuardStore() override;

  c10::intrusive_ptr<c10d::Store> clone() override;
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  void append(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override;
  void multiSet(const std::vector<std::string>& keys, const std::vector<std::vector<uint8_t>>& values) override;
  bool hasExtendedApi() const override { return true; }

 private:
  // One request and its answer (without the status byte). `wait_for`: the request waits
  // for keys, this long (zero: for ever); none: it answers within the store's timeout.
  std::string call(const std::string& request, const char* what, const std::string& key,
                   std::optional<std::chrono::milliseconds> wait_for);
  void connect_locked(std::chrono::milliseconds within);
  void drop_locked();

  std::string host_;
  int port_;
  std::string token_;
  std::shared_ptr<GuardStoreServer> server_;
  std::mutex m_;
  int fd_ = -1;
};

}  // namespace faceshard
