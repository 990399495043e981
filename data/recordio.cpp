#include "data/recordio.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/error.h"

namespace faceshard {

namespace {

uint32_t load_le32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
void store_le32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
void append_le32(std::vector<uint8_t>& out, uint32_t v) {
  uint8_t b[4];
  store_le32(b, v);
  out.insert(out.end(), b, b + 4);
}

std::string key_text(int64_t key) { return key < 0 ? std::string() : detail::concat(" key ", key); }

std::string unique_tmp_name(const std::string& path) {
  return detail::concat(path, ".tmp.", ::getpid());
}

}  // namespace

namespace recordio {

std::vector<uint8_t> encode_record(const uint8_t* data, size_t size) {
  if (size > kMaxPartLength) {
    throw runtime_error("RecordIO: record of ", size, " bytes exceeds the format limit of ", kMaxPartLength);
  }
  // Mirrors dmlc::RecordIOWriter::WriteRecord: scan aligned words for the magic.
  uint8_t magic[4];
  store_le32(magic, kMagic);
  const uint32_t len = uint32_t(size);
  const uint32_t lower_align = (len >> 2) << 2;
  const uint32_t upper_align = ((len + 3) >> 2) << 2;
  std::vector<uint8_t> out;
  out.reserve(size + 16);
  uint32_t dptr = 0;
  for (uint32_t i = 0; i < lower_align; i += 4) {
    if (std::memcmp(data + i, magic, 4) == 0) {
      append_le32(out, kMagic);
      append_le32(out, encode_lrec(dptr == 0 ? kStart : kMiddle, i - dptr));
      out.insert(out.end(), data + dptr, data + i);
      dptr = i + 4;
    }
  }
  append_le32(out, kMagic);
  append_le32(out, encode_lrec(dptr != 0 ? kEnd : kWhole, len - dptr));
  out.insert(out.end(), data + dptr, data + len);
  out.insert(out.end(), upper_align - len, uint8_t(0));
  return out;
}

}  // namespace recordio

// ---------------------------------------------------------------------------------------
// RecordIOFile

RecordIOFile::RecordIOFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw usage_error(path, ": cannot open RecordIO file: ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    throw usage_error(path, ": not a regular file");
  }
  size_ = uint64_t(st.st_size);
}

RecordIOFile::~RecordIOFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string RecordIOFile::where(uint64_t offset, int64_t key) const {
  return detail::concat(path_, ":", key_text(key), " at offset ", offset);
}

void RecordIOFile::pread_exact(uint64_t offset, void* dst, size_t n, uint64_t rec_offset, int64_t key) const {
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    const ssize_t r = ::pread(fd_, p, n, off_t(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw runtime_error(where(rec_offset, key), ": read error: ", std::strerror(errno));
    }
    if (r == 0) throw runtime_error(where(rec_offset, key), ": truncated record (file shrank while reading)");
    p += r;
    n -= size_t(r);
    offset += uint64_t(r);
  }
}

uint64_t RecordIOFile::read_at(uint64_t offset, std::vector<uint8_t>& out, int64_t key) const {
  out.clear();
  if (offset % 4 != 0) throw runtime_error(where(offset, key), ": offset is not 4-byte aligned");
  uint64_t pos = offset;
  bool first = true;
  while (true) {
    if (pos > size_ || size_ - pos < 8) {
      throw runtime_error(where(offset, key), ": truncated record: header at ", pos, " runs past the end of file (",
                          size_, " bytes)");
    }
    uint8_t head[8];
    pread_exact(pos, head, 8, offset, key);
    const uint32_t magic = load_le32(head);
    const uint32_t lrec = load_le32(head + 4);
    if (magic != recordio::kMagic) {
      throw runtime_error(where(offset, key), ": bad magic 0x", std::hex, magic, std::dec, " at ", pos,
                          " (expected 0xced7230a; wrong offset or corrupt file)");
    }
    const uint32_t cflag = recordio::lrec_flag(lrec);
    const uint64_t len = recordio::lrec_length(lrec);
    const uint64_t padded = (len + 3) / 4 * 4;
    if (first ? !(cflag == recordio::kWhole || cflag == recordio::kStart)
              : !(cflag == recordio::kMiddle || cflag == recordio::kEnd)) {
      throw runtime_error(where(offset, key), ": unexpected part flag ", cflag, " at ", pos,
                          first ? " (offset points into the middle of a multi-part record)"
                                : " (multi-part record not continued)");
    }
    if (cflag == recordio::kStart || cflag == recordio::kMiddle) {
      // Writers only cut at aligned words, so a non-final part has an aligned length.
      if (len % 4 != 0) throw runtime_error(where(offset, key), ": corrupt multi-part record (part length ", len, ")");
    }
    // The length is checked against the bytes really there before anything is allocated.
    if (size_ - pos - 8 < padded) {
      throw runtime_error(where(offset, key), ": truncated record: part of ", len, " bytes at ", pos,
                          " runs past the end of file (", size_, " bytes)");
    }
    const size_t old = out.size();
    out.resize(old + size_t(len));
    if (len > 0) pread_exact(pos + 8, out.data() + old, size_t(len), offset, key);
    pos += 8 + padded;
    if (cflag == recordio::kWhole || cflag == recordio::kEnd) break;
    uint8_t magic_bytes[4];
    store_le32(magic_bytes, recordio::kMagic);
    out.insert(out.end(), magic_bytes, magic_bytes + 4);
    first = false;
  }
  return pos;
}

