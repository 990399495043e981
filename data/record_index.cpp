#include "data/record_index.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "base/error.h"

namespace faceshard {

namespace {

// The compact form: a header of kHeaderWords 64-bit words, then the offsets in key order,
// then (unless the keys are contiguous) the keys in order, then (unless the .idx lists
// them in key order) each line's position in key order. insightface's files have keys
// 0..N in order, so the whole index is 8 bytes a record.
constexpr uint64_t kMagic = 0x0a58444952534621ull;  // "!FSRIDX\n"
constexpr uint64_t kVersion = 1;
constexpr uint64_t kHeaderWords = 16;
enum HeaderWord : size_t {
  kWMagic, kWVersion, kWIdxSize, kWIdxMtime, kWIdxInode, kWIdxChecksum, kWRecSize, kWCount, kWMinKey,
  kWFlags, kWOffsetsAt, kWKeysAt, kWOrderAt, kWTotalWords, kWHeaderCheck
};
constexpr uint64_t kFlagContiguous = 1, kFlagSorted = 2;

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

uint64_t header_check(const uint64_t* w) {
  uint64_t h = 0;
  for (size_t i = 0; i < kWHeaderCheck; ++i) h = mix(h, w[i]);
  return h;
}

struct FileId {
  uint64_t size = 0, mtime_ns = 0, inode = 0, checksum = 0;
};

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

bool pread_all(int fd, void* dst, size_t n, uint64_t offset) {
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, off_t(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= size_t(r);
    offset += uint64_t(r);
  }
  return true;
}

// Size, mtime and inode say whether the .idx was replaced; a checksum of up to 64 blocks
// of 64 KiB spread over the file catches an edit that kept all three (costs ~4 MB of reads).
FileId identify(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw runtime_error(path, ": cannot stat: ", std::strerror(errno));
  FileId id;
  id.size = uint64_t(st.st_size);
  id.mtime_ns = uint64_t(st.st_mtim.tv_sec) * 1000000000ull + uint64_t(st.st_mtim.tv_nsec);
  id.inode = uint64_t(st.st_ino);
  constexpr uint64_t kBlock = 64 << 10, kBlocks = 64;
  std::vector<uint8_t> buf(kBlock);
  uint64_t h = mix(0, id.size);
  const uint64_t span = id.size > kBlock ? id.size - kBlock : 0;
  for (uint64_t b = 0; b < kBlocks; ++b) {
    const uint64_t at = span * b / (kBlocks - 1);
    const size_t n = size_t(std::min(kBlock, id.size - std::min(id.size, at)));
    if (n == 0) break;
    if (!pread_all(fd, buf.data(), n, at)) throw runtime_error(path, ": read error: ", std::strerror(errno));
    for (size_t i = 0; i < n; ++i) h = (h ^ buf[i]) * 0x100000001b3ull;
    if (span == 0) break;
  }
  id.checksum = h;
  return id;
}

// Parses the .idx line by line (no copy of the whole text; these files reach 1 GB).
class IndexParser {
 public:
  IndexParser(const std::string& name, uint64_t rec_size) : name_(name), rec_size_(rec_size) {}

  void line(const char* b, const char* e) {
    ++line_no_;
    while (e > b && (e[-1] == '\r' || e[-1] == ' ')) --e;
    if (e == b) return;
    const char* tab = static_cast<const char*>(std::memchr(b, '\t', size_t(e - b)));
    if (!tab) {
      throw runtime_error(name_, ":", line_no_, ": expected '<key>\\t<offset>', got '",
                          detail::printable(std::string(b, size_t(std::min<ptrdiff_t>(e - b, 60)))), "'");
    }
    const uint64_t key = parse_u64(b, tab, "key");
    const uint64_t offset = parse_u64(tab + 1, e, "offset");
    if (rec_size_ != UINT64_MAX && (offset % 4 != 0 || offset > rec_size_ || rec_size_ - offset < 8)) {
      throw runtime_error(name_, ":", line_no_, ": key ", key, ": offset ", offset,
                          " cannot start a record in a .rec of ", rec_size_, " bytes");
    }
    keys.push_back(key);
    offsets.push_back(offset);
  }

