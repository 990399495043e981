#include "app/io/tensorboard_writer.h"

#include "app/io/append_file.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "app/io/protobuf_writer.h"
#include "base/error.h"

namespace faceshard {

namespace {

constexpr const char* kFile = "tensorboard_writer";

std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : (c >> 1);
    table[i] = c;
  }
  return table;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Event{ double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
std::string encode_event(double wall_time, int64_t step, const std::string* file_version,
                         const ProtoMessage* summary) {
  ProtoMessage e;
  e.add_double(1, wall_time);
  e.add_int64(2, step);
  if (file_version) e.add_bytes(3, *file_version);
  if (summary) e.add_message(5, *summary);
  return e.str();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t crc = crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& logdir) {
  std::error_code ec;
  std::filesystem::create_directories(logdir, ec);
  if (ec) throw runtime_error(kFile, ": cannot create log directory '", logdir, "': ", ec.message());
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
  const std::string base = (std::filesystem::path(logdir) / ("events.out.tfevents." +
                                                             std::to_string(static_cast<long long>(std::time(nullptr))) +
                                                             "." + host + "." + std::to_string(::getpid())))
                               .string();
  // Two writers of one process in the same second would otherwise share (and clobber)
  // one file.
  path_ = base;
  for (int k = 1; std::filesystem::exists(path_); ++k) path_ = base + "." + std::to_string(k);
  file_ = std::make_unique<AppendFile>(path_, false);
  const std::string version = "brain.Event:2";
  write_record(encode_event(now_seconds(), 0, &version, nullptr));
  flush();
}

TensorBoardWriter::~TensorBoardWriter() = default;  // what was not flushed is left out

void TensorBoardWriter::write_record(const std::string& data) {
  // TFRecord: uint64 length, masked CRC32C of the length bytes, data, masked CRC32C of data.
  std::string rec;
  put_le<uint64_t>(rec, data.size());
  put_le<uint32_t>(rec, masked_crc32c(rec.data(), 8));
  rec += data;
  put_le<uint32_t>(rec, masked_crc32c(data.data(), data.size()));
  pending_ += rec;
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  // Value{ string tag = 1; float simple_value = 2; }, Summary{ repeated Value value = 1; }
  ProtoMessage v;
  v.add_bytes(1, tag);
  v.add_float(2, static_cast<float>(value));
  ProtoMessage summary;
  summary.add_message(1, v);
  const std::string event = encode_event(now_seconds(), step, nullptr, &summary);
  std::lock_guard<std::mutex> lock(mu_);
  write_record(event);
}

void TensorBoardWriter::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  // The records since the last flush, whole or not at all: a reader never meets half a
  // record (it would stop reading the file there).
  std::string records;
  records.swap(pending_);
  if (!records.empty()) file_->append(records);
}

}  // namespace faceshard
