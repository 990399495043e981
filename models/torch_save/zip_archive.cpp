#include "models/torch_save/zip_archive.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/error.h"

namespace faceshard {

namespace {

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint32_t kZip64EndSig = 0x06064b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr size_t kEndSize = 22;
constexpr size_t kLocatorSize = 20;
constexpr size_t kZip64EndSize = 56;
constexpr size_t kCentralSize = 46;
constexpr size_t kLocalSize = 30;
constexpr size_t kMaxComment = 0xffff;

uint16_t le16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
uint32_t le32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
uint64_t le64(const uint8_t* p) { return uint64_t(le32(p)) | (uint64_t(le32(p + 4)) << 32); }

}  // namespace

uint32_t crc32_update(uint32_t crc, const uint8_t* p, size_t n) {
  // zlib's CRC-32 (about 6 GB/s): checking a model of a few hundred MB costs a fraction
  // of reading it. zlib takes 32-bit lengths.
  uLong c = crc;
  while (n > 0) {
    const uInt k = static_cast<uInt>(std::min<size_t>(n, size_t(1) << 30));
    c = ::crc32(c, p, k);
    p += k;
    n -= k;
  }
  return static_cast<uint32_t>(c);
}

ZipArchive::ZipArchive(std::string context, int fd, const uint8_t* mem, uint64_t size)
    : context_(std::move(context)), fd_(fd), mem_(mem), size_(size) {}

ZipArchive::ZipArchive(ZipArchive&& o) noexcept
    : context_(std::move(o.context_)),
      fd_(o.fd_),
      mem_(o.mem_),
      size_(o.size_),
      directory_offset_(o.directory_offset_),
      verify_crc_(o.verify_crc_),
      entries_(std::move(o.entries_)),
      by_name_(std::move(o.by_name_)) {
  o.fd_ = -1;
}

ZipArchive& ZipArchive::operator=(ZipArchive&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    context_ = std::move(o.context_);
    fd_ = o.fd_;
    mem_ = o.mem_;
    size_ = o.size_;
    directory_offset_ = o.directory_offset_;
    verify_crc_ = o.verify_crc_;
    entries_ = std::move(o.entries_);
    by_name_ = std::move(o.by_name_);
    o.fd_ = -1;
  }
  return *this;
}

ZipArchive::~ZipArchive() {
  if (fd_ >= 0) ::close(fd_);
}

ZipArchive ZipArchive::open_file(const std::string& path, const std::string& context) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw runtime_error(context, ": cannot open: ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw runtime_error(context, ": not a regular file");
  }
  ZipArchive z(context, fd, nullptr, uint64_t(st.st_size));  // owns fd from here on
  z.parse_directory();
  return z;
}

ZipArchive ZipArchive::from_memory(const uint8_t* data, size_t size, const std::string& context) {
  ZipArchive z(context, -1, data, size);
  z.parse_directory();
  return z;
}

void ZipArchive::fail(uint64_t offset, const std::string& what) const {
  throw runtime_error(context_, ": ", what, " (zip offset ", offset, ")");
}

void ZipArchive::pread_exact(uint64_t offset, void* dst, size_t n) const {
  if (offset > size_ || n > size_ - offset) fail(offset, "read past the end of the file");
  if (mem_) {
    if (n) std::memcpy(dst, mem_ + offset, n);
    return;
  }
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    const ssize_t r = ::pread(fd_, p, n, off_t(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail(offset, std::string("read error: ") + std::strerror(errno));
    }
    if (r == 0) fail(offset, "file shrank while reading");
    p += r;
    n -= size_t(r);
    offset += uint64_t(r);
  }
}

