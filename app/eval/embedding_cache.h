// Embeddings of a fixed input by a fixed model, kept between runs of the tools: the
// calibration recipe runs faceshard-clean several times on one run and one test set, and a
// test set's embedding pass (a minute on a CPU for LFW) is the same each time. An entry is a
// float32 .npy named by the SHA-256 of a key that names everything the numbers depend on (the
// checkpoint and its commit marker, the input file's path, size and modification time, the
// flip, the precision and the device type); a changed input or model is another key. The
// cache is best effort: an entry that does not read back as the expected shape is ignored
// and written again, a cache folder that cannot be written costs one line.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace faceshard {

class EmbeddingCache {
 public:
  // $FACESHARD_EMBEDDING_CACHE ("off": no cache), else $XDG_CACHE_HOME/faceshard/embeddings,
  // else ~/.cache/faceshard/embeddings ("" when none of them is set).
  static std::string default_dir();
  explicit EmbeddingCache(std::string dir) : dir_(std::move(dir)) {}
  bool enabled() const { return !dir_.empty(); }

  // The key of these parts (each part's length is part of the key: no two lists collide).
  static std::string key(const std::vector<std::string>& parts);
  // "path|size|mtime_ns" of a file ("" when it cannot be read).
  static std::string file_stamp(const std::string& path);

  // The entry of `key` when it holds a [rows, cols] float matrix.
  std::optional<at::Tensor> find(const std::string& key, int64_t rows, int64_t cols) const;
  // Keeps `embeddings` under `key`; false (and `problem` says why) when it cannot.
  bool put(const std::string& key, const at::Tensor& embeddings, std::string* problem = nullptr) const;

 private:
  std::string path_of(const std::string& key) const { return dir_ + "/" + key + ".npy"; }
  std::string dir_;
};

}  // namespace faceshard
