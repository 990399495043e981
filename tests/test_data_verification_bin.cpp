// insightface verification .bin files: pickles written by Python's own pickle module
// (protocols 2-5, a py2-style stream checked with pickle.loads(encoding='bytes'), str
// images) read by our parser; our writer read back by Python's pickle.load; and garbage,
// truncated or malicious pickles rejected with faceshard::Error. Plain C++ (ASan target).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "tests/test_paths.h"
#include "data/verification_bin.h"
#include "base/error.h"
#include "tests/test_errors.h"
#include "tests/test_files.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;
using testing::spit;

void spit_text(const std::string& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary);
  out << s;
}

VerificationSet random_set(uint64_t seed, size_t pairs) {
  std::mt19937_64 g(seed);
  VerificationSet s;
  for (size_t i = 0; i < 2 * pairs; ++i) {
    // Lengths around the 1-byte/4-byte length forms, and an empty string.
    const size_t n = i == 3 ? 0 : (i % 3 == 0 ? 255 + g() % 3 : g() % 700);
    std::vector<uint8_t> b(n);
    for (auto& x : b) x = uint8_t(g());
    s.images.push_back(std::move(b));
  }
  for (size_t i = 0; i < pairs; ++i) s.issame.push_back(g() % 2);
  return s;
}

// Framing Python reads with struct: <u32 n> (<u32 len> bytes)* <u32 pairs> (<u8 same>)*
std::vector<uint8_t> frame(const VerificationSet& s) {
  std::vector<uint8_t> out;
  auto u32 = [&](uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(uint8_t(v >> (8 * i)));
  };
  u32(uint32_t(s.images.size()));
  for (const auto& b : s.images) {
    u32(uint32_t(b.size()));
    out.insert(out.end(), b.begin(), b.end());
  }
  u32(uint32_t(s.issame.size()));
  for (bool b : s.issame) out.push_back(b ? 1 : 0);
  return out;
}

const char* kPyPickles = R"PY(
import pickle, struct, sys, os
d = sys.argv[1]
raw = open(d + '/input', 'rb').read()
p = 0
def u32():
    global p
    v = struct.unpack_from('<I', raw, p)[0]; p += 4; return v
bins = []
for _ in range(u32()):
    n = u32(); bins.append(raw[p:p + n]); p += n
issame = [bool(raw[p + i]) for i in range(u32())]

for proto in (2, 3, 4, 5):
    open(d + '/p%d.bin' % proto, 'wb').write(pickle.dumps((bins, issame), protocol=proto))
open(d + '/list4.bin', 'wb').write(pickle.dumps([bins, issame], protocol=4))

# A py2 pickle (cPickle.dump(..., protocol=2) of str images): SHORT_BINSTRING/BINSTRING,
# BINPUT memo entries, batched APPENDS. Built opcode by opcode, then checked with pickle.
out = bytearray(b'\x80\x02')
memo = [0]
def put():
    out.extend(b'q' + bytes([memo[0]]) if memo[0] < 256 else b'r' + struct.pack('<I', memo[0])); memo[0] += 1
out += b']'; put()
for i in range(0, len(bins), 1000):
    out += b'('
    for b in bins[i:i + 1000]:
        out += (b'U' + bytes([len(b)]) if len(b) < 256 else b'T' + struct.pack('<i', len(b))) + b; put()
    out += b'e'
out += b']'; put(); out += b'('
for s in issame: out += b'\x88' if s else b'\x89'
out += b'e\x86'; put(); out += b'.'
assert pickle.loads(bytes(out), encoding='bytes') == (bins, issame)
open(d + '/py2.bin', 'wb').write(bytes(out))
# The same py2 file loaded with encoding='latin1' holds str images; re-pickled they are
# BINUNICODE / SHORT_BINUNICODE strings of latin-1 characters.
open(d + '/latin1.bin', 'wb').write(pickle.dumps(pickle.loads(bytes(out), encoding='latin1'), protocol=4))
# The same bytes object twice: the second is a memo GET.
dup = list(bins); dup[1] = dup[0]
open(d + '/dup.bin', 'wb').write(pickle.dumps((dup, issame), protocol=2))

