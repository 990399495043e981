// RecordIO (.rec/.idx), the image-record header and insightface's layout: round trips,
// byte-for-byte agreement with an independent Python (struct-only) implementation of
// MXNet's rules, and corrupt inputs that must give faceshard::Error, never a crash.
// Plain C++ (no LibTorch): this file is also built into the AddressSanitizer target.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_paths.h"
#include "data/image_record.h"
#include "data/insightface_rec.h"
#include "data/recordio.h"
#include "base/error.h"
#include "tests/test_errors.h"
#include "tests/test_files.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;
using testing::slurp;
using testing::spit;

void spit_text(const std::string& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary);
  out << s;
}
const uint8_t kMagicBytes[4] = {0x0a, 0x23, 0xd7, 0xce};  // 0xced7230a, little-endian

std::vector<uint8_t> random_bytes(std::mt19937_64& g, size_t n) {
  std::vector<uint8_t> b(n);
  for (auto& x : b) x = uint8_t(g());
  return b;
}

// Payloads that exercise every padding and every split position of the magic word.
std::vector<std::vector<uint8_t>> tricky_payloads() {
  std::mt19937_64 g(7);
  std::vector<std::vector<uint8_t>> p;
  for (size_t n = 0; n < 9; ++n) p.push_back(random_bytes(g, n));
  auto with_magic = [&](size_t n, std::vector<size_t> at) {
    auto b = random_bytes(g, n);
    for (size_t a : at) std::memcpy(b.data() + a, kMagicBytes, 4);
    return b;
  };
  p.push_back(with_magic(4, {0}));              // the payload is only the magic
  p.push_back(with_magic(8, {0, 4}));           // two in a row
  p.push_back(with_magic(37, {8}));             // one in the middle
  p.push_back(with_magic(40, {0, 20, 36}));     // at the start and the end
  p.push_back(with_magic(23, {5}));             // unaligned: no split
  p.push_back(with_magic(1000, {100, 104, 512, 996}));
  return p;
}

TEST(RecordIO, EncodeMatchesDmlcLayout) {
  // Closed form: magic | lrec | payload | zero padding.
  const std::vector<uint8_t> payload = {1, 2, 3, 4, 5};
  const auto enc = recordio::encode_record(payload.data(), payload.size());
  const std::vector<uint8_t> expect = {0x0a, 0x23, 0xd7, 0xce, 5, 0, 0, 0, 1, 2, 3, 4, 5, 0, 0, 0};
  EXPECT_EQ(enc, expect);
  // A magic word at offset 4 splits into a start part of 4 bytes and an end part of 4.
  std::vector<uint8_t> m = {9, 9, 9, 9, 0x0a, 0x23, 0xd7, 0xce, 7, 7, 7, 7};
  const auto enc2 = recordio::encode_record(m.data(), m.size());
  const std::vector<uint8_t> expect2 = {0x0a, 0x23, 0xd7, 0xce, 4, 0, 0, 0x20, 9, 9, 9, 9,
                                        0x0a, 0x23, 0xd7, 0xce, 4, 0, 0, 0x60, 7, 7, 7, 7};
  EXPECT_EQ(enc2, expect2);
}

TEST(RecordIO, RoundTripIndexedAndSequential) {
  TempDir d;
  const auto payloads = tricky_payloads();
  {
    RecordIOWriter w(d / "a.rec", d / "a.idx");
    for (size_t i = 0; i < payloads.size(); ++i) w.write(100 + i, payloads[i]);
    EXPECT_FALSE(fs::exists(d / "a.rec"));  // only under a temporary name until commit
    w.commit();
  }
  const IndexedRecordIO r(d / "a.rec", d / "a.idx");
  ASSERT_EQ(r.num_entries(), payloads.size());
  std::vector<uint8_t> buf;
  for (size_t i = 0; i < payloads.size(); ++i) {
    r.read(100 + i, buf);
    EXPECT_EQ(buf, payloads[i]) << "record " << i;
  }
  RecordIOReader seq(d / "a.rec");
  size_t n = 0;
  while (seq.next(buf)) {
    ASSERT_LT(n, payloads.size());
    EXPECT_EQ(buf, payloads[n]) << "sequential record " << n;
    ++n;
  }
  EXPECT_EQ(n, payloads.size());
}

