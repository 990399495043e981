#include "tests/test_paths.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

namespace faceshard::testing {
namespace {

namespace fs = std::filesystem;

std::string exe_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

// faceshard_tests.paths beside the binary, relative paths resolved against its folder.
const std::map<std::string, std::string>& paths_file() {
  static const std::map<std::string, std::string> entries = [] {
    std::map<std::string, std::string> m;
    const std::string dir = exe_dir();
    std::ifstream f(dir + "/faceshard_tests.paths");
    std::string line;
    while (std::getline(f, line)) {
      const size_t eq = line.find('=');
      if (line.empty() || line[0] == '#' || eq == std::string::npos) continue;
      std::string key = line.substr(0, eq), value = line.substr(eq + 1);
      // Relative folders are the file's; python may also be a bare command (PATH lookup).
      const bool command = key == "python" && value.find('/') == std::string::npos;
      if (!value.empty() && value[0] != '/' && !command) value = fs::path(dir + "/" + value).lexically_normal().string();
      m[key] = value;
    }
    return m;
  }();
  return entries;
}

const char* lookup(const char* env, const char* key) {
  static std::map<std::string, std::string> cache;
  auto it = cache.find(key);
  if (it != cache.end()) return it->second.c_str();
  std::string value;
  if (const char* e = std::getenv(env); e && *e) {
    value = e;
  } else {
    const auto& m = paths_file();
    const auto p = m.find(key);
    if (p == m.end()) {
      std::fprintf(stderr, "faceshard_tests: no '%s' path: set %s or write %s=... into %s/faceshard_tests.paths\n", key,
                   env, key, exe_dir().c_str());
      std::exit(2);
    }
    value = p->second;
  }
  return cache.emplace(key, value).first->second.c_str();
}

}  // namespace

const char* source_dir() { return lookup("FACESHARD_TEST_SOURCE_DIR", "source"); }
const char* bin_dir() { return lookup("FACESHARD_TEST_BIN_DIR", "bin"); }
const char* python() { return lookup("FACESHARD_TEST_PYTHON", "python"); }
const char* fuzz_seeds_dir() { return lookup("FACESHARD_TEST_FUZZ_SEEDS_DIR", "fuzz_seeds"); }

}  // namespace faceshard::testing