class Evil:
    def __reduce__(self):
        return (os.system, ('echo pwned > ' + d + '/pwned',))
open(d + '/evil.bin', 'wb').write(pickle.dumps((bins[:2], [Evil()]), protocol=2))
open(d + '/evil4.bin', 'wb').write(pickle.dumps(([Evil(), bins[1]], [True]), protocol=4))
open(d + '/dict.bin', 'wb').write(pickle.dumps({'bins': bins, 'issame': issame}, protocol=4))
open(d + '/three.bin', 'wb').write(pickle.dumps((bins, issame, 1), protocol=4))
open(d + '/strsame.bin', 'wb').write(pickle.dumps((bins, ['yes'] * len(issame)), protocol=4))
open(d + '/odd.bin', 'wb').write(pickle.dumps((bins[:-1], issame), protocol=4))
open(d + '/nested.bin', 'wb').write(pickle.dumps(([bins[:2]], [True]), protocol=4))
open(d + '/float.bin', 'wb').write(pickle.dumps((bins[:2], [1.0]), protocol=4))
)PY";

const char* kPyCheck = R"PY(
import pickle, struct, sys
d = sys.argv[1]
raw = open(d + '/input', 'rb').read()
p = 0
def u32():
    global p
    v = struct.unpack_from('<I', raw, p)[0]; p += 4; return v
bins = []
for _ in range(u32()):
    n = u32(); bins.append(raw[p:p + n]); p += n
issame = [bool(raw[p + i]) for i in range(u32())]
with open(d + '/ours.bin', 'rb') as f:
    got = pickle.load(f)
ok = isinstance(got, tuple) and len(got) == 2 and got[0] == bins and got[1] == issame
ok = ok and all(isinstance(b, bytes) for b in got[0]) and all(type(s) is bool for s in got[1])
sys.exit(0 if ok else 3)
)PY";

int run_python(const std::string& script, const std::string& arg) {
  const std::string cmd = std::string("\"") + FACESHARD_PYTHON + "\" \"" + script + "\" \"" + arg + "\"";
  return std::system(cmd.c_str());
}

using testing::error_of;

void expect_same(const VerificationSet& got, const VerificationSet& want, const std::string& what) {
  ASSERT_EQ(got.images.size(), want.images.size()) << what;
  for (size_t i = 0; i < want.images.size(); ++i) EXPECT_EQ(got.images[i], want.images[i]) << what << " image " << i;
  EXPECT_EQ(got.issame, want.issame) << what;
}

TEST(VerificationBin, ReadsPicklesWrittenByPython) {
  TempDir d;
  const VerificationSet want = random_set(5, 30);
  spit(d / "input", frame(want));
  spit_text(d / "pickles.py", kPyPickles);
  ASSERT_EQ(run_python(d / "pickles.py", d.path), 0);
  for (const char* name : {"p2.bin", "p3.bin", "p4.bin", "p5.bin", "list4.bin", "py2.bin", "latin1.bin"}) {
    expect_same(read_verification_bin(d / name), want, name);
  }
  VerificationSet dup = want;
  dup.images[1] = dup.images[0];
  expect_same(read_verification_bin(d / "dup.bin"), dup, "dup.bin");

  // Anything that is not exactly (list of bytes, list of bools) is refused, and nothing runs.
  const std::vector<std::pair<const char*, const char*>> refused = {
      {"evil.bin", "posix.system"}, {"evil4.bin", "system"},   {"dict.bin", "not allowed"},
      {"three.bin", "of 3 items"},  {"strsame.bin", "issame"}, {"odd.bin", "2 per pair"},
      {"nested.bin", "nested more than 2 deep"}, {"float.bin", "not allowed"}};
  for (const auto& [name, why] : refused) {
    const std::string msg = error_of([&] { read_verification_bin(d / name); });
    EXPECT_NE(msg.find(name), std::string::npos) << name << ": " << msg;
    EXPECT_NE(msg.find(why), std::string::npos) << name << ": " << msg;
  }
  EXPECT_FALSE(fs::exists(d / "pwned"));
}

