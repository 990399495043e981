#include "data/image_check.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

namespace faceshard {

bool read_image_file(const std::string& path, std::vector<uint8_t>& out, std::string& why) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    why = std::string("cannot open: ") + std::strerror(errno);
    return false;
  }
  out.clear();
  uint8_t buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) {
    out.insert(out.end(), buf, buf + n);
    if (out.size() > (uint64_t(64) << 20)) {
      std::fclose(f);
      why = "larger than 64 MiB";
      return false;
    }
  }
  const bool err = std::ferror(f) != 0;
  std::fclose(f);
  if (err) why = "read error";
  return !err;
}

std::string check_image_file(const std::string& path, int size, std::vector<uint8_t>& buffer) {
  std::string why;
  if (!read_image_file(path, buffer, why)) return why;
  return check_image_bytes(buffer, size);
}

std::vector<uint64_t> check_source_images(const PackSource& source, int size, int threads,
                                          std::vector<PackProblem>& problems) {
  const uint64_t n = source.items.size();
  const int t = static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(static_cast<uint64_t>(std::max(threads, 1)), n)));
  // Each thread takes every t-th item and keeps its own findings: no lock, and the merge
  // below restores item order.
  std::vector<std::vector<std::pair<uint64_t, std::string>>> found(static_cast<size_t>(t));
  auto work = [&](int k) {
    std::vector<uint8_t> buffer;
    for (uint64_t i = static_cast<uint64_t>(k); i < n; i += static_cast<uint64_t>(t)) {
      std::string why = check_image_file(source.items[i].path, size, buffer);
      if (!why.empty()) found[static_cast<size_t>(k)].emplace_back(i, std::move(why));
    }
  };
  if (t == 1) {
    work(0);
  } else {
    std::vector<std::thread> pool;
    for (int k = 0; k < t; ++k) pool.emplace_back(work, k);
    for (auto& th : pool) th.join();
  }
  std::vector<std::pair<uint64_t, std::string>> all;
  for (auto& f : found) all.insert(all.end(), std::make_move_iterator(f.begin()), std::make_move_iterator(f.end()));
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<uint64_t> bad;
  for (auto& [i, why] : all) {
    problems.push_back({source.items[i].path, std::move(why)});
    bad.push_back(i);
  }
  return bad;
}

}  // namespace faceshard
