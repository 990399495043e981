// Reader of the zip container that torch.save writes (stored, uncompressed entries under one
// top-level folder; zip64 when large). Plain C++ (no LibTorch): it parses untrusted files,
// so it is also built into the AddressSanitizer tests and a fuzz target.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace faceshard {

// Every size and offset is checked against the bytes really there before anything is read
// or allocated: opening an archive of S bytes allocates less than 3 S (the central
// directory and the entries' names), reading an entry exactly its size. Errors are
// faceshard::Error (runtime) with one line "<context>: <what> (zip offset N)".
class ZipArchive {
 public:
  struct Entry {
    std::string name;
    uint64_t size = 0;              // uncompressed
    uint64_t compressed_size = 0;
    uint64_t local_offset = 0;      // of the local file header
    uint32_t crc32 = 0;
    uint16_t method = 0;            // 0: stored
    uint16_t flags = 0;
  };

  // Reads the file with pread (it is not loaded whole). `context` prefixes every error
  // (e.g. "model.pt: cannot read torch.save file").
  static ZipArchive open_file(const std::string& path, const std::string& context);
  // Reads bytes in memory, which must outlive the archive (fuzzing, tests).
  static ZipArchive from_memory(const uint8_t* data, size_t size, const std::string& context);

  ZipArchive(ZipArchive&& other) noexcept;
  ZipArchive& operator=(ZipArchive&& other) noexcept;
  ZipArchive(const ZipArchive&) = delete;
  ZipArchive& operator=(const ZipArchive&) = delete;
  ~ZipArchive();

  uint64_t file_size() const { return size_; }
  const std::vector<Entry>& entries() const { return entries_; }  // central-directory order
  const Entry* find(const std::string& name) const;                // nullptr when absent

  // Throws unless the entry can be read (stored, not encrypted). A stored entry's size
  // was checked against the file when the directory was read, so it bounds allocations.
  void check_stored(const Entry& entry) const;
  // Copies the entry's bytes to dst (entry.size bytes) after checking its local header
  // (signature, name, a stored entry, data inside the file) and, unless switched off, its
  // CRC-32.
  void read(const Entry& entry, void* dst) const;
  std::vector<uint8_t> read(const Entry& entry) const;
  // CRC checks cost one pass over the data; fuzzing switches them off to reach the
  // parsers behind them.
  void set_verify_crc(bool on) { verify_crc_ = on; }

 private:
  ZipArchive(std::string context, int fd, const uint8_t* mem, uint64_t size);
  void parse_directory();
  void pread_exact(uint64_t offset, void* dst, size_t n) const;
  [[noreturn]] void fail(uint64_t offset, const std::string& what) const;

  std::string context_;
  int fd_ = -1;
  const uint8_t* mem_ = nullptr;
  uint64_t size_ = 0;
  uint64_t directory_offset_ = 0;  // entries' data must end before the central directory
  bool verify_crc_ = true;
  std::vector<Entry> entries_;
  std::vector<uint32_t> by_name_;  // indices into entries_, sorted by name
};

// CRC-32 (zip, IEEE 802.3), continuing from `crc` (0 to start).
uint32_t crc32_update(uint32_t crc, const uint8_t* data, size_t n);

}  // namespace faceshard