  // Feeds a chunk; a line cut at the chunk's end is kept for the next one.
  void feed(const char* p, const char* end, bool last) {
    if (!carry_.empty()) {
      const char* nl = static_cast<const char*>(std::memchr(p, '\n', size_t(end - p)));
      if (!nl && !last) {
        if (carry_.size() + size_t(end - p) > kMaxLine) too_long();
        carry_.append(p, end);
        return;
      }
      const char* stop = nl ? nl : end;
      carry_.append(p, stop);
      line(carry_.data(), carry_.data() + carry_.size());
      carry_.clear();
      p = nl ? nl + 1 : end;
    }
    while (p < end) {
      const char* nl = static_cast<const char*>(std::memchr(p, '\n', size_t(end - p)));
      if (!nl) {
        if (last) {
          line(p, end);
        } else {
          if (size_t(end - p) > kMaxLine) too_long();
          carry_.assign(p, end);
        }
        return;
      }
      line(p, nl);
      p = nl + 1;
    }
  }

  std::vector<uint64_t> keys, offsets;  // file order

 private:
  static constexpr size_t kMaxLine = 4096;
  [[noreturn]] void too_long() const {
    throw runtime_error(name_, ":", line_no_ + 1, ": line longer than ", kMaxLine, " bytes (not a .idx file)");
  }
  uint64_t parse_u64(const char* b, const char* e, const char* what) const {
    auto bad = [&](const char* why) {
      return runtime_error(name_, ":", line_no_, ": ", why, " ", what, ", got '",
                           detail::printable(std::string(b, size_t(std::min<ptrdiff_t>(e - b, 40)))), "'");
    };
    if (b == e || e - b > 20) throw bad("expected an unsigned integer");
    uint64_t v = 0;
    for (const char* c = b; c < e; ++c) {
      if (*c < '0' || *c > '9') throw bad("expected an unsigned integer");
      const uint64_t d = uint64_t(*c - '0');
      if (v > (UINT64_MAX - d) / 10) throw bad("overflow in");
      v = v * 10 + d;
    }
    return v;
  }