void ZipArchive::parse_directory() {
  if (size_ < kEndSize) fail(0, "no zip end-of-central-directory record (truncated, or not a zip file)");
  // The end record sits in the last 22 + 65535 (comment) bytes.
  const uint64_t tail_size = std::min<uint64_t>(size_, kEndSize + kMaxComment);
  std::vector<uint8_t> tail(static_cast<size_t>(tail_size));
  const uint64_t tail_at = size_ - tail_size;
  pread_exact(tail_at, tail.data(), tail.size());
  uint64_t end_at = UINT64_MAX;
  for (size_t i = tail.size() - kEndSize + 1; i-- > 0;) {
    if (le32(&tail[i]) == kEndSig && i + kEndSize + le16(&tail[i + 20]) <= tail.size()) {
      end_at = tail_at + i;
      break;
    }
  }
  if (end_at == UINT64_MAX) fail(size_, "no zip end-of-central-directory record (truncated, or not a zip file)");
  const uint8_t* e = &tail[size_t(end_at - tail_at)];
  if (le16(e + 4) != 0 || le16(e + 6) != 0) fail(end_at, "multi-volume zip archives are not supported");
  uint64_t count = le16(e + 10);
  uint64_t dir_size = le32(e + 12);
  uint64_t dir_at = le32(e + 16);
  uint64_t dir_limit = end_at;  // the directory must end before the record that describes it
  // zip64: a locator right before the end record points at the 64-bit end record.
  if (end_at >= kLocatorSize) {
    uint8_t loc[kLocatorSize];
    pread_exact(end_at - kLocatorSize, loc, kLocatorSize);
    if (le32(loc) == kZip64LocatorSig) {
      const uint64_t z64_at = le64(loc + 8);
      if (z64_at > end_at - kLocatorSize || end_at - kLocatorSize - z64_at < kZip64EndSize)
        fail(end_at - kLocatorSize, "zip64 end record offset outside the file");
      uint8_t z[kZip64EndSize];
      pread_exact(z64_at, z, kZip64EndSize);
      if (le32(z) != kZip64EndSig) fail(z64_at, "bad zip64 end record signature");
      if (le32(z + 16) != 0 || le32(z + 20) != 0) fail(z64_at, "multi-volume zip archives are not supported");
      count = le64(z + 32);
      dir_size = le64(z + 40);
      dir_at = le64(z + 48);
      dir_limit = z64_at;
    }
  }
  if (dir_at > dir_limit || dir_size > dir_limit - dir_at)
    fail(end_at, "central directory (" + std::to_string(dir_size) + " bytes at " + std::to_string(dir_at) +
                     ") lies outside the file");
  if (count > dir_size / kCentralSize)
    fail(end_at, std::to_string(count) + " entries cannot fit in a central directory of " + std::to_string(dir_size) +
                     " bytes");
  directory_offset_ = dir_at;
  std::vector<uint8_t> dir(static_cast<size_t>(dir_size));
  pread_exact(dir_at, dir.data(), dir.size());
  entries_.reserve(size_t(count));
  size_t p = 0;
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t at = dir_at + p;
    if (dir.size() - p < kCentralSize) fail(at, "central directory entry runs past the directory");
    const uint8_t* c = &dir[p];
    if (le32(c) != kCentralSig) fail(at, "bad central directory entry signature");
    Entry en;
    en.flags = le16(c + 8);
    en.method = le16(c + 10);
    en.crc32 = le32(c + 16);
    en.compressed_size = le32(c + 20);
    en.size = le32(c + 24);
    const size_t name_len = le16(c + 28), extra_len = le16(c + 30), comment_len = le16(c + 32);
    en.local_offset = le32(c + 42);
    if (dir.size() - p - kCentralSize < name_len + extra_len + comment_len)
      fail(at, "central directory entry runs past the directory");
    en.name.assign(reinterpret_cast<const char*>(c + kCentralSize), name_len);
    // zip64 extra field: the 64-bit values of the fields that hold 0xffffffff, in order.
    const uint8_t* x = c + kCentralSize + name_len;
    for (size_t q = 0; q + 4 <= extra_len;) {
      const uint16_t id = le16(x + q), len = le16(x + q + 2);
      if (len > extra_len - q - 4) fail(at, "extra field runs past its entry");
      if (id == 0x0001) {
        size_t r = 0;
        for (uint64_t* v : {&en.size, &en.compressed_size, &en.local_offset}) {
          if (*v != 0xffffffffu) continue;
          if (len - r < 8) fail(at, "zip64 extra field too short");
          *v = le64(x + q + 4 + r);
          r += 8;
        }
      }
      q += 4 + size_t(len);
    }
    if (en.local_offset > dir_at || dir_at - en.local_offset < kLocalSize)
      fail(at, "entry '" + detail::printable(en.name) + "' starts outside the file's data");
    // A stored entry's bytes lie between its local header and the directory: any size
    // read from here on is bounded by the file's.
    if (en.method == 0 && en.size > dir_at - en.local_offset - kLocalSize)
      fail(at, "entry '" + detail::printable(en.name) + "' (" + std::to_string(en.size) + " bytes) runs past the data area");
    entries_.push_back(std::move(en));
    p += kCentralSize + name_len + extra_len + comment_len;
  }
  by_name_.resize(entries_.size());
  for (size_t i = 0; i < by_name_.size(); ++i) by_name_[i] = uint32_t(i);
  std::sort(by_name_.begin(), by_name_.end(),
            [&](uint32_t a, uint32_t b) { return entries_[a].name < entries_[b].name; });
  for (size_t i = 1; i < by_name_.size(); ++i)
    if (entries_[by_name_[i]].name == entries_[by_name_[i - 1]].name)
      fail(dir_at, "entry '" + detail::printable(entries_[by_name_[i]].name) + "' appears twice");
}

