#include "app/eval/embedding_cache.h"

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>

#include "app/io/npy.h"
#include "base/error.h"
#include "base/sha256.h"

namespace faceshard {

std::string EmbeddingCache::default_dir() {
  if (const char* e = std::getenv("FACESHARD_EMBEDDING_CACHE")) return std::string(e) == "off" ? "" : e;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/faceshard/embeddings";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/faceshard/embeddings";
  return "";
}

std::string EmbeddingCache::key(const std::vector<std::string>& parts) {
  std::string joined;
  for (const std::string& p : parts) joined += std::to_string(p.size()) + ":" + p + ";";
  const Digest256 d = sha256(joined);
  return to_hex(d.data(), d.size());
}

std::string EmbeddingCache::file_stamp(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return "";
  std::error_code ec;
  const std::string abs = std::filesystem::absolute(path, ec).lexically_normal().string();
  return abs + "|" + std::to_string(static_cast<long long>(st.st_size)) + "|" +
         std::to_string(static_cast<long long>(st.st_mtim.tv_sec)) + "." + std::to_string(st.st_mtim.tv_nsec);
}

std::optional<at::Tensor> EmbeddingCache::find(const std::string& key, int64_t rows, int64_t cols) const {
  if (!enabled()) return std::nullopt;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path_of(key), ec)) return std::nullopt;
  try {
    at::Tensor t = read_npy(path_of(key));
    if (t.dim() != 2 || t.size(0) != rows || t.size(1) != cols || t.scalar_type() != at::kFloat) return std::nullopt;
    if (!at::isfinite(t).all().item<bool>()) return std::nullopt;
    return t;
  } catch (const std::exception&) {
    return std::nullopt;  // an entry cut short or damaged: embedded again and rewritten
  }
}

bool EmbeddingCache::put(const std::string& key, const at::Tensor& embeddings, std::string* problem) const {
  if (!enabled()) return false;
  try {
    std::filesystem::create_directories(dir_);
    write_npy_float32(embeddings.to(at::kCPU, at::kFloat).contiguous(), path_of(key));
    return true;
  } catch (const std::exception& e) {
    if (problem) *problem = one_line(e);
    return false;
  }
}

}  // namespace faceshard