  std::string name_;
  uint64_t rec_size_;
  uint64_t line_no_ = 0;
  std::string carry_;
};

// The compact form from the parsed lines. Rejects duplicate keys and two keys that share
// one offset (a corrupt index would otherwise train on one record many times).
std::vector<uint64_t> build_words(IndexParser& p, const std::string& name, const FileId& id, uint64_t rec_size) {
  const uint64_t n = p.keys.size();
  bool sorted = true;
  for (uint64_t i = 1; i < n && sorted; ++i) sorted = p.keys[i - 1] < p.keys[i];
  std::vector<uint64_t> perm;  // key order -> line
  if (!sorted) {
    perm.resize(n);
    std::iota(perm.begin(), perm.end(), uint64_t(0));
    std::stable_sort(perm.begin(), perm.end(), [&](uint64_t a, uint64_t b) { return p.keys[a] < p.keys[b]; });
    for (uint64_t i = 1; i < n; ++i) {
      if (p.keys[perm[i]] == p.keys[perm[i - 1]]) throw runtime_error(name, ": duplicate key ", p.keys[perm[i]]);
    }
  }
  auto key_at = [&](uint64_t i) { return sorted ? p.keys[i] : p.keys[perm[i]]; };
  auto offset_at = [&](uint64_t i) { return sorted ? p.offsets[i] : p.offsets[perm[i]]; };
  {
    bool increasing = true;
    for (uint64_t i = 1; i < n && increasing; ++i) increasing = p.offsets[i - 1] < p.offsets[i];
    if (!increasing) {
      std::vector<uint64_t> by_offset(n);
      std::iota(by_offset.begin(), by_offset.end(), uint64_t(0));
      std::sort(by_offset.begin(), by_offset.end(),
                [&](uint64_t a, uint64_t b) { return p.offsets[a] < p.offsets[b]; });
      for (uint64_t i = 1; i < n; ++i) {
        const uint64_t a = by_offset[i - 1], b = by_offset[i];
        if (p.offsets[a] == p.offsets[b]) {
          throw runtime_error(name, ": keys ", std::min(p.keys[a], p.keys[b]), " and ", std::max(p.keys[a], p.keys[b]),
                              " both point at offset ", p.offsets[a],
                              " (a corrupt index: every record starts at its own offset)");
        }
      }
    }
  }
  const uint64_t min_key = n ? key_at(0) : 0;
  const bool contiguous = n == 0 || key_at(n - 1) - min_key == n - 1;
  std::vector<uint64_t> w(kHeaderWords, 0);
  w.reserve(kHeaderWords + n * (1 + !contiguous + !sorted));
  w[kWMagic] = kMagic;
  w[kWVersion] = kVersion;
  w[kWIdxSize] = id.size;
  w[kWIdxMtime] = id.mtime_ns;
  w[kWIdxInode] = id.inode;
  w[kWIdxChecksum] = id.checksum;
  w[kWRecSize] = rec_size;
  w[kWCount] = n;
  w[kWMinKey] = min_key;
  w[kWFlags] = (contiguous ? kFlagContiguous : 0) | (sorted ? kFlagSorted : 0);
  w[kWOffsetsAt] = w.size();
  for (uint64_t i = 0; i < n; ++i) w.push_back(offset_at(i));
  if (!contiguous) {
    w[kWKeysAt] = w.size();
    for (uint64_t i = 0; i < n; ++i) w.push_back(key_at(i));
  }
  if (!sorted) {
    w[kWOrderAt] = w.size();
    const uint64_t at = w.size();
    w.resize(at + n);
    for (uint64_t i = 0; i < n; ++i) w[at + perm[i]] = i;
  }
  w[kWTotalWords] = w.size();
  w[kWHeaderCheck] = header_check(w.data());
  return w;
}

// A compact form is used only when its header is intact, describes the .idx and .rec at
// hand, and its arrays lie inside it.
bool header_matches(const uint64_t* w, uint64_t words, const FileId& id, uint64_t rec_size) {
  if (words < kHeaderWords || w[kWMagic] != kMagic || w[kWVersion] != kVersion) return false;
  if (w[kWHeaderCheck] != header_check(w) || w[kWTotalWords] != words) return false;
  if (w[kWIdxSize] != id.size || w[kWIdxMtime] != id.mtime_ns || w[kWIdxInode] != id.inode ||
      w[kWIdxChecksum] != id.checksum || w[kWRecSize] != rec_size) {
    return false;
  }
  const uint64_t n = w[kWCount], flags = w[kWFlags];
  if (n > words) return false;
  uint64_t at = kHeaderWords;
  auto array_at = [&](uint64_t pos, bool present) {
    if (!present) return pos == 0;
    if (pos != at) return false;
    at += n;
    return true;
  };
  return array_at(w[kWOffsetsAt], true) && array_at(w[kWKeysAt], !(flags & kFlagContiguous)) &&
         array_at(w[kWOrderAt], !(flags & kFlagSorted)) && at == words && (flags & ~uint64_t(3)) == 0;
}

void parse_fd(int fd, IndexParser& p, const std::string& path) {
  struct stat st;
  const uint64_t size = ::fstat(fd, &st) == 0 ? uint64_t(st.st_size) : 0;
  std::vector<char> buf(size_t(std::clamp<uint64_t>(size + 1, 4096, uint64_t(8) << 20)));
  uint64_t pos = 0;
  while (true) {
    ssize_t r = ::pread(fd, buf.data(), buf.size(), off_t(pos));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw runtime_error(path, ": read error: ", std::strerror(errno));
    p.feed(buf.data(), buf.data() + r, r == 0);
    if (r == 0) break;
    pos += uint64_t(r);
  }
}

std::string hex(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(v));
  return b;
}

std::string absolute_path(const std::string& path) {
  char* r = ::realpath(path.c_str(), nullptr);
  if (!r) return path;
  std::string s(r);
  std::free(r);
  return s;
}

bool make_dirs(const std::string& dir) {
  std::string cur;
  for (size_t i = 0; i <= dir.size(); ++i) {
    if (i == dir.size() || (dir[i] == '/' && i > 0)) {
      cur = dir.substr(0, i);
      if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) return false;
    }
  }
  struct stat st;
  return ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

struct RecordIndex::Image {
  std::vector<uint64_t> owned;
  void* map = nullptr;
  size_t map_len = 0;
  const uint64_t* w = nullptr;
  uint64_t words = 0;
  const std::string name;