TEST(VerificationBin, WriterOutputLoadsInPython) {
  TempDir d;
  const VerificationSet set = random_set(6, 1300);  // > 1000 items: several APPENDS batches
  spit(d / "input", frame(set));
  write_verification_bin(d / "ours.bin", set);
  spit_text(d / "check.py", kPyCheck);
  EXPECT_EQ(run_python(d / "check.py", d.path), 0);
  expect_same(read_verification_bin(d / "ours.bin"), set, "round trip");
  VerificationSet bad = set;
  bad.issame.pop_back();
  EXPECT_THROW(write_verification_bin(d / "bad.bin", bad), Error);
  EXPECT_FALSE(fs::exists(d / "bad.bin"));
}

TEST(VerificationBinCorrupt, GarbageTruncationAndLies) {
  const VerificationSet set = random_set(8, 4);
  const std::vector<uint8_t> good = encode_verification_bin(set);
  // Every truncation is an error.
  for (size_t cut = 0; cut < good.size(); ++cut) {
    const std::string msg = error_of([&] { parse_verification_bin(good.data(), cut, "t.bin"); });
    EXPECT_NE(msg.find("t.bin"), std::string::npos) << cut << ": " << msg;
  }
  auto bytes_of = [](std::initializer_list<int> v) {
    std::vector<uint8_t> b;
    for (int x : v) b.push_back(uint8_t(x));
    return b;
  };
  const std::vector<std::vector<uint8_t>> lies = {
      {},
      bytes_of({0x80, 0x09, '.'}),                                      // unknown protocol
      bytes_of({0x80, 0x04, 0x8e, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}),  // huge BINBYTES8
      bytes_of({0x80, 0x02, 'T', 0xff, 0xff, 0xff, 0xff}),              // negative BINSTRING
      bytes_of({0x80, 0x02, 'B', 0xff, 0xff, 0xff, 0x0f, 1, 2}),        // BINBYTES past the end
      bytes_of({0x80, 0x02, 'h', 5, '.'}),                              // GET never PUT
      bytes_of({0x80, 0x02, 'e', '.'}),                                 // APPENDS without MARK
      bytes_of({0x80, 0x02, ']', 'a', '.'}),                            // APPEND of nothing
      bytes_of({0x80, 0x02, 0x86, '.'}),                                // TUPLE2 on an empty stack
      bytes_of({0x80, 0x02, ']', 'q', 0, 'h', 0, 'a', '.'}),           // a list into itself
      bytes_of({0x80, 0x02, 0x8c, 2, 0xc3, 0x28, 0x8c, 1, 'x', 0x86, '.'}),  // bad UTF-8 str
      bytes_of({0x80, 0x04, 0x95, 0xff, 0, 0, 0, 0, 0, 0, 0, '.'}),     // frame past the end
      bytes_of({'c', 'o', 's', '\n', 's', 'y', 's', 't', 'e', 'm', '\n', ')', 'R', '.'}),
      bytes_of({0x80, 0x02, ']', ']', 0x86, '.', 0xff}),                // a valid empty set...
  };
  for (size_t i = 0; i + 1 < lies.size(); ++i) {
    EXPECT_NE(error_of([&] { parse_verification_bin(lies[i].data(), lies[i].size(), "g.bin"); }), "<no error>")
        << "case " << i;
  }
  // ...is accepted (trailing bytes after STOP are ignored, as pickle.load does).
  EXPECT_EQ(parse_verification_bin(lies.back().data(), lies.back().size(), "e.bin").num_pairs(), 0u);
  // Deep MARK nesting cannot exhaust the C++ stack (the parser does not recurse).
  std::vector<uint8_t> deep(200000, '(');
  deep.push_back('.');
  EXPECT_NE(error_of([&] { parse_verification_bin(deep.data(), deep.size(), "deep.bin"); }), "<no error>");
  EXPECT_EQ(error_of([&] { read_verification_bin("/nonexistent/lfw.bin"); }).find("/nonexistent/lfw.bin"), 0u);
}

