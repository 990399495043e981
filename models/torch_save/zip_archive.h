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
  // CRC-32 (computed as the bytes stream in, see ZipEntryStream).
  void read(const Entry& entry, void* dst) const;
  std::vector<uint8_t> read(const Entry& entry) const;
  // CRC checks cost one pass over the data; fuzzing switches them off to reach the
  // parsers behind them.
  void set_verify_crc(bool on) { verify_crc_ = on; }
  bool verify_crc() const { return verify_crc_; }
  const std::string& context() const { return context_; }

 private:
  friend class ZipEntryStream;
  // Checks the entry's local header (signature, name, a stored entry) and that its data
  // lies before the central directory; returns the offset of its first byte.
  uint64_t data_offset(const Entry& entry) const;
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

// Bytes [begin, end) of one stored entry, read front to back in pieces the caller places
// (straight into their destination, or into a staging buffer), so that an entry of many GB
// is never held twice. Opening checks the entry's local header and that the range lies
// inside the entry. When the range is the whole entry, its CRC-32 is computed as the
// pieces arrive (in cache-sized steps, while the bytes are still in cache) and checked
// when the last byte is read: that read() throws, and what it wrote must be discarded. A
// part of an entry cannot be checked against the entry's CRC: a ranged read checks the
// bounds of the entry, of its local header and of the file, nothing more.
class ZipEntryStream {
 public:
  ZipEntryStream(const ZipArchive& zip, const ZipArchive::Entry& entry, uint64_t begin, uint64_t end);

  uint64_t remaining() const { return end_ - pos_; }
  // True when the range is the whole entry and the archive verifies CRCs.
  bool checks_crc() const { return check_crc_; }
  // Copies the next n bytes (n <= remaining()) to dst.
  void read(void* dst, size_t n);

 private:
  const ZipArchive& zip_;
  const ZipArchive::Entry& entry_;
  uint64_t data_at_ = 0;  // file offset of the entry's first byte
  uint64_t pos_ = 0, end_ = 0;  // within the entry
  uint64_t advised_ = 0;        // read-ahead requested up to here (within the entry)
  bool drop_behind_ = false;    // a big range: read pages leave the page cache
  bool check_crc_ = false;
  uint32_t crc_ = 0;
};

// CRC-32 (zip, IEEE 802.3), continuing from `crc` (0 to start).
uint32_t crc32_update(uint32_t crc, const uint8_t* data, size_t n);

}  // namespace faceshard