TEST(RecordIO, SparseKeysAndDuplicates) {
  TempDir d;
  const std::vector<uint64_t> keys = {5000000000ull, 3, 77777, 12};
  {
    RecordIOWriter w(d / "k.rec", d / "k.idx");
    for (uint64_t k : keys) w.write(k, std::vector<uint8_t>(k % 13, uint8_t(k)));
    w.commit();
  }
  const IndexedRecordIO r(d / "k.rec", d / "k.idx");
  std::vector<uint8_t> buf;
  for (uint64_t k : keys) {
    r.read(k, buf);
    EXPECT_EQ(buf, std::vector<uint8_t>(k % 13, uint8_t(k))) << k;
  }
  EXPECT_FALSE(r.contains(4));
  EXPECT_FALSE(r.contains(5000000001ull));
  spit_text(d / "k.idx", "5000000000\t0\n3\t8\n5000000000\t16\n");
  try {
    IndexedRecordIO dup(d / "k.rec", d / "k.idx");
    FAIL() << "duplicate key accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("duplicate key 5000000000"), std::string::npos) << e.what();
  }
}

TEST(RecordIO, UncommittedWriterLeavesNothing) {
  TempDir d;
  {
    RecordIOWriter w(d / "b.rec", d / "b.idx");
    w.write(0, std::vector<uint8_t>{1, 2, 3});
  }
  EXPECT_TRUE(fs::is_empty(d.path));
}

TEST(RecordIO, ImageHeaderPackUnpack) {
  const std::vector<uint8_t> img = {0xff, 0xd8, 0xff, 0xe0, 1, 2};
  auto rec = pack_image_record(42.f, {}, 7, 9, img.data(), img.size());
  ASSERT_EQ(rec.size(), 24 + img.size());
  auto v = unpack_image_record(rec, "x");
  EXPECT_EQ(v.header.flag, 0u);
  EXPECT_EQ(v.header.label, 42.f);
  EXPECT_EQ(v.header.id, 7u);
  EXPECT_EQ(v.header.id2, 9u);
  EXPECT_EQ(std::vector<uint8_t>(v.image, v.image + v.image_size), img);
  rec = pack_image_record(0.f, {3.f, 1.f}, 1, 0, img.data(), img.size());
  v = unpack_image_record(rec, "x");
  EXPECT_EQ(v.header.flag, 2u);
  ASSERT_EQ(v.labels.size(), 2u);
  EXPECT_EQ(v.class_label(), 3.f);
  EXPECT_EQ(v.image_size, img.size());
}

TEST(InsightFaceRec, WriterLayoutReadsBack) {
  TempDir d;
  std::mt19937_64 g(3);
  // classes 0 (3 images), 1 (none), 2 (2 images); declared 4 classes.
  const std::vector<int64_t> cls = {0, 0, 0, 2, 2};
  std::vector<std::vector<uint8_t>> imgs;
  {
    InsightFaceRecWriter w(d / "t.rec", d / "t.idx");
    for (int64_t c : cls) {
      imgs.push_back(random_bytes(g, 50 + imgs.size()));
      w.add(c, imgs.back());
    }
    w.commit(4);
  }
  const IndexedRecordIO r(d / "t.rec", d / "t.idx");
  const auto layout = read_insightface_layout(r);
  EXPECT_TRUE(layout.has_header);
  EXPECT_EQ(layout.image_begin, 1u);
  EXPECT_EQ(layout.image_end, 6u);
  EXPECT_EQ(layout.identity_begin, 6u);
  EXPECT_EQ(layout.identity_end, 10u);
  EXPECT_EQ(read_identity_range(r, layout, 6), (std::pair<uint64_t, uint64_t>{1, 4}));
  EXPECT_EQ(read_identity_range(r, layout, 7), (std::pair<uint64_t, uint64_t>{4, 4}));
  EXPECT_EQ(read_identity_range(r, layout, 8), (std::pair<uint64_t, uint64_t>{4, 6}));
  EXPECT_EQ(read_identity_range(r, layout, 9), (std::pair<uint64_t, uint64_t>{6, 6}));
  std::vector<uint8_t> buf;
  for (size_t i = 0; i < cls.size(); ++i) {
    r.read(i + 1, buf);
    const auto v = unpack_image_record(buf, "t");
    EXPECT_EQ(v.class_label(), float(cls[i]));
    EXPECT_EQ(std::vector<uint8_t>(v.image, v.image + v.image_size), imgs[i]);
  }
  EXPECT_THROW(InsightFaceRecWriter(d / "u.rec", d / "u.idx").add(-1, imgs[0]), Error);
}

