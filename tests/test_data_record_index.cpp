// The compact record index (cache file shared by the ranks of a host, validated against
// the .idx) and insightface layouts whose float32 key labels are rounded (files past 2^24
// records, simulated at small sizes with fewer label bits). Plain C++: also in the ASan target.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/image_record.h"
#include "data/index_check.h"
#include "data/insightface_rec.h"
#include "data/record_index.h"
#include "data/recordio.h"
#include "base/error.h"
#include "tests/test_errors.h"
#include "tests/test_files.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::slurp;
using testing::spit;
using testing::TempDir;

// A .rec/.idx whose keys are written in the given order; returns key -> offset as the
// writer reported it (the reference the index is checked against).
std::map<uint64_t, uint64_t> write_rec(const std::string& rec, const std::string& idx, const std::vector<uint64_t>& keys) {
  std::map<uint64_t, uint64_t> where;
  RecordIOWriter w(rec, idx);
  for (uint64_t k : keys) where[k] = w.write(k, std::vector<uint8_t>(1 + k % 7, uint8_t(k)));
  w.commit();
  return where;
}

RecordIndexOptions cache_in(const std::string& dir) {
  RecordIndexOptions o;
  o.cache_dir = dir;
  o.min_cache_bytes = 0;
  return o;
}

void expect_index_equals(const IndexedRecordIO& r, const std::vector<uint64_t>& keys,
                         const std::map<uint64_t, uint64_t>& where) {
  ASSERT_EQ(r.num_entries(), keys.size());
  for (uint64_t i = 0; i < keys.size(); ++i) {
    const IndexEntry e = r.entry(i);
    EXPECT_EQ(e.key, keys[i]) << "line " << i;
    EXPECT_EQ(e.offset, where.at(keys[i])) << "line " << i;
    EXPECT_EQ(r.offset_of(keys[i]), where.at(keys[i]));
  }
  std::vector<uint8_t> buf;
  for (uint64_t k : keys) {
    r.read(k, buf);
    EXPECT_EQ(buf, std::vector<uint8_t>(1 + k % 7, uint8_t(k))) << "key " << k;
  }
}

TEST(RecordIndex, CacheIsBuiltOnceThenMappedAndAgreesWithTheWriter) {
  TempDir d;
  std::vector<uint64_t> keys(300);
  for (uint64_t i = 0; i < keys.size(); ++i) keys[i] = i;
  const auto where = write_rec(d / "a.rec", d / "a.idx", keys);
  const std::string cache = d / "cache/sub";
  {
    const IndexedRecordIO r(d / "a.rec", d / "a.idx", cache_in(cache));
    EXPECT_EQ(r.index().source().rfind("cache ", 0), 0u) << r.index().source();
    EXPECT_NE(r.index().source().find("(built)"), std::string::npos) << r.index().source();
    EXPECT_TRUE(r.index().keys_contiguous());
    // Contiguous keys in order: 8 bytes a record plus the header.
    EXPECT_EQ(r.index().bytes(), 16 * 8 + keys.size() * 8);
    expect_index_equals(r, keys, where);
  }
  {
    const IndexedRecordIO r(d / "a.rec", d / "a.idx", cache_in(cache));
    EXPECT_EQ(r.index().source().find("(built)"), std::string::npos) << r.index().source();
    expect_index_equals(r, keys, where);
    EXPECT_FALSE(r.contains(300));
  }
  // Nothing is written next to the data set.
  for (const auto& e : fs::directory_iterator(d.path)) {
    const std::string n = e.path().filename().string();
    EXPECT_TRUE(n == "a.rec" || n == "a.idx" || n == "cache") << n;
  }
  // The in-memory index is the same.
  RecordIndexOptions mem;
  const IndexedRecordIO m(d / "a.rec", d / "a.idx", mem);
  EXPECT_EQ(m.index().source(), "memory");
  expect_index_equals(m, keys, where);
}

TEST(RecordIndex, SparseUnsortedKeysKeepFileOrder) {
  TempDir d;
  const std::vector<uint64_t> keys = {5000000000ull, 3, 77777, 12, 9, 4000};
  const auto where = write_rec(d / "k.rec", d / "k.idx", keys);
  for (int pass = 0; pass < 2; ++pass) {
    const IndexedRecordIO r(d / "k.rec", d / "k.idx", cache_in(d / "c"));
    EXPECT_FALSE(r.index().keys_contiguous());
    expect_index_equals(r, keys, where);
    EXPECT_FALSE(r.contains(4));
    EXPECT_FALSE(r.contains(5000000001ull));
    EXPECT_FALSE(r.contains(0));
  }
}

