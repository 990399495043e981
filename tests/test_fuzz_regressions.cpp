// Replays every input in tests/fuzz/regressions/<target>/ through its fuzz entry, and the
// hostile files that motivated the bounds (a state_dict of 200k nested tuples, a .bin
// that references one large image thousands of times through the pickle memo, malformed
// and hostile YAML) built here in memory. An entry aborts on a crash, a broken invariant
// or a message that is not one line naming the input, so a passing run means every one
// of them ends as data or as a one-line error. Plain C++ (no LibTorch): also built into
// the AddressSanitizer target, where it is the leak and memory-safety check.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "tests/test_paths.h"
#include "tests/fuzz/fuzz_entries.h"
#include "tests/test_files.h"
#include "tests/zip_writer.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;

void run(void (*entry)(const uint8_t*, size_t), const std::string& bytes) {
  entry(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

TEST(FuzzRegressions, EveryRegressionInputEndsInDataOrOneLineError) {
  const fs::path root = fs::path(FACESHARD_SOURCE_DIR) / "tests/fuzz/regressions";
  size_t n = 0;
  for (const auto& t : fuzz::targets()) {
    const fs::path dir = root / t.name;
    if (!fs::is_directory(dir)) continue;
    for (const auto& f : fs::directory_iterator(dir)) {
      SCOPED_TRACE(f.path().string());
      const std::vector<uint8_t> b = testing::slurp(f.path().string());
      t.run(b.data(), b.size());
      ++n;
    }
  }
  for (const auto& f : fs::directory_iterator(root))
    if (f.is_directory()) {
      bool known = false;
      for (const auto& t : fuzz::targets()) known = known || f.path().filename() == t.name;
      EXPECT_TRUE(known) << f.path() << " is not a fuzz target's name";
    }
  EXPECT_GT(n, 0u);
}

TEST(FuzzRegressions, HostileFilesThatMotivatedTheBounds) {
  // A torch.save zip whose data.pkl nests one-element tuples: 200k TUPLE1 (200 KB, which
  // overflowed the stack of the recursive reader) and 100k MARK ... TUPLE.
  const std::string head = std::string("\x80\x02}X\x01\x00\x00\x00w", 10);
  run(fuzz::state_dict_zip, testing::make_torch_zip(head + std::string(100000, '(') + "N" + std::string(100000, 't') + "s."));
  run(fuzz::state_dict_zip, testing::make_torch_zip(head + "N" + std::string(200000, '\x85') + "s."));
  run(fuzz::state_dict_pickle, head + "N" + std::string(200000, '\x85') + "s.");
  // A .bin whose image list references one 500 KB string 7000 times (3.5 GB as copies).
  std::string bin = std::string("\x80\x02]q\x00(B", 7);
  testing::put32(bin, 500000);
  bin += std::string(500000, '\0') + "q\x01";
  for (int i = 1; i < 7000; ++i) bin += std::string("h\x01", 2);
  bin += "e]q\x02(" + std::string(3500, '\x88') + "e\x86.";
  run(fuzz::verification_bin, bin);
  // The same with fewer references: accepted, one shared buffer.
  std::string small = std::string("\x80\x02]q\x00(B", 7);
  testing::put32(small, 500000);
  small += std::string(500000, '\0') + "q\x01";
  for (int i = 1; i < 30; ++i) small += std::string("h\x01", 2);
  small += "e]q\x02(" + std::string(15, '\x88') + "e\x86.";
  run(fuzz::verification_bin, small);
  // YAML: a list as a key, deep nesting, an alias bomb, a self-referencing alias.
  run(fuzz::config_yaml, "data:\n  num_classes: 10\noptim:\n  [lr, momentum]: 0.1\n");
  run(fuzz::config_yaml, "data:\n  num_classes: " + std::string(20000, '[') + "\n");
  std::string bomb = "l0: &l0 {k0: 1, k1: 1, k2: 1, k3: 1, k4: 1, k5: 1, k6: 1, k7: 1, k8: 1}\n";
  for (int i = 1; i < 10; ++i) {
    bomb += "l" + std::to_string(i) + ": &l" + std::to_string(i) + " {";
    for (int j = 0; j < 9; ++j) bomb += (j ? ", k" : "k") + std::to_string(j) + ": *l" + std::to_string(i - 1);
    bomb += "}\n";
  }
  run(fuzz::config_yaml, bomb + "data: {num_classes: 10}\n");
  run(fuzz::config_yaml, "data: {num_classes: 10}\nmodel: &a [*a]\n");
}

}  // namespace
}  // namespace faceshard
