// Header-only writer of small zip archives for the tests (stored entries, optional zip64
// end records, and knobs to make the archive lie), independent of the reader under test.
// Also used by the AddressSanitizer target, which links no faceshard library.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "models/torch_save/zip_archive.h"

namespace faceshard::testing {

struct ZipSpec {
  std::vector<std::pair<std::string, std::string>> entries;  // name, bytes
  bool zip64 = false;          // 64-bit end records (and 0xffff/0xffffffff in the 32-bit one)
  std::string comment;
  uint16_t method = 0;         // written into every entry's headers
  uint16_t flags = 0;
  bool bad_crc = false;        // the first entry's CRC is off by one
  uint64_t claimed_count = UINT64_MAX;  // entry count in the end record (default: the real one)
};

inline void put16(std::string& o, uint16_t v) {
  o.push_back(char(v & 0xff));
  o.push_back(char(v >> 8));
}
inline void put32(std::string& o, uint32_t v) {
  for (int i = 0; i < 4; ++i) o.push_back(char((v >> (8 * i)) & 0xff));
}
inline void put64(std::string& o, uint64_t v) {
  for (int i = 0; i < 8; ++i) o.push_back(char((v >> (8 * i)) & 0xff));
}

inline std::string make_zip(const ZipSpec& s) {
  std::string out, dir;
  for (size_t i = 0; i < s.entries.size(); ++i) {
    const auto& [name, data] = s.entries[i];
    uint32_t crc = crc32_update(0, reinterpret_cast<const uint8_t*>(data.data()), data.size());
    if (s.bad_crc && i == 0) crc += 1;
    const uint32_t offset = uint32_t(out.size());
    put32(out, 0x04034b50);
    put16(out, 20);
    put16(out, s.flags);
    put16(out, s.method);
    put32(out, 0);  // time, date
    put32(out, crc);
    put32(out, uint32_t(data.size()));
    put32(out, uint32_t(data.size()));
    put16(out, uint16_t(name.size()));
    put16(out, 0);
    out += name;
    out += data;
    put32(dir, 0x02014b50);
    put16(dir, 20);
    put16(dir, 20);
    put16(dir, s.flags);
    put16(dir, s.method);
    put32(dir, 0);
    put32(dir, crc);
    put32(dir, uint32_t(data.size()));
    put32(dir, uint32_t(data.size()));
    put16(dir, uint16_t(name.size()));
    put16(dir, 0);  // extra
    put16(dir, 0);  // comment
    put16(dir, 0);  // disk
    put16(dir, 0);  // internal attributes
    put32(dir, 0);  // external attributes
    put32(dir, offset);
    dir += name;
  }
  const uint64_t dir_at = out.size();
  out += dir;
  const uint64_t count = s.claimed_count == UINT64_MAX ? s.entries.size() : s.claimed_count;
  if (s.zip64) {
    const uint64_t z64_at = out.size();
    put32(out, 0x06064b50);
    put64(out, 44);
    put16(out, 45);
    put16(out, 45);
    put32(out, 0);
    put32(out, 0);
    put64(out, count);
    put64(out, count);
    put64(out, dir.size());
    put64(out, dir_at);
    put32(out, 0x07064b50);
    put32(out, 0);
    put64(out, z64_at);
    put32(out, 1);
  }
  put32(out, 0x06054b50);
  put16(out, 0);
  put16(out, 0);
  put16(out, s.zip64 ? 0xffff : uint16_t(count));
  put16(out, s.zip64 ? 0xffff : uint16_t(count));
  put32(out, s.zip64 ? 0xffffffffu : uint32_t(dir.size()));
  put32(out, s.zip64 ? 0xffffffffu : uint32_t(dir_at));
  put16(out, uint16_t(s.comment.size()));
  out += s.comment;
  return out;
}

// A torch.save-style archive: records under "<prefix>/".
inline std::string make_torch_zip(const std::string& pickle, std::vector<std::pair<std::string, std::string>> storages = {},
                                  const std::string& prefix = "archive") {
  ZipSpec s;
  s.entries.push_back({prefix + "/data.pkl", pickle});
  s.entries.push_back({prefix + "/byteorder", "little"});
  for (auto& [key, bytes] : storages) s.entries.push_back({prefix + "/data/" + key, bytes});
  return make_zip(s);
}

}  // namespace faceshard::testing
