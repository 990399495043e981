// TensorBoard scalar logging without TensorFlow: writes event files in the published
// format (TFRecord framing with masked CRC32C around protobuf-encoded Event messages),
// so `tensorboard --logdir <output>/tensorboard` shows the training curves.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

namespace faceshard {

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord uses it.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

class TensorBoardWriter {
 public:
  // Creates logdir and the file events.out.tfevents.<unix seconds>.<hostname>.<pid>
  // (".1", ".2", ... appended if that name exists already), and writes the
  // file_version event "brain.Event:2" that readers expect first.
  explicit TensorBoardWriter(const std::string& logdir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One Event{wall_time, step, Summary{Value{tag, simple_value}}}. The value is stored
  // as float (simple_value is a float in the format). Thread-safe.
  void add_scalar(const std::string& tag, double value, int64_t step);
  // Writes the records added since the last flush, all of them or none (a failed write
  // throws and they are dropped: the file stays readable to its last whole record).
  void flush();

  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);

  std::string path_;
  std::unique_ptr<class AppendFile> file_;
  std::string pending_;  // records since the last flush
  std::mutex mu_;
};

}  // namespace faceshard