const ZipArchive::Entry* ZipArchive::find(const std::string& name) const {
  auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                             [&](uint32_t i, const std::string& n) { return entries_[i].name < n; });
  if (it == by_name_.end() || entries_[*it].name != name) return nullptr;
  return &entries_[*it];
}

void ZipArchive::check_stored(const Entry& en) const {
  const uint64_t at = en.local_offset;
  if (en.flags & 1) fail(at, "entry '" + detail::printable(en.name) + "' is encrypted");
  if (en.method != 0)
    fail(at, "entry '" + detail::printable(en.name) + "' is compressed (method " + std::to_string(en.method) +
                 "); torch.save stores entries uncompressed");
  if (en.compressed_size != en.size) fail(at, "stored entry '" + detail::printable(en.name) + "' has two different sizes");
}

uint64_t ZipArchive::data_offset(const Entry& en) const {
  const uint64_t at = en.local_offset;
  check_stored(en);
  uint8_t h[kLocalSize];
  pread_exact(at, h, kLocalSize);
  if (le32(h) != kLocalSig) fail(at, "bad local header signature of entry '" + detail::printable(en.name) + "'");
  const size_t name_len = le16(h + 26), extra_len = le16(h + 28);
  if (name_len != en.name.size()) fail(at, "local header of entry '" + detail::printable(en.name) + "' names another entry");
  std::string name(name_len, '\0');
  pread_exact(at + kLocalSize, name.data(), name_len);
  if (name != en.name) fail(at, "local header of entry '" + detail::printable(en.name) + "' names another entry");
  const uint64_t data_at = at + kLocalSize + name_len + extra_len;
  if (data_at > directory_offset_ || en.size > directory_offset_ - data_at)
    fail(at, "entry '" + detail::printable(en.name) + "' (" + std::to_string(en.size) + " bytes) runs past the data area");
  return data_at;
}

void ZipArchive::read(const Entry& en, void* dst) const {
  ZipEntryStream s(*this, en, 0, en.size);
  s.read(dst, size_t(en.size));
}

std::vector<uint8_t> ZipArchive::read(const Entry& en) const {
  check_stored(en);  // a stored entry's size was checked against the file when it was listed
  std::vector<uint8_t> out(static_cast<size_t>(en.size));
  read(en, out.data());
  return out;
}

ZipEntryStream::ZipEntryStream(const ZipArchive& zip, const ZipArchive::Entry& en, uint64_t begin, uint64_t end)
    : zip_(zip), entry_(en), pos_(begin), end_(end) {
  if (begin > end || end > en.size)
    zip.fail(en.local_offset, "byte range [" + std::to_string(begin) + ", " + std::to_string(end) + ") lies outside entry '" +
                                  detail::printable(en.name) + "' of " + std::to_string(en.size) + " bytes");
  data_at_ = zip.data_offset(en);
  check_crc_ = zip.verify_crc_ && begin == 0 && end == en.size;
  advised_ = begin;
  drop_behind_ = zip.fd_ >= 0 && end - begin >= (uint64_t(64) << 20);
}

void ZipEntryStream::read(void* dst, size_t n) {
  if (n > remaining())
    zip_.fail(data_at_ + pos_, "read of " + std::to_string(n) + " bytes past the end of the range of entry '" +
                                   detail::printable(entry_.name) + "'");
  // 4 MB steps: each step's CRC reads bytes the read has just left in cache. The kernel is
  // asked for the next 128 MB ahead of the reads, so the disk keeps reading while this
  // thread copies (and faults in the destination's fresh pages); a big range (a classifier
  // shard) drops the pages it has read from the page cache: it is read once, and a GB-sized
  // cache of it beside the GBs being filled only makes the kernel reclaim memory meanwhile.
  constexpr size_t kStep = size_t(4) << 20;
  constexpr uint64_t kAhead = uint64_t(128) << 20;
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    const size_t k = std::min(n, kStep);
    if (zip_.fd_ >= 0 && advised_ < end_ && advised_ < pos_ + kAhead / 2) {
      const uint64_t to = std::min(end_, pos_ + kAhead);
      ::posix_fadvise(zip_.fd_, off_t(data_at_ + advised_), off_t(to - advised_), POSIX_FADV_WILLNEED);
      advised_ = to;
    }
    zip_.pread_exact(data_at_ + pos_, p, k);
    if (drop_behind_) ::posix_fadvise(zip_.fd_, off_t(data_at_ + pos_), off_t(k), POSIX_FADV_DONTNEED);
    if (check_crc_) crc_ = crc32_update(crc_, p, k);
    p += k;
    n -= k;
    pos_ += k;
  }
  if (check_crc_ && pos_ == end_ && crc_ != entry_.crc32) {
    check_crc_ = false;  // reported once
    zip_.fail(data_at_, "entry '" + detail::printable(entry_.name) + "' fails its CRC-32 check (corrupt file)");
  }
}

}  // namespace faceshard