// ---------------------------------------------------------------------------------------
// Independent implementation: MXNet's rules written in Python with only `struct`.

const char* kPyFixture = R"PY(
import struct, sys, random
out = sys.argv[1]
MAGIC = 0xced7230a
MB = struct.pack('<I', MAGIC)

def encode(buf):
    # dmlc::RecordIOWriter::WriteRecord: cut at 4-byte aligned magic words.
    res = b''
    n = len(buf)
    dptr = 0
    for i in range(0, n - n % 4, 4):
        if buf[i:i+4] == MB:
            res += MB + struct.pack('<I', ((1 if dptr == 0 else 2) << 29) | (i - dptr)) + buf[dptr:i]
            dptr = i + 4
    res += MB + struct.pack('<I', ((3 if dptr else 0) << 29) | (n - dptr)) + buf[dptr:]
    res += b'\x00' * ((4 - n % 4) % 4)
    return res

def pack(flag_labels, label, id_, id2, img):
    # mxnet.recordio.pack: 'IfQQ' header, then `flag` float32 labels.
    if flag_labels is None:
        return struct.pack('<IfQQ', 0, label, id_, id2) + img
    return struct.pack('<IfQQ', len(flag_labels), 0.0, id_, id2) + struct.pack('<%df' % len(flag_labels), *flag_labels) + img

rng = random.Random(11)
images = []  # (key, class, uses_flag_labels, img)
classes = [0, 0, 1, 1, 1, 2]
for i, c in enumerate(classes):
    img = bytes(rng.randrange(256) for _ in range(rng.randrange(30, 90)))
    if i == 2:
        img = img[:8] + MB + img[12:] + MB        # magic in the payload (aligned after the header)
    images.append((i + 1, c, i % 2 == 1, img))
n = len(images)
ncls = 3
recs = [(0, pack([float(n + 1), float(n + 1 + ncls)], 0, 0, 0, b''))]
for key, c, flagged, img in images:
    recs.append((key, pack([float(c), 1.0], 0, key, 0, img) if flagged else pack(None, float(c), key, 0, img)))
for c in range(ncls):
    keys = [k for k, cc, _, _ in images if cc == c]
    recs.append((n + 1 + c, pack([float(min(keys)), float(max(keys) + 1)], 0, 0, 0, b'')))
# Write the records in a shuffled physical order: the .idx, not the file order, defines keys.
order = list(range(len(recs)))
rng.shuffle(order)
data = b''
idx = ''
for j in order:
    key, payload = recs[j]
    idx += '%d\t%d\n' % (key, len(data))
    data += encode(payload)
open(out + '/py.rec', 'wb').write(data)
open(out + '/py.idx', 'w').write(idx)
# The plain payloads in physical order, framed as <u64 key><u32 len><bytes>, for the
# byte-for-byte comparison with the C++ writer.
with open(out + '/payloads', 'wb') as f:
    for j in order:
        key, payload = recs[j]
        f.write(struct.pack('<QI', key, len(payload)) + payload)
# What a reader must find: key class flag image-hex
with open(out + '/expect.txt', 'w') as f:
    for key, c, flagged, img in images:
        f.write('%d %d %d %s\n' % (key, c, 2 if flagged else 0, img.hex()))
)PY";

int run_python(const std::string& script_path, const std::string& args) {
  const std::string cmd = std::string("\"") + FACESHARD_PYTHON + "\" \"" + script_path + "\" " + args;
  return std::system(cmd.c_str());
}

std::vector<uint8_t> from_hex(const std::string& h) {
  std::vector<uint8_t> b;
  for (size_t i = 0; i + 1 < h.size(); i += 2) b.push_back(uint8_t(std::stoi(h.substr(i, 2), nullptr, 16)));
  return b;
}