  explicit Image(std::string n) : name(std::move(n)) {}
  ~Image() {
    if (map) ::munmap(map, map_len);
  }
  void adopt(std::vector<uint64_t> v) {
    owned = std::move(v);
    w = owned.data();
    words = owned.size();
  }
  // Maps a cached compact form; false when it is missing or does not match.
  bool map_file(const std::string& path, const FileId& id, uint64_t rec_size) {
    Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) return false;
    struct stat st;
    if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size % 8 != 0 ||
        uint64_t(st.st_size) < kHeaderWords * 8) {
      return false;
    }
    void* m = ::mmap(nullptr, size_t(st.st_size), PROT_READ, MAP_SHARED, fd.get(), 0);
    if (m == MAP_FAILED) return false;
    const auto* words_p = static_cast<const uint64_t*>(m);
    if (!header_matches(words_p, uint64_t(st.st_size) / 8, id, rec_size)) {
      ::munmap(m, size_t(st.st_size));
      return false;
    }
    // The loader looks keys up in random order: no read-ahead around each page.
    ::madvise(m, size_t(st.st_size), MADV_RANDOM);
    map = m;
    map_len = size_t(st.st_size);
    w = words_p;
    words = uint64_t(st.st_size) / 8;
    return true;
  }
};

std::string default_index_cache_dir() {
  if (const char* e = std::getenv("FACESHARD_INDEX_CACHE")) return std::string(e) == "off" ? "" : e;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/faceshard/rec-index";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/faceshard/rec-index";
  return "";
}

RecordIndexOptions default_record_index_options() {
  RecordIndexOptions o;
  o.cache_dir = default_index_cache_dir();
  // $FACESHARD_INDEX_CACHE_MIN_BYTES: cache smaller indexes too (0: every one); anything but a
  // plain number keeps the default.
  if (const char* e = std::getenv("FACESHARD_INDEX_CACHE_MIN_BYTES"); e && *e) {
    char* end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(e, &end, 10);
    if (errno == 0 && end && *end == '\0' && *e != '-') o.min_cache_bytes = v;
  }
  return o;
}