TEST(RecordIndex, ChangedIndexOrTamperedCacheIsRebuilt) {
  TempDir d;
  std::vector<uint64_t> keys = {0, 1, 2, 3, 4, 5, 6, 7};
  auto where = write_rec(d / "a.rec", d / "a.idx", keys);
  const std::string cache = d / "c";
  { const IndexedRecordIO r(d / "a.rec", d / "a.idx", cache_in(cache)); }
  std::string cache_file;
  for (const auto& e : fs::directory_iterator(cache))
    if (e.path().extension() == ".fsidx") cache_file = e.path().string();
  ASSERT_FALSE(cache_file.empty());

  // Same size, other content (two lines swapped): the keys are read in the new order.
  {
    std::ifstream in(d / "a.idx");
    std::vector<std::string> lines;
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    std::swap(lines[2], lines[5]);
    std::ofstream out(d / "a.idx", std::ios::trunc);
    for (const auto& l : lines) out << l << "\n";
  }
  std::swap(keys[2], keys[5]);
  {
    const IndexedRecordIO r(d / "a.rec", d / "a.idx", cache_in(cache));
    EXPECT_NE(r.index().source().find("(built)"), std::string::npos) << r.index().source();
    expect_index_equals(r, keys, where);
  }
  // A damaged cache file (cut short, or its record of the .idx changed) is never used.
  for (int damage = 0; damage < 2; ++damage) {
    auto bytes = slurp(cache_file);
    if (damage == 0) bytes.resize(bytes.size() - 8);
    if (damage == 1) bytes[5 * 8] ^= 1;  // the .idx checksum word
    spit(cache_file, bytes);
    const IndexedRecordIO r(d / "a.rec", d / "a.idx", cache_in(cache));
    EXPECT_NE(r.index().source().find("(built)"), std::string::npos) << "damage " << damage;
    expect_index_equals(r, keys, where);
  }
}

TEST(RecordIndex, UnwritableCacheFolderFallsBackToMemory) {
  TempDir d;
  const std::vector<uint64_t> keys = {0, 1, 2};
  const auto where = write_rec(d / "a.rec", d / "a.idx", keys);
  spit(d / "file", {1});
  const IndexedRecordIO r(d / "a.rec", d / "a.idx", cache_in(d / "file/cache"));
  EXPECT_EQ(r.index().source().rfind("memory (", 0), 0u) << r.index().source();
  expect_index_equals(r, keys, where);
}

// The cache file cannot be written (its temporary name is taken by a folder: open fails):
// the index is held in memory, the reason names the file, and nothing is left under the
// cache file's final name; the next process builds it once the way is clear.
TEST(RecordIndex, CacheFileThatCannotBeWrittenLeavesNoFileAndFallsBackToMemory) {
  TempDir d;
  const std::vector<uint64_t> keys = {0, 1, 2, 3};
  const auto where = write_rec(d / "a.rec", d / "a.idx", keys);
  const std::string cache = d / "c";
  std::string cache_file;
  {
    // Learn the cache file's name from a build in another folder.
    const IndexedRecordIO probe(d / "a.rec", d / "a.idx", cache_in(d / "probe"));
    for (const auto& e : fs::directory_iterator(d / "probe"))
      if (e.path().extension() == ".fsidx") cache_file = e.path().filename().string();
  }
  ASSERT_FALSE(cache_file.empty());
  const std::string blocker = cache + "/" + cache_file + ".tmp." + std::to_string(::getpid());
  fs::create_directories(blocker);
  {
    const IndexedRecordIO r(d / "a.rec", d / "a.idx", cache_in(cache));
    EXPECT_TRUE(r.index().cache_failed()) << r.index().source();
    EXPECT_NE(r.index().source().find("cannot write " + cache + "/" + cache_file), std::string::npos)
        << r.index().source();
    EXPECT_NE(r.index().source().find(std::strerror(EISDIR)), std::string::npos) << r.index().source();
    // The reason alone, as the trainer's warning quotes it.
    EXPECT_EQ(r.index().source(), "memory (" + r.index().cache_problem() + ")");
    EXPECT_EQ(r.index().cache_problem().rfind("cannot write " + cache + "/" + cache_file, 0), 0u)
        << r.index().cache_problem();
    EXPECT_FALSE(fs::exists(cache + "/" + cache_file));
    expect_index_equals(r, keys, where);
  }
  fs::remove(blocker);
  const IndexedRecordIO r(d / "a.rec", d / "a.idx", cache_in(cache));
  EXPECT_FALSE(r.index().cache_failed()) << r.index().source();
  EXPECT_EQ(r.index().cache_problem(), "");
  EXPECT_NE(r.index().source().find("(built)"), std::string::npos) << r.index().source();
  expect_index_equals(r, keys, where);
}

