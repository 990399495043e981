// MXNet/dmlc RecordIO container (.rec) and its text index (.idx), byte-compatible with
// dmlc-core's recordio.cc and mxnet.recordio.MXIndexedRecordIO. Plain C++ (no LibTorch):
// it parses untrusted files, so it is also built into the AddressSanitizer test target.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "data/record_index.h"

namespace faceshard {

namespace recordio {
constexpr uint32_t kMagic = 0xced7230a;
// dmlc stores the part flag in the top 3 bits of the length word.
constexpr uint32_t kLengthBits = 29;
constexpr uint32_t kMaxPartLength = (1u << kLengthBits) - 1;
// Part flags (cflag): a payload that contains the magic word at a 4-byte aligned offset
// is cut there into parts; the reader puts the magic back between the parts.
enum PartFlag : uint32_t { kWhole = 0, kStart = 1, kMiddle = 2, kEnd = 3 };

inline uint32_t encode_lrec(uint32_t cflag, uint32_t length) { return (cflag << kLengthBits) | length; }
inline uint32_t lrec_flag(uint32_t lrec) { return (lrec >> kLengthBits) & 7u; }
inline uint32_t lrec_length(uint32_t lrec) { return lrec & kMaxPartLength; }

// The bytes dmlc's RecordIOWriter::WriteRecord emits for one payload (all parts, padded).
std::vector<uint8_t> encode_record(const uint8_t* data, size_t size);
}  // namespace recordio

// read_index / parse_index (record_index.h) parse a .idx file line by line. They throw
// faceshard::Error naming file and line for anything that is not "<unsigned key>\t<unsigned
// offset>" or an offset that cannot start a record in a file of rec_size bytes (pass
// UINT64_MAX to skip the size check). Duplicate keys and offsets are found by RecordIndex.

// Read-only view of a .rec file. read_at() is thread-safe (pread on one descriptor), so
// loader workers share one instance.
class RecordIOFile {
 public:
  explicit RecordIOFile(const std::string& path);
  ~RecordIOFile();
  RecordIOFile(const RecordIOFile&) = delete;
  RecordIOFile& operator=(const RecordIOFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }

  // Reads the (possibly multi-part) record whose magic word is at `offset` into `out` and
  // returns the offset just past it. `key` only names the record in error messages
  // (-1: none). Every length is checked against the file size before anything is read or
  // allocated; a bad magic, a truncated part, a part-flag sequence that is not
  // whole | start middle* end, or an offset inside a record throws faceshard::Error.
  uint64_t read_at(uint64_t offset, std::vector<uint8_t>& out, int64_t key = -1) const;

 private:
  void pread_exact(uint64_t offset, void* dst, size_t n, uint64_t rec_offset, int64_t key) const;
  std::string where(uint64_t offset, int64_t key) const;

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// Sequential scan of a .rec (what `faceshard-pack verify` and the tests use).
class RecordIOReader {
 public:
  explicit RecordIOReader(const std::string& path) : file_(path) {}
  // False at a clean end of file; throws on a corrupt or truncated record.
  bool next(std::vector<uint8_t>& out);
  uint64_t tell() const { return pos_; }  // offset of the next record
  const RecordIOFile& file() const { return file_; }

 private:
  RecordIOFile file_;
  uint64_t pos_ = 0;
};

// .rec + .idx opened together for random access by key (MXIndexedRecordIO 'r').
class IndexedRecordIO {
 public:
  // Throws a usage error when either file is missing. A large .idx is read through its
  // compact form in options.cache_dir (see RecordIndex).
  IndexedRecordIO(const std::string& rec_path, const std::string& idx_path,
                  const RecordIndexOptions& options = default_record_index_options());

  bool contains(uint64_t key) const { return index_.find(key) != RecordIndex::kNone; }
  // Throws when the key is not in the index or the record is corrupt.
  void read(uint64_t key, std::vector<uint8_t>& out) const;
  uint64_t offset_of(uint64_t key) const;
  uint64_t num_entries() const { return index_.size(); }
  IndexEntry entry(uint64_t i) const { return index_.entry(i); }  // file order
  const RecordIndex& index() const { return index_; }
  const RecordIOFile& file() const { return file_; }
  const std::string& idx_path() const { return idx_path_; }

 private:
  RecordIOFile file_;
  std::string idx_path_;
  RecordIndex index_;
};

// Writes a .rec (and optionally its .idx) under temporary names; commit() renames them
// into place, so an interrupted run never leaves a half-written file under the final name.
// Destroying an uncommitted writer removes the temporary files.
class RecordIOWriter {
 public:
  // idx_path may be empty (no index).
  RecordIOWriter(const std::string& rec_path, const std::string& idx_path = "");
  ~RecordIOWriter();
  RecordIOWriter(const RecordIOWriter&) = delete;
  RecordIOWriter& operator=(const RecordIOWriter&) = delete;

  // Appends a record; with an index, `key` is written to the .idx with its offset.
  // Returns the record's offset.
  uint64_t write(uint64_t key, const uint8_t* data, size_t size);
  uint64_t write(uint64_t key, const std::vector<uint8_t>& data) { return write(key, data.data(), data.size()); }
  uint64_t tell() const { return pos_; }
  // Replaces the record at `offset` (written earlier by this writer) with `data`, whose
  // encoding must have exactly the same size; insightface's header record 0 is written as
  // a placeholder first and filled in once the counts are known.
  void overwrite(uint64_t offset, const std::vector<uint8_t>& data);
  void commit();

 private:
  void abandon() noexcept;

  std::string rec_path_, idx_path_, rec_tmp_, idx_tmp_;
  std::FILE* rec_ = nullptr;
  std::FILE* idx_ = nullptr;
  uint64_t pos_ = 0;
  bool committed_ = false;
};

}  // namespace faceshard