TEST(RecordIOPython, ReadsStructWrittenFixtureAndWritesIdenticalBytes) {
  TempDir d;
  spit_text(d / "fixture.py", kPyFixture);
  ASSERT_EQ(run_python(d / "fixture.py", d.path), 0) << "python fixture failed";

  const IndexedRecordIO r(d / "py.rec", d / "py.idx");
  const InsightFaceLayout layout = read_insightface_layout(r);
  EXPECT_TRUE(layout.has_header);
  EXPECT_EQ(layout.num_identities(), 3u);
  std::ifstream ex(d / "expect.txt");
  std::string line;
  size_t n = 0;
  std::vector<uint8_t> buf;
  while (std::getline(ex, line)) {
    std::istringstream ss(line);
    uint64_t key;
    int cls, flag;
    std::string hex;
    ss >> key >> cls >> flag >> hex;
    ASSERT_LT(n, layout.num_images());
    EXPECT_EQ(layout.image_key(r, n), key);
    r.read(key, buf);
    const auto v = unpack_image_record(buf, "py.rec");
    EXPECT_EQ(int(v.header.flag), flag) << "key " << key;
    EXPECT_EQ(v.class_label(), float(cls)) << "key " << key;
    EXPECT_EQ(v.header.id, key);
    EXPECT_EQ(std::vector<uint8_t>(v.image, v.image + v.image_size), from_hex(hex)) << "key " << key;
    ++n;
  }
  EXPECT_EQ(n, 6u);
  for (uint64_t k = layout.identity_begin; k < layout.identity_end; ++k) {
    const auto range = read_identity_range(r, layout, k);
    EXPECT_LT(range.first, range.second);
  }

  // The C++ writer, given the same payloads in the same order, writes identical files.
  const auto framed = slurp(d / "payloads");
  {
    RecordIOWriter w(d / "cc.rec", d / "cc.idx");
    size_t p = 0;
    while (p < framed.size()) {
      uint64_t key;
      uint32_t len;
      std::memcpy(&key, framed.data() + p, 8);
      std::memcpy(&len, framed.data() + p + 8, 4);
      w.write(key, framed.data() + p + 12, len);
      p += 12 + len;
    }
    w.commit();
  }
  EXPECT_EQ(slurp(d / "cc.rec"), slurp(d / "py.rec"));
  EXPECT_EQ(slurp(d / "cc.idx"), slurp(d / "py.idx"));
}

// ---------------------------------------------------------------------------------------
// Corrupt inputs: each must be a faceshard::Error whose message names the thing.

using testing::error_of;

struct SmallRec {
  TempDir d;
  std::vector<std::vector<uint8_t>> payloads = tricky_payloads();
  std::string rec = d / "s.rec", idx = d / "s.idx";
  SmallRec() {
    RecordIOWriter w(rec, idx);
    for (size_t i = 0; i < payloads.size(); ++i) w.write(i, payloads[i]);
    w.commit();
  }
  // Reads every key; true when all succeed.
  bool read_all() const {
    const IndexedRecordIO r(rec, idx);
    std::vector<uint8_t> buf;
    for (uint64_t i = 0; i < r.num_entries(); ++i) r.read(r.entry(i).key, buf);
    return true;
  }
};

TEST(RecordIOCorrupt, TruncatedFileAtEveryLength) {
  SmallRec s;
  const auto full = slurp(s.rec);
  const auto entries = read_index(s.idx);
  // Every cut in the first records (headers, paddings, split parts), then a stride.
  for (size_t cut = 0; cut < full.size(); cut += (cut < 160 ? 1 : 7)) {
    spit(s.rec, std::vector<uint8_t>(full.begin(), full.begin() + cut));
    // Sequential scan must fail (the file ends inside a record).
    const std::string msg = error_of([&] {
      RecordIOReader rd(s.rec);
      std::vector<uint8_t> b;
      while (rd.next(b)) {
      }
    });
    if (cut == 0) {
      EXPECT_EQ(msg, "<no error>");  // an empty file is an empty record file
    } else {
      bool at_boundary = false;
      for (const auto& e : entries) at_boundary |= (e.offset == cut);
      if (!at_boundary) {
        EXPECT_NE(msg.find("s.rec"), std::string::npos) << "cut " << cut << ": " << msg;
      }
    }
    // Indexed reads: opening may fail (offset past the end) or reads fail; never a crash.
    const std::string m2 = error_of([&] { s.read_all(); });
    EXPECT_NE(m2, "<no error>") << "cut " << cut;
  }
}