// ---------------------------------------------------------------------------------------
// RecordIOReader

bool RecordIOReader::next(std::vector<uint8_t>& out) {
  if (pos_ == file_.size()) return false;
  pos_ = file_.read_at(pos_, out);
  return true;
}

// ---------------------------------------------------------------------------------------
// IndexedRecordIO

IndexedRecordIO::IndexedRecordIO(const std::string& rec_path, const std::string& idx_path,
                                 const RecordIndexOptions& options)
    : file_(rec_path), idx_path_(idx_path), index_(idx_path, file_.size(), options) {}

uint64_t IndexedRecordIO::offset_of(uint64_t key) const {
  const uint64_t off = index_.find(key);
  if (off == RecordIndex::kNone) throw runtime_error(file_.path(), ": key ", key, " is not in the index ", idx_path_);
  return off;
}

void IndexedRecordIO::read(uint64_t key, std::vector<uint8_t>& out) const {
  file_.read_at(offset_of(key), out, int64_t(key));
}

// ---------------------------------------------------------------------------------------
// RecordIOWriter

RecordIOWriter::RecordIOWriter(const std::string& rec_path, const std::string& idx_path)
    : rec_path_(rec_path), idx_path_(idx_path) {
  rec_tmp_ = unique_tmp_name(rec_path);
  rec_ = std::fopen(rec_tmp_.c_str(), "wb");
  if (!rec_) throw usage_error(rec_path, ": cannot create: ", std::strerror(errno));
  if (!idx_path.empty()) {
    idx_tmp_ = unique_tmp_name(idx_path);
    idx_ = std::fopen(idx_tmp_.c_str(), "wb");
    if (!idx_) {
      const int err = errno;
      abandon();
      throw usage_error(idx_path, ": cannot create: ", std::strerror(err));
    }
  }
}

RecordIOWriter::~RecordIOWriter() {
  if (!committed_) abandon();
}

void RecordIOWriter::abandon() noexcept {
  if (rec_) std::fclose(rec_);
  if (idx_) std::fclose(idx_);
  rec_ = idx_ = nullptr;
  if (!rec_tmp_.empty()) std::remove(rec_tmp_.c_str());
  if (!idx_tmp_.empty()) std::remove(idx_tmp_.c_str());
}

uint64_t RecordIOWriter::write(uint64_t key, const uint8_t* data, size_t size) {
  if (!rec_) throw runtime_error(rec_path_, ": write after commit");
  const std::vector<uint8_t> bytes = recordio::encode_record(data, size);
  const uint64_t offset = pos_;
  if (std::fwrite(bytes.data(), 1, bytes.size(), rec_) != bytes.size()) {
    throw runtime_error(rec_path_, ": write failed: ", std::strerror(errno));
  }
  pos_ += bytes.size();
  if (idx_ && std::fprintf(idx_, "%llu\t%llu\n", (unsigned long long)key, (unsigned long long)offset) < 0) {
    throw runtime_error(idx_path_, ": write failed: ", std::strerror(errno));
  }
  return offset;
}

void RecordIOWriter::overwrite(uint64_t offset, const std::vector<uint8_t>& data) {
  if (!rec_) throw runtime_error(rec_path_, ": write after commit");
  const std::vector<uint8_t> bytes = recordio::encode_record(data.data(), data.size());
  if (offset + bytes.size() > pos_) throw runtime_error(rec_path_, ": overwrite past the end of the written data");
  std::fflush(rec_);
  bool ok = std::fseek(rec_, long(offset), SEEK_SET) == 0 &&
            std::fwrite(bytes.data(), 1, bytes.size(), rec_) == bytes.size();
  ok = std::fseek(rec_, 0, SEEK_END) == 0 && ok;
  if (!ok) throw runtime_error(rec_path_, ": write failed: ", std::strerror(errno));
}

void RecordIOWriter::commit() {
  if (committed_) return;
  bool ok = std::fflush(rec_) == 0 && ::fsync(fileno(rec_)) == 0;
  ok = (std::fclose(rec_) == 0) && ok;
  rec_ = nullptr;
  if (idx_) {
    ok = std::fflush(idx_) == 0 && ok;
    ok = (std::fclose(idx_) == 0) && ok;
    idx_ = nullptr;
  }
  if (!ok) {
    abandon();
    throw runtime_error(rec_path_, ": write failed: ", std::strerror(errno));
  }
  // The index goes in last: a reader that finds the .idx finds a complete .rec.
  if (std::rename(rec_tmp_.c_str(), rec_path_.c_str()) != 0) {
    const int err = errno;
    abandon();
    throw runtime_error(rec_path_, ": cannot rename from ", rec_tmp_, ": ", std::strerror(err));
  }
  rec_tmp_.clear();
  if (!idx_path_.empty() && std::rename(idx_tmp_.c_str(), idx_path_.c_str()) != 0) {
    const int err = errno;
    abandon();
    throw runtime_error(idx_path_, ": cannot rename from ", idx_tmp_, ": ", std::strerror(err));
  }
  idx_tmp_.clear();
  committed_ = true;
}

}  // namespace faceshard