TEST(RecordIndex, MinimumCachedSizeComesFromTheEnvironment) {
  const char* before = std::getenv("FACESHARD_INDEX_CACHE_MIN_BYTES");
  const std::string saved = before ? before : "";
  const uint64_t fallback = RecordIndexOptions{}.min_cache_bytes;
  ::setenv("FACESHARD_INDEX_CACHE_MIN_BYTES", "0", 1);
  EXPECT_EQ(default_record_index_options().min_cache_bytes, 0u);
  ::setenv("FACESHARD_INDEX_CACHE_MIN_BYTES", "4096", 1);
  EXPECT_EQ(default_record_index_options().min_cache_bytes, 4096u);
  for (const char* bad : {"-1", "12k", "", "99999999999999999999999"}) {
    ::setenv("FACESHARD_INDEX_CACHE_MIN_BYTES", bad, 1);
    EXPECT_EQ(default_record_index_options().min_cache_bytes, fallback) << "'" << bad << "'";
  }
  if (before) ::setenv("FACESHARD_INDEX_CACHE_MIN_BYTES", saved.c_str(), 1);
  else ::unsetenv("FACESHARD_INDEX_CACHE_MIN_BYTES");
}

TEST(RecordIndex, DuplicateKeysAndSharedOffsetsAreRejected) {
  TempDir d;
  write_rec(d / "a.rec", d / "a.idx", {0, 1, 2, 3});
  const auto offsets = read_index(d / "a.idx");
  auto open_with = [&](const std::string& text, bool cached) {
    std::ofstream(d / "a.idx", std::ios::trunc) << text;
    return error_of([&] { IndexedRecordIO r(d / "a.rec", d / "a.idx", cached ? cache_in(d / "c") : RecordIndexOptions{}); });
  };
  const std::string o1 = std::to_string(offsets[1].offset), o2 = std::to_string(offsets[2].offset);
  for (bool cached : {false, true}) {
    std::string msg = open_with("0\t0\n1\t" + o1 + "\n2\t" + o1 + "\n", cached);
    EXPECT_NE(msg.find("a.idx: keys 1 and 2 both point at offset " + o1), std::string::npos) << msg;
    msg = open_with("7\t" + o2 + "\n3\t0\n5\t" + o2 + "\n", cached);
    EXPECT_NE(msg.find("keys 5 and 7 both point at offset " + o2), std::string::npos) << msg;
    msg = open_with("1\t0\n1\t" + o1 + "\n", cached);
    EXPECT_NE(msg.find("a.idx: duplicate key 1"), std::string::npos) << msg;
  }
}

TEST(RecordIndex, ProcessesOfOneHostShareOneCacheFile) {
  TempDir d;
  std::vector<uint64_t> keys(2000);
  for (uint64_t i = 0; i < keys.size(); ++i) keys[i] = i + 10;
  const auto where = write_rec(d / "a.rec", d / "a.idx", keys);
  std::vector<pid_t> kids;
  for (int i = 0; i < 4; ++i) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int rc = 0;
      try {
        const IndexedRecordIO r(d / "a.rec", d / "a.idx", cache_in(d / "c"));
        for (uint64_t k : keys) rc |= r.offset_of(k) != where.at(k);
        rc |= r.index().source().rfind("cache ", 0) != 0;
      } catch (...) {
        rc = 3;
      }
      ::_exit(rc);
    }
    kids.push_back(pid);
  }
  for (pid_t pid : kids) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  int files = 0;
  for (const auto& e : fs::directory_iterator(d / "c")) files += e.path().extension() == ".fsidx";
  EXPECT_EQ(files, 1);
}

// ---------------------------------------------------------------------------------------
// Rounded key labels.

TEST(InsightFaceRounding, RoundingAt24BitsIsFloat32s) {
  std::mt19937_64 g(5);
  std::vector<uint64_t> ks = {0, 1, 16777215, 16777216, 16777217, 16777218, 16777219, 16777220, 17091658,
                              42474559, 42474560, 33554431, 33554433, 33554434, 33554435, 33554438};
  for (int i = 0; i < 20000; ++i) ks.push_back(g() % (uint64_t(1) << 30));
  for (uint64_t k : ks) EXPECT_EQ(round_key_to_bits(k, 24), uint64_t(float(k))) << k;
  EXPECT_EQ(round_key_to_bits(16777219, 24), 16777220u);  // the 16,777,218 images
  EXPECT_EQ(round_key_to_bits(41, 4), 40u);
  EXPECT_EQ(round_key_to_bits(42, 4), 40u);  // tie: to even
  EXPECT_EQ(round_key_to_bits(46, 4), 48u);
}