// Nested containers are built without recursion, but freeing them recurses once per
// level: each of these would overflow the C++ stack if the parser accepted it.
TEST(VerificationBinCorrupt, DeepNestingIsRejectedWithFileAndOffset) {
  auto expect_rejected = [](const std::vector<uint8_t>& b, const std::string& what) {
    const std::string msg = error_of([&] { parse_verification_bin(b.data(), b.size(), "deep.bin"); });
    EXPECT_EQ(msg.find("deep.bin"), 0u) << what << ": " << msg;
    EXPECT_NE(msg.find("offset"), std::string::npos) << what << ": " << msg;
  };
  // EMPTY_LIST, then a million TUPLE1s: ((([],),),)...
  std::vector<uint8_t> tuple1(1, ']');
  tuple1.insert(tuple1.end(), 1000000, 0x85);
  tuple1.push_back('.');
  const std::string msg = error_of([&] { parse_verification_bin(tuple1.data(), tuple1.size(), "deep.bin"); });
  EXPECT_NE(msg.find("nested"), std::string::npos) << msg;
  EXPECT_NE(msg.find("offset 2)"), std::string::npos) << msg;  // the second TUPLE1
  expect_rejected(tuple1, "TUPLE1");
  // The same with TUPLE2/TUPLE3 and with MARK ... TUPLE / LIST.
  for (uint8_t op : {uint8_t(0x86), uint8_t(0x87)}) {
    std::vector<uint8_t> b(1, ']');
    for (int i = 0; i < 300000; ++i) {
      b.push_back('N');
      if (op == 0x87) b.push_back('N');
      b.push_back(op);
    }
    b.push_back('.');
    expect_rejected(b, "TUPLE2/3");
  }
  for (uint8_t op : {uint8_t('t'), uint8_t('l')}) {
    std::vector<uint8_t> b(300000, '(');
    b.push_back(']');
    b.insert(b.end(), 300000, op);
    b.push_back('.');
    expect_rejected(b, "MARK ... TUPLE/LIST");
  }
  // A chain of lists through the memo: L0 = [L1], then GET L1 and append L2 to it, ...
  // Each append alone adds a list of scalars, yet the chain grows one level per step.
  auto u32 = [](std::vector<uint8_t>& b, uint32_t v) {
    for (int i = 0; i < 4; ++i) b.push_back(uint8_t(v >> (8 * i)));
  };
  std::vector<uint8_t> chain = {0x80, 0x04, ']', 0x94};  // memo 0 = L0
  for (uint32_t k = 0; k < 500000; ++k) {
    chain.push_back('j');  // LONG_BINGET L_k
    u32(chain, k);
    chain.insert(chain.end(), {']', 0x94, 'a', '0'});  // memo k+1 = L_k+1; L_k.append(L_k+1); POP
  }
  chain.push_back('j');
  u32(chain, 0);
  chain.push_back('.');
  expect_rejected(chain, "memo chain");
  // A valid set still parses: a tuple of two lists, each filled by APPENDS.
  const VerificationSet set = random_set(10, 3);
  const std::vector<uint8_t> good = encode_verification_bin(set);
  EXPECT_EQ(parse_verification_bin(good.data(), good.size(), "ok.bin").num_pairs(), 3u);
}

// BINGET pushes another reference for two bytes of input; the stack is capped.
TEST(VerificationBinCorrupt, StackGrowthIsCapped) {
  std::vector<uint8_t> b = {0x80, 0x02, ']', 'q', 0};
  for (int i = 0; i < (1 << 22) + 10; ++i) b.insert(b.end(), {'h', 0});
  b.push_back('.');
  const std::string msg = error_of([&] { parse_verification_bin(b.data(), b.size(), "big.bin"); });
  EXPECT_EQ(msg.find("big.bin"), 0u) << msg;
  EXPECT_NE(msg.find("stack grows past"), std::string::npos) << msg;
}

