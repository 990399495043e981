// SHA-256 (FIPS 180-4) and HMAC-SHA-256 (RFC 2104): the rendezvous store's handshake proves
// that a member knows the job's token without sending it (guard_store.h).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace faceshard {

using Digest256 = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  void update(const std::string& s) { update(s.data(), s.size()); }
  Digest256 finish();  // the object is spent afterwards

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t used_ = 0;
  uint64_t total_ = 0;
};

Digest256 sha256(const std::string& data);
Digest256 hmac_sha256(const std::string& key, const std::string& message);
std::string to_hex(const uint8_t* p, size_t n);
// Equal without an early exit (the time taken does not say where two digests differ).
bool digests_equal(const uint8_t* a, const uint8_t* b, size_t n);

}  // namespace faceshard
