// The rendezvous store's wire format (guard_store.h), shared by its server and its members:
// the handshake's sizes and labels, the requests' codes, and the encoding (integers
// little-endian; a string is its u32 length and its bytes; a frame is a u32 length and a body).
#pragma once
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "base/sha256.h"

namespace faceshard {
namespace guard_wire {

using Clock = std::chrono::steady_clock;

// Greeting: magic, version, nonce. Answer: magic, version, proof, the member's nonce.
constexpr char kMagic[4] = {'F', 'S', 'G', 'S'};
constexpr uint8_t kVersion = 1;
constexpr size_t kNonce = 32;
constexpr size_t kGreeting = 4 + 1 + kNonce;
constexpr size_t kAnswer = 4 + 1 + 32 + kNonce;
constexpr size_t kServerProof = 32;
const char* const kClientLabel = "faceshard store member";
const char* const kServerLabel = "faceshard store host";

enum Op : uint8_t { kSet = 1, kGet, kCompareSet, kAdd, kDelete, kCheck, kNumKeys, kWait, kAppend, kMultiGet, kMultiSet };
enum Status : uint8_t { kOk = 0, kFailed = 1 };

inline std::string random_bytes(size_t n) {
  std::string s(n, '\0');
  size_t got = 0;
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    while (got < n) {
      const ssize_t r = ::read(fd, &s[got], n - got);
      if (r <= 0) break;
      got += static_cast<size_t>(r);
    }
    ::close(fd);
  }
  if (got < n) {  // no /dev/urandom: the random device (still unpredictable enough for a nonce)
    std::random_device rd;
    for (size_t i = got; i < n; ++i) s[i] = static_cast<char>(rd());
  }
  return s;
}

inline std::string proof(const std::string& token, const char* label, const std::string& nonce) {
  const Digest256 d = hmac_sha256(token, std::string(label) + '\0' + nonce);
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

// Encoding: integers little-endian; a string is its u32 length and its bytes.
inline void put_u32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
}
inline void put_i64(std::string& s, int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>(u >> (8 * i)));
}
inline void put_str(std::string& s, const std::string& v) {
  put_u32(s, static_cast<uint32_t>(v.size()));
  s += v;
}
inline void put_bytes(std::string& s, const std::vector<uint8_t>& v) {
  put_u32(s, static_cast<uint32_t>(v.size()));
  s.append(v.begin(), v.end());
}
inline void put_keys(std::string& s, const std::vector<std::string>& keys) {
  put_u32(s, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) put_str(s, k);
}

struct Malformed {};

class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  uint8_t u8() {
    need(1);
    return static_cast<uint8_t>(s_[pos_++]);
  }
  uint32_t u32() {
    need(4);
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t(static_cast<uint8_t>(s_[pos_ + i])) << (8 * i);
    pos_ += 4;
    return v;
  }
  int64_t i64() {
    need(8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t(static_cast<uint8_t>(s_[pos_ + i])) << (8 * i);
    pos_ += 8;
    return static_cast<int64_t>(v);
  }
  std::string str() {
    const uint32_t n = u32();
    need(n);
    std::string v = s_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  std::vector<std::string> keys() {
    const uint32_t n = u32();
    if (n > s_.size()) throw Malformed{};  // each key takes at least 4 bytes
    std::vector<std::string> v;
    for (uint32_t i = 0; i < n; ++i) v.push_back(str());
    return v;
  }
  void end() const {
    if (pos_ != s_.size()) throw Malformed{};
  }

 private:
  void need(size_t n) const {
    if (s_.size() - pos_ < n) throw Malformed{};
  }
  const std::string& s_;
  size_t pos_ = 0;
};

inline std::string frame(const std::string& body) {
  std::string f;
  put_u32(f, static_cast<uint32_t>(body.size()));
  return f + body;
}

inline std::string peer_name(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = {0};
  int port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

inline int local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return 0;
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

}  // namespace guard_wire
}  // namespace faceshard