TEST(RecordIOCorrupt, BadMagicNamesFileKeyAndOffset) {
  SmallRec s;
  auto bytes = slurp(s.rec);
  const auto entries = read_index(s.idx);
  bytes[entries[3].offset] ^= 0xff;
  spit(s.rec, bytes);
  const IndexedRecordIO r(s.rec, s.idx);
  std::vector<uint8_t> buf;
  const std::string msg = error_of([&] { r.read(3, buf); });
  EXPECT_NE(msg.find("s.rec"), std::string::npos) << msg;
  EXPECT_NE(msg.find("key 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("offset " + std::to_string(entries[3].offset)), std::string::npos) << msg;
  EXPECT_NE(msg.find("magic"), std::string::npos) << msg;
  r.read(2, buf);  // the others are fine
  EXPECT_EQ(buf, s.payloads[2]);
}

TEST(RecordIOCorrupt, LyingLengths) {
  SmallRec s;
  const auto orig = slurp(s.rec);
  const auto entries = read_index(s.idx);
  const uint64_t off = entries.back().offset;  // the 1000-byte record with magic words
  auto set_lrec = [&](uint64_t at, uint32_t v) {
    auto b = orig;
    std::memcpy(b.data() + at + 4, &v, 4);
    spit(s.rec, b);
  };
  const uint64_t key = entries.back().key;
  std::vector<uint8_t> buf;
  // Length far past the end of the file.
  set_lrec(off, recordio::encode_lrec(0, recordio::kMaxPartLength));
  {
    const IndexedRecordIO r(s.rec, s.idx);
    const std::string msg = error_of([&] { r.read(key, buf); });
    EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
    EXPECT_NE(msg.find("key " + std::to_string(key)), std::string::npos) << msg;
  }
  // Continuation flag on a first part, and a start part followed by a whole record.
  for (uint32_t flag : {2u, 3u, 4u, 7u}) {
    set_lrec(entries[0].offset, recordio::encode_lrec(flag, 0));
    const IndexedRecordIO r(s.rec, s.idx);
    EXPECT_NE(error_of([&] { r.read(entries[0].key, buf); }).find("part flag"), std::string::npos) << flag;
  }
  set_lrec(entries[0].offset, recordio::encode_lrec(1, 0));
  {
    const IndexedRecordIO r(s.rec, s.idx);
    EXPECT_NE(error_of([&] { r.read(entries[0].key, buf); }).find("not continued"), std::string::npos);
  }
  // A shorter length leaves the scan in the middle of a record: the next magic is wrong.
  set_lrec(entries[5].offset, recordio::encode_lrec(0, 1));
  EXPECT_NE(error_of([&] {
              RecordIOReader rd(s.rec);
              while (rd.next(buf)) {
              }
            }).find("magic"),
            std::string::npos);
}

TEST(RecordIOCorrupt, WrongIndexOffsetsAndMalformedIndex) {
  SmallRec s;
  const auto entries = read_index(s.idx);
  const uint64_t size = fs::file_size(s.rec);
  auto idx_with = [&](const std::string& text) {
    spit_text(s.idx, text);
    return error_of([&] { s.read_all(); });
  };
  // Unaligned, past the end, inside a payload, onto the second part of a split record.
  EXPECT_NE(idx_with("0\t2\n").find("cannot start a record"), std::string::npos);
  EXPECT_NE(idx_with("0\t" + std::to_string(size) + "\n").find("cannot start a record"), std::string::npos);
  EXPECT_NE(idx_with("0\t99999999999\n").find("cannot start a record"), std::string::npos);
  EXPECT_NE(idx_with("0\t" + std::to_string(entries[14].offset + 12) + "\n").find("magic"), std::string::npos);
  {
    // Record 10 ("magic, magic") is three parts; its second part starts 8 bytes in.
    const std::string msg = idx_with("5\t" + std::to_string(entries[10].offset + 8) + "\n");
    EXPECT_NE(msg.find("middle of a multi-part record"), std::string::npos) << msg;
    EXPECT_NE(msg.find("key 5"), std::string::npos) << msg;
  }
  EXPECT_NE(idx_with("0 8\n").find("expected '<key>\\t<offset>'"), std::string::npos);
  EXPECT_NE(idx_with("x\t0\n").find("unsigned integer key"), std::string::npos);
  EXPECT_NE(idx_with("1\t-4\n").find("unsigned integer offset"), std::string::npos);
  EXPECT_NE(idx_with("1\t0\n1\t8\n").find("duplicate key 1"), std::string::npos);
  EXPECT_NE(idx_with("1\t99999999999999999999999\n").find("offset"), std::string::npos);
  // Missing files are usage errors that name the file.
  fs::remove(s.idx);
  try {
    IndexedRecordIO r(s.rec, s.idx);
    FAIL() << "no error for a missing .idx";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Usage);
    EXPECT_NE(std::string(e.what()).find("s.idx"), std::string::npos);
  }
  const IndexedRecordIO empty_ok(s.rec, (spit_text(s.idx, ""), s.idx));
  std::vector<uint8_t> buf;
  EXPECT_NE(error_of([&] { empty_ok.read(3, buf); }).find("not in the index"), std::string::npos);
}

TEST(RecordIOCorrupt, ImageRecordAndHeaderLies) {
  std::vector<uint8_t> short_rec(23, 0);
  EXPECT_NE(error_of([&] { unpack_image_record(short_rec, "f: key 9"); }).find("key 9"), std::string::npos);
  auto rec = pack_image_record(1.f, {}, 0, 0, nullptr, 0);
  for (uint32_t flag : {1u, 0xffffffffu, 0x40000000u}) {
    std::memcpy(rec.data(), &flag, 4);
    EXPECT_NE(error_of([&] { unpack_image_record(rec, "f"); }).find("labels"), std::string::npos) << flag;
  }
  EXPECT_THROW(label_to_class(std::nanf(""), "f"), Error);
  EXPECT_THROW(label_to_class(-1.f, "f"), Error);
  EXPECT_THROW(label_to_class(1.5f, "f"), Error);
  EXPECT_THROW(label_to_class(1e20f, "f"), Error);
  EXPECT_EQ(label_to_class(17.f, "f"), 17);

  // Header records whose ranges lie.
  TempDir d;
  auto write_header = [&](std::vector<float> labels, int images) {
    RecordIOWriter w(d / "h.rec", d / "h.idx");
    w.write(0, pack_image_record(0.f, labels, 0, 0, nullptr, 0));
    for (int i = 1; i <= images; ++i) w.write(i, pack_image_record(0.f, {}, 0, 0, nullptr, 0));
    w.commit();
    const IndexedRecordIO r(d / "h.rec", d / "h.idx");
    return error_of([&] { read_insightface_layout(r); });
  };
  EXPECT_NE(write_header({10.f, 12.f}, 3).find("key 4 is not in"), std::string::npos);
  EXPECT_NE(write_header({std::nanf(""), 12.f}, 3).find("not a record key"), std::string::npos);
  EXPECT_NE(write_header({-3.f, 12.f}, 3).find("not a record key"), std::string::npos);
  EXPECT_NE(write_header({4.f, 2.f}, 3).find("inverted"), std::string::npos);
  EXPECT_NE(write_header({0.f, 2.f}, 3).find(">= 1"), std::string::npos);
  EXPECT_EQ(write_header({4.f, 4.f}, 3), "<no error>");
}

// Random damage to a valid .rec/.idx: every outcome is either data or faceshard::Error.
// Under AddressSanitizer this is the memory-safety check of the parser.
TEST(RecordIOCorrupt, RandomMutationsNeverCrash) {
  SmallRec s;
  const auto rec = slurp(s.rec);
  const auto idx = slurp(s.idx);
  std::mt19937_64 g(99);
  int errors = 0, ok = 0;
  for (int it = 0; it < 200; ++it) {
    auto r2 = rec;
    auto i2 = idx;
    const int flips = 1 + int(g() % 4);
    for (int k = 0; k < flips; ++k) {
      if (g() % 4 == 0) {
        i2[g() % i2.size()] = uint8_t(g());
      } else {
        const size_t at = g() % r2.size();
        // Bias towards the header words, where lies are most dangerous.
        r2[at] = (g() % 2) ? uint8_t(g()) : uint8_t(r2[at] ^ (1u << (g() % 8)));
      }
    }
    if (g() % 5 == 0) r2.resize(g() % r2.size());
    spit(s.rec, r2);
    spit(s.idx, i2);
    try {
      const IndexedRecordIO r(s.rec, s.idx);
      std::vector<uint8_t> buf;
      for (uint64_t i = 0; i < r.num_entries(); ++i) {
        const IndexEntry e = r.entry(i);
        try {
          r.read(e.key, buf);
          ++ok;
          unpack_image_record(buf, "m");
        } catch (const Error&) {
          ++errors;
        }
      }
      RecordIOReader rd(s.rec);
      while (rd.next(buf)) {
      }
    } catch (const Error&) {
      ++errors;
    }
  }
  EXPECT_GT(errors, 0);
  EXPECT_GT(ok, 0);
}

}  // namespace
}  // namespace faceshard
