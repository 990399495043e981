// The key -> offset map of a .rec, compact and shared: built once from the text .idx into
// a binary file in a cache folder (never next to the data set) and memory-mapped, so the
// ranks of a host share its pages instead of each holding its own copy of a 40M-line
// index. Small indexes, or no cache folder, are built in memory with the same layout.
// Plain C++ (parses untrusted files; also in the ASan and fuzz targets).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace faceshard {

// One line of the .idx file: "<key>\t<byte offset of the record's magic word>\n".
struct IndexEntry {
  uint64_t key = 0;
  uint64_t offset = 0;
};

struct RecordIndexOptions {
  // Folder for the compact index files; empty: always build in memory.
  std::string cache_dir;
  // A .idx smaller than this is indexed in memory (fast, and a few MB at most).
  uint64_t min_cache_bytes = uint64_t(16) << 20;
  // How long a rank waits for another process building the same cache file before it
  // builds in memory itself.
  double lock_wait_s = 600;
};

// Where the compact index files go unless told otherwise: $FACESHARD_INDEX_CACHE ("off":
// nowhere), else $XDG_CACHE_HOME/faceshard/rec-index, else $HOME/.cache/faceshard/rec-index.
std::string default_index_cache_dir();
// That folder, and min_cache_bytes from $FACESHARD_INDEX_CACHE_MIN_BYTES when set.
RecordIndexOptions default_record_index_options();

// The lines of a .idx as they are (no duplicate checks), for tools and tests; see
// recordio.h.
std::vector<IndexEntry> parse_index(const std::string& text, const std::string& name, uint64_t rec_size);
std::vector<IndexEntry> read_index(const std::string& idx_path, uint64_t rec_size = UINT64_MAX);

class RecordIndex {
 public:
  static constexpr uint64_t kNone = UINT64_MAX;

  // Parses idx_path (every line "<unsigned key>\t<unsigned offset>", offsets 4-aligned and
  // able to start a record in a .rec of rec_size bytes, keys unique) or maps its cached
  // compact form when that matches the .idx (size, mtime, inode and a checksum of sampled
  // blocks). Throws faceshard::Error naming the file and line for a bad index.
  RecordIndex(const std::string& idx_path, uint64_t rec_size, const RecordIndexOptions& options);
  // Parses index text already in memory (no cache; `name` is used in messages).
  static RecordIndex from_text(const std::string& text, const std::string& name, uint64_t rec_size);

  RecordIndex(RecordIndex&&) noexcept;
  RecordIndex& operator=(RecordIndex&&) noexcept;
  ~RecordIndex();

  uint64_t size() const;                 // number of entries
  IndexEntry entry(uint64_t i) const;    // the i-th line of the .idx (file order)
  uint64_t find(uint64_t key) const;     // the key's offset, kNone when absent
  // True when the keys are exactly [min_key(), min_key() + size()).
  bool keys_contiguous() const;
  uint64_t min_key() const;
  uint64_t max_key() const;  // size() > 0

  // How the index was obtained, for one log line: "cache <path> (built)", "cache <path>",
  // "memory", or "memory (<why the cache was not used>)" when a cache folder was given but
  // could not be written or locked (cache_failed()).
  const std::string& source() const { return source_; }
  bool cache_failed() const { return !cache_problem_.empty(); }
  // Why the cache was not used ("" when it was, or when none was asked for).
  const std::string& cache_problem() const { return cache_problem_; }
  // Bytes of the compact form (mapped or held).
  uint64_t bytes() const;

 private:
  RecordIndex() = default;
  struct Image;
  std::unique_ptr<Image> image_;
  std::string source_;
  std::string cache_problem_;
};

}  // namespace faceshard