struct RoundedRec {
  TempDir d;
  std::vector<int64_t> cls;                        // class of image key i + 1
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // per class [first, end)
  int64_t classes;
  // n images over `classes` classes (some empty), labels rounded to `bits`.
  RoundedRec(int n, int64_t classes_, int bits) : classes(classes_) {
    std::mt19937_64 g(uint64_t(n * 31 + bits));
    for (int i = 0; i < n; ++i) cls.push_back(int64_t(g() % uint64_t(classes)));
    std::sort(cls.begin(), cls.end());
    InsightFaceRecWriter w(d / "train.rec", d / "train.idx", bits);
    ranges.assign(size_t(classes), {0, 0});
    for (int64_t c = 0, k = 1; c < classes; ++c) {
      ranges[size_t(c)].first = uint64_t(k);
      while (k <= n && cls[size_t(k - 1)] == c) ++k;
      ranges[size_t(c)].second = uint64_t(k);
    }
    for (int i = 0; i < n; ++i) {
      const std::vector<uint8_t> img(1 + i % 5, uint8_t(i));  // 1- to 5-byte payloads
      w.add(cls[size_t(i)], img);
    }
    w.commit(classes);
  }
};

TEST(InsightFaceRounding, RoundedHeaderAndRangesResolveToTheTrueKeys) {
  // At 4 bits, 41 rounds to 40, 43 to 44, 91 to 88: the sizes cover both directions.
  for (int n : {39, 40, 42, 43, 57, 90, 117}) {
    for (int64_t classes : {3, 7, 30}) {
      RoundedRec f(n, classes, 4);
      const IndexedRecordIO r(f.d / "train.rec", f.d / "train.idx");
      const InsightFaceLayout layout = read_insightface_layout(r, 4);
      const std::string ctx = "n=" + std::to_string(n) + " classes=" + std::to_string(classes);
      ASSERT_TRUE(layout.has_header);
      EXPECT_EQ(layout.image_begin, 1u) << ctx;
      EXPECT_EQ(layout.image_end, uint64_t(n) + 1) << ctx;
      EXPECT_EQ(layout.identity_begin, uint64_t(n) + 1) << ctx;
      EXPECT_EQ(layout.num_identities(), uint64_t(classes)) << ctx;
      for (int64_t c = 0; c < classes; ++c) {
        EXPECT_EQ(read_identity_range(r, layout, layout.identity_begin + uint64_t(c)), f.ranges[size_t(c)])
            << ctx << " class " << c;
      }
      // The loader's view: exactly the image records, with their classes, the last ones
      // before the identity records included.
      const RecordIODataset ds(f.d / "train.rec", f.d / "train.idx", RecordIndexOptions{}, 4);
      ASSERT_EQ(ds.size(), uint64_t(n)) << ctx;
      EXPECT_EQ(ds.num_classes(), classes) << ctx;
      RawSample s;
      for (uint64_t i = 0; i < ds.size(); ++i) {
        ds.read(i, s);
        EXPECT_EQ(s.label, f.cls[i]) << ctx << " image " << i;
        EXPECT_EQ(s.bytes, std::vector<uint8_t>(1 + i % 5, uint8_t(i))) << ctx << " image " << i;
      }
    }
  }
}

