// A file that only grows by whole pieces: each append is written in full or not at all.
// A write that fails part-way (a full disk, a quota, an I/O error, a short write) is rolled
// back (the file truncated to where it was), so that a reader never meets half a line of
// metrics.jsonl or half a TensorBoard record, and the next append that succeeds follows
// the last whole one. metrics.jsonl and the TensorBoard event file are written this way.
#pragma once
#include <string>

namespace faceshard {

class AppendFile {
 public:
  // Opens (creating) `path`; append=false empties it first. Runtime error naming the file
  // and the cause when it cannot be opened.
  AppendFile(const std::string& path, bool append);
  ~AppendFile();  // a failed close is one warning naming the file
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;

  // Writes `bytes` whole; on failure rolls back and throws a runtime error naming the file
  // and what the system said.
  void append(const std::string& bytes);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  long long size_ = 0;  // the bytes written whole so far
};

}  // namespace faceshard