// One image referenced through the memo many times (as a hostile .bin does to make its
// reader copy a large string thousands of times): the references share one buffer, and
// past the file's size plus 16 MiB of repeats the set is refused before anything decodes it.
TEST(VerificationBinCorrupt, MemoReferencesShareOneImage) {
  auto u32 = [](std::vector<uint8_t>& b, uint32_t v) {
    for (int i = 0; i < 4; ++i) b.push_back(uint8_t(v >> (8 * i)));
  };
  auto memo_bin = [&](size_t image_bytes, size_t refs, uint8_t string_op) {
    std::vector<uint8_t> b = {0x80, 0x04, ']', '(', string_op};
    u32(b, uint32_t(image_bytes));
    for (size_t i = 0; i < image_bytes; ++i) b.push_back(uint8_t('a' + i % 26));  // ASCII: valid latin-1 text too
    b.push_back(0x94);  // MEMOIZE: memo 0
    for (size_t i = 1; i < refs; ++i) b.insert(b.end(), {'h', 0});
    b.insert(b.end(), {'e', ']', '('});
    b.insert(b.end(), refs / 2, 0x88);
    b.insert(b.end(), {'e', 0x86, '.'});
    return b;
  };
  for (uint8_t op : {uint8_t('B'), uint8_t('X')}) {  // BINBYTES, and a str read as latin-1
    const auto b = memo_bin(100000, 100, op);
    const VerificationSet set = parse_verification_bin(b.data(), b.size(), "memo.bin");
    ASSERT_EQ(set.images.size(), 100u);
    EXPECT_EQ(set.images[99].size(), 100000u);
    for (const auto& img : set.images) EXPECT_TRUE(img.shares(set.images[0])) << "a copy, not a reference";
  }
  // 1 MB image, 18 references: 18 MB counted with repeats > 1 MB + 16 MiB.
  const auto big = memo_bin(1000000, 18, 'B');
  const std::string msg = error_of([&] { parse_verification_bin(big.data(), big.size(), "memo.bin"); });
  EXPECT_EQ(msg.find("memo.bin"), 0u) << msg;
  EXPECT_NE(msg.find("counted with repeats"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  // Repeats (references beyond an image's first) are bounded by the distinct images:
  // at most 2 per distinct image + 1024. One image: 1026 references pass, 1028 do not.
  for (const size_t refs : {size_t(1026), size_t(1028), size_t(20000)}) {
    const auto b = memo_bin(10, refs, 'B');
    if (refs == 1026) {
      EXPECT_EQ(parse_verification_bin(b.data(), b.size(), "memo.bin").images.size(), 1026u);
      continue;
    }
    const std::string m = error_of([&] { parse_verification_bin(b.data(), b.size(), "memo.bin"); });
    EXPECT_EQ(m.rfind("memo.bin: not an insightface verification .bin: " + std::to_string(refs) +
                          " image references to 1 distinct images (" + std::to_string(refs - 1) +
                          " repeats, at most 2 per distinct image + 1024)",
                      0),
              0u)
        << m;
  }
  // STACK_GLOBAL of long names (which GETs could otherwise copy per opcode) is refused.
  std::vector<uint8_t> g = {0x80, 0x04, 0x8d};
  for (int i = 0; i < 8; ++i) g.push_back(i == 0 ? 0x00 : 0);
  g[3] = 0x00;
  g[4] = 0x10;  // BINUNICODE8 of 4096 bytes
  g.insert(g.end(), 4096, 'm');
  g.insert(g.end(), {0x94, 'h', 0, 0x93, '.'});
  EXPECT_NE(error_of([&] { parse_verification_bin(g.data(), g.size(), "g.bin"); }).find("longer than 256"), std::string::npos);
}

TEST(VerificationBinCorrupt, RandomMutationsNeverCrash) {
  const std::vector<uint8_t> good = encode_verification_bin(random_set(9, 6));
  std::mt19937_64 g(17);
  int errors = 0;
  for (int it = 0; it < 3000; ++it) {
    std::vector<uint8_t> b = good;
    const int flips = 1 + int(g() % 3);
    for (int k = 0; k < flips; ++k) b[g() % b.size()] = uint8_t(g());
    if (g() % 4 == 0) b.resize(g() % b.size());
    try {
      parse_verification_bin(b.data(), b.size(), "m.bin");
    } catch (const Error&) {
      ++errors;
    }
  }
  EXPECT_GT(errors, 0);
}

}  // namespace
}  // namespace faceshard