RecordIndex::RecordIndex(const std::string& idx_path, uint64_t rec_size, const RecordIndexOptions& options)
    : image_(std::make_unique<Image>(idx_path)) {
  Fd fd(::open(idx_path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw usage_error(idx_path, ": cannot open index file (.idx): ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) throw usage_error(idx_path, ": not a regular file");
  const bool cache = !options.cache_dir.empty() && uint64_t(st.st_size) >= options.min_cache_bytes;
  if (!cache) {
    IndexParser p(idx_path, rec_size);
    parse_fd(fd.get(), p, idx_path);
    image_->adopt(build_words(p, idx_path, FileId{}, rec_size));
    source_ = "memory";
    return;
  }
  const FileId id = identify(fd.get(), idx_path);
  const std::string path = options.cache_dir + "/" + hex(mix(0x5eed, std::hash<std::string>()(absolute_path(idx_path)))) +
                           ".fsidx";
  if (image_->map_file(path, id, rec_size)) {
    source_ = "cache " + path;
    return;
  }
  // One process of the host builds the cache file; the others wait for it and map it.
  std::string why_not;
  Fd lock(make_dirs(options.cache_dir) ? ::open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644) : -1);
  bool locked = false;
  if (lock.get() < 0) {
    why_not = detail::concat("cache folder ", options.cache_dir, " is not writable: ", std::strerror(errno));
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(options.lock_wait_s);
    while (!(locked = ::flock(lock.get(), LOCK_EX | LOCK_NB) == 0)) {
      if (errno != EWOULDBLOCK && errno != EINTR) break;
      if (std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polled: flock has no timeout
    }
    if (!locked) why_not = detail::concat(path, ".lock stayed locked by another process");
  }
  if (locked && image_->map_file(path, id, rec_size)) {
    source_ = "cache " + path;
    return;
  }
  IndexParser p(idx_path, rec_size);
  parse_fd(fd.get(), p, idx_path);
  std::vector<uint64_t> words = build_words(p, idx_path, id, rec_size);
  p.keys = {};
  p.offsets = {};
  if (locked) {
    // Written under a temporary name, flushed, closed and renamed: a failing disk leaves no
    // partial cache file under the final name (the index is then held in memory).
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    const size_t bytes = words.size() * 8;
    size_t done = 0;
    int err = 0;
    int out = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) err = errno;
    while (out >= 0 && !err && done < bytes) {
      const ssize_t r = ::write(out, reinterpret_cast<const char*>(words.data()) + done, bytes - done);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) err = errno;
      else if (r == 0) err = EIO;
      else done += size_t(r);
    }
    if (out >= 0 && !err && ::fsync(out) != 0) err = errno;
    if (out >= 0 && ::close(out) != 0 && !err) err = errno;
    if (out >= 0 && !err && ::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
    if (!err) {
      if (image_->map_file(path, id, rec_size)) {
        source_ = "cache " + path + " (built)";
        return;
      }
      why_not = detail::concat(path, " does not read back");
    } else {
      why_not = detail::concat("cannot write ", path, ": ", std::strerror(err));
      ::unlink(tmp.c_str());
    }
  }
  image_->adopt(std::move(words));
  cache_problem_ = why_not;
  source_ = "memory (" + why_not + ")";
}

RecordIndex RecordIndex::from_text(const std::string& text, const std::string& name, uint64_t rec_size) {
  RecordIndex r;
  r.image_ = std::make_unique<Image>(name);
  IndexParser p(name, rec_size);
  p.feed(text.data(), text.data() + text.size(), true);
  r.image_->adopt(build_words(p, name, FileId{}, rec_size));
  r.source_ = "memory";
  return r;
}

std::vector<IndexEntry> parse_index(const std::string& text, const std::string& name, uint64_t rec_size) {
  IndexParser p(name, rec_size);
  p.feed(text.data(), text.data() + text.size(), true);
  std::vector<IndexEntry> out(p.keys.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = {p.keys[i], p.offsets[i]};
  return out;
}

std::vector<IndexEntry> read_index(const std::string& idx_path, uint64_t rec_size) {
  Fd fd(::open(idx_path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw usage_error(idx_path, ": cannot open index file (.idx)");
  IndexParser p(idx_path, rec_size);
  parse_fd(fd.get(), p, idx_path);
  std::vector<IndexEntry> out(p.keys.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = {p.keys[i], p.offsets[i]};
  return out;
}

RecordIndex::RecordIndex(RecordIndex&&) noexcept = default;
RecordIndex& RecordIndex::operator=(RecordIndex&&) noexcept = default;
RecordIndex::~RecordIndex() = default;

uint64_t RecordIndex::size() const { return image_->w[kWCount]; }
uint64_t RecordIndex::min_key() const { return image_->w[kWMinKey]; }
uint64_t RecordIndex::max_key() const {
  const uint64_t* w = image_->w;
  const uint64_t n = w[kWCount];
  if (n == 0) return 0;
  return (w[kWFlags] & kFlagContiguous) ? w[kWMinKey] + n - 1 : w[w[kWKeysAt] + n - 1];
}
bool RecordIndex::keys_contiguous() const { return image_->w[kWFlags] & kFlagContiguous; }
uint64_t RecordIndex::bytes() const { return image_->words * 8; }

IndexEntry RecordIndex::entry(uint64_t i) const {
  const uint64_t* w = image_->w;
  const uint64_t n = w[kWCount];
  if (i >= n) throw runtime_error(image_->name, ": entry ", i, " is past the index's ", n, " entries");
  uint64_t pos = i;
  if (!(w[kWFlags] & kFlagSorted)) {
    pos = w[w[kWOrderAt] + i];
    if (pos >= n) throw runtime_error(image_->name, ": corrupt compact index (entry ", i, ")");
  }
  IndexEntry e;
  e.key = (w[kWFlags] & kFlagContiguous) ? w[kWMinKey] + pos : w[w[kWKeysAt] + pos];
  e.offset = w[w[kWOffsetsAt] + pos];
  return e;
}

uint64_t RecordIndex::find(uint64_t key) const {
  const uint64_t* w = image_->w;
  const uint64_t n = w[kWCount];
  const uint64_t* offsets = w + w[kWOffsetsAt];
  if (w[kWFlags] & kFlagContiguous) {
    return key >= w[kWMinKey] && key - w[kWMinKey] < n ? offsets[key - w[kWMinKey]] : kNone;
  }
  const uint64_t* keys = w + w[kWKeysAt];
  const uint64_t* it = std::lower_bound(keys, keys + n, key);
  return (it != keys + n && *it == key) ? offsets[it - keys] : kNone;
}

}  // namespace faceshard