TEST(InsightFaceRounding, HeaderOffByMoreThanRoundingNamesKeyAndValue) {
  TempDir d;
  // 60 images, identity record 61. label[0] 56 stands for keys [54, 58] at 4 bits, none of
  // which ends the images; 80 stands for [76, 84], past every key of the file.
  auto write = [&](float end, float id_end) {
    RecordIOWriter w(d / "h.rec", d / "h.idx");
    w.write(0, pack_image_record(0.f, {end, id_end}, 0, 0, nullptr, 0));
    const uint8_t px = 7;
    for (uint64_t k = 1; k <= 60; ++k) w.write(k, pack_image_record(0.f, {}, k, 0, &px, 1));
    w.write(61, pack_image_record(0.f, {1.f, 60.f}, 0, 0, nullptr, 0));  // 61 rounded
    w.commit();
  };
  write(56.f, 64.f);
  {
    const IndexedRecordIO r(d / "h.rec", d / "h.idx");
    const std::string msg = error_of([&] { read_insightface_layout(r, 4); });
    EXPECT_NE(msg.find("h.rec: key 0 (header record): image-key end label[0] 56 is not where the image records end: "
                       "none of the keys [54, 58] that round to 56"),
              std::string::npos)
        << msg;
  }
  write(80.f, 80.f);
  {
    const IndexedRecordIO r(d / "h.rec", d / "h.idx");
    const std::string msg = error_of([&] { read_insightface_layout(r, 4); });
    EXPECT_NE(msg.find("image-key end label[0] 80 is not where the image records end: no key of the file rounds to 80"),
              std::string::npos)
        << msg;
  }
  // A label near 2^48 in a small file is refused at once (no search through 2^24 keys).
  write(2.8e14f, 2.8e14f);
  {
    const IndexedRecordIO r(d / "h.rec", d / "h.idx");
    EXPECT_NE(error_of([&] { read_insightface_layout(r); }).find("no key of the file rounds to"), std::string::npos);
  }
  // label[0] right (61 rounds to 60), label[1] 80 for identity end 62: wrong by more than rounding.
  write(60.f, 80.f);
  {
    const IndexedRecordIO r(d / "h.rec", d / "h.idx");
    const std::string msg = error_of([&] { read_insightface_layout(r, 4); });
    EXPECT_NE(msg.find("identity-key end label[1] 80 is not where the identity records end"), std::string::npos)
        << msg;
  }
  write(60.f, 64.f);  // 62 rounds to 64
  {
    const IndexedRecordIO r(d / "h.rec", d / "h.idx");
    const InsightFaceLayout l = read_insightface_layout(r, 4);
    EXPECT_EQ(l.image_end, 61u);
    EXPECT_EQ(l.identity_end, 62u);
    EXPECT_EQ(read_identity_range(r, l, 61), (std::pair<uint64_t, uint64_t>{1, 61}));
  }
}


// An index whose keys point at other keys' records: two swapped lines keep every offset a
// distinct record start, so only the records' own header ids (the key, as insightface's
// writers store it) show it. Opening checks a spread sample; reading checks every record.
TEST(IndexCheck, KeysPointingAtOtherRecordsAreCaughtByTheRecordIds) {
  RoundedRec r(600, 20, kLabelBits);
  const auto lines = read_index(r.d / "train.idx");
  auto write_swapped = [&](uint64_t a, uint64_t b) {
    std::ofstream out(r.d / "train.idx", std::ios::trunc);
    for (const auto& e : lines) {
      const uint64_t off = e.key == a ? lines[b].offset : e.key == b ? lines[a].offset : e.offset;
      out << e.key << "\t" << off << "\n";
    }
  };
  ASSERT_EQ(lines[1].key, 1u);
  ASSERT_EQ(lines[600].key, 600u);
  // Intact: opening and reading every image pass.
  {
    RecordIODataset ds(r.d / "train.rec", r.d / "train.idx");
    RawSample s;
    for (uint64_t i = 0; i < ds.size(); ++i) ds.read(i, s);
    EXPECT_EQ(ds.size(), 600u);
  }
  // The first and last images are always in the opening sample.
  write_swapped(1, 600);
  std::string msg = error_of([&] { RecordIODataset ds(r.d / "train.rec", r.d / "train.idx"); });
  EXPECT_NE(msg.find("train.rec: key 1 at offset " + std::to_string(lines[600].offset) +
                     ": the record's header id is 600, not its key 1"),
            std::string::npos)
      << msg;
  // Keys 302 and 303 (images 301, 302) fall between the 256 sampled images of 600: opening
  // passes, reading them fails.
  write_swapped(302, 303);
  {
    RecordIODataset ds(r.d / "train.rec", r.d / "train.idx");
    RawSample s;
    msg = error_of([&] { ds.read(301, s); });  // image 301 is key 302
    EXPECT_NE(msg.find("key 302 at offset " + std::to_string(lines[303].offset) +
                       ": the record's header id is 303, not its key 302"),
              std::string::npos)
        << msg;
    const IndexedRecordIO rec(r.d / "train.rec", r.d / "train.idx");
    const InsightFaceLayout layout = read_insightface_layout(rec);
    EXPECT_NE(error_of([&] { check_index_sample(rec, layout, 600); }).find("header id is 303, not its key 302"),
              std::string::npos);
    EXPECT_EQ(error_of([&] { check_index_sample(rec, layout, 256); }), "<no error>");
  }
}

}  // namespace
}  // namespace faceshard
