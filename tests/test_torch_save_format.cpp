// The torch-free state_dict reader (models/torch_save/torch_save_format.h, pickle_graph.h,
// zip_archive.h): files written by Python's torch.save read back with the same names,
// dtypes, views and storage bytes; hostile archives and pickles (deep nesting, cycles,
// lying sizes, huge counts, bad CRCs, truncation at every length) rejected with one line
// naming the file, without deep recursion or large allocations. Plain C++ (no LibTorch):
// this file is also built into the AddressSanitizer target.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_paths.h"
#include "models/torch_save/pickle_graph.h"
#include "models/torch_save/torch_save_format.h"
#include "models/torch_save/zip_archive.h"
#include "base/error.h"
#include "tests/test_errors.h"
#include "tests/test_files.h"
#include "tests/zip_writer.h"

namespace faceshard {
namespace {

using namespace std::string_literals;
using testing::TempDir;

using testing::error_of;

void expect_one_line_error(const std::function<void()>& f, const std::string& starts_with,
                           const std::vector<std::string>& fragments) {
  const std::string msg = error_of(f);
  EXPECT_EQ(msg.rfind(starts_with, 0), 0u) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
}

// Pickle opcodes, written by hand (the reference here is the pickle format itself).
struct Pk {
  std::string b = "\x80\x02";
  Pk& op(char c) {
    b.push_back(c);
    return *this;
  }
  Pk& op(const std::string& s) {
    b += s;
    return *this;
  }
  Pk& str(const std::string& s) {
    b.push_back('X');
    testing::put32(b, uint32_t(s.size()));
    b += s;
    return *this;
  }
  Pk& integer(int64_t v) {
    b.push_back(char(0x8a));
    b.push_back(8);
    testing::put64(b, uint64_t(v));
    return *this;
  }
  Pk& global(const std::string& m, const std::string& n) { return op("c" + m + "\n" + n + "\n"); }
  Pk& ints(const std::vector<int64_t>& v) {
    op('(');
    for (int64_t x : v) integer(x);
    return op('t');
  }
  // _rebuild_tensor_v2(('storage', torch.<type>, key, 'cpu', numel), offset, sizes, strides, False, OrderedDict())
  Pk& tensor(const std::string& type, const std::string& key, int64_t numel, int64_t offset,
             const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
    global("torch._utils", "_rebuild_tensor_v2").op("((").str("storage").global("torch", type).str(key).str("cpu");
    integer(numel).op("tQ").integer(offset).ints(sizes).ints(strides).op('\x89');
    return global("collections", "OrderedDict").op(")R").op("tR");
  }
  std::string done() { return b + "."; }
};

std::string bytes_of(size_t n, char fill = '\1') { return std::string(n, fill); }

SavedStateDict parse_zip(const std::string& zip, const std::string& name = "t.pt") {
  const TorchSaveFile f = open_torch_save(
      ZipArchive::from_memory(reinterpret_cast<const uint8_t*>(zip.data()), zip.size(), name + ": cannot read torch.save file"),
      name);
  return f.dict;
}

int run_python(const std::string& script_path, const std::string& arg) {
  const std::string cmd = std::string("\"") + FACESHARD_PYTHON + "\" \"" + script_path + "\" \"" + arg + "\"";
  return std::system(cmd.c_str());
}

const char* kPyTorchSave = R"PY(
import collections, sys, zlib, torch
d = sys.argv[1]
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4, 2))
a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
tied = torch.randn(5)
files = {
    'module': net.state_dict(),
    'mixed': collections.OrderedDict([
        ('a', a), ('slice', a[:, 1:3]), ('t', a.t()), ('p', torch.nn.Parameter(torch.ones(3))),
        ('h', torch.arange(4).half()), ('bf', torch.arange(4).bfloat16()), ('d', torch.arange(3).double()),
        ('l', torch.tensor(7)), ('i', torch.arange(3, dtype=torch.int32)), ('s', torch.arange(3, dtype=torch.int16)),
        ('c', torch.arange(3, dtype=torch.int8)), ('u', torch.arange(3, dtype=torch.uint8)),
        ('b', torch.tensor([True, False])), ('e', torch.empty(0, 3)),
        ('tie1', tied), ('tie2', tied)]),
    'plain_dict': {'w': torch.ones(2, 2), 'v': torch.zeros(1)},
}
with open(d + '/expected.txt', 'w') as out:
    for name, sd in files.items():
        torch.save(sd, '%s/%s.pt' % (d, name))
        storages = {}
        for k, t in sd.items():
            st = t.untyped_storage()
            sid = storages.setdefault(st.data_ptr(), len(storages))
            crc = zlib.crc32(bytes(st.tolist())) & 0xffffffff
            out.write('%s %s %s %d %d %d %s %s %d\n' % (name, k, str(t.dtype).replace('torch.', ''), sid,
                      st.nbytes(), t.storage_offset(), ','.join(map(str, t.shape)) or '-',
                      ','.join(map(str, t.stride())) or '-', crc))
)PY";

const char* dtype_name(StorageType t) {
  switch (t) {
    case StorageType::Float: return "float32";
    case StorageType::Double: return "float64";
    case StorageType::Half: return "float16";
    case StorageType::BFloat16: return "bfloat16";
    case StorageType::Long: return "int64";
    case StorageType::Int: return "int32";
    case StorageType::Short: return "int16";
    case StorageType::Char: return "int8";
    case StorageType::Byte: return "uint8";
    case StorageType::Bool: return "bool";
  }
  return "?";
}

std::string join(const std::vector<int64_t>& v) {
  if (v.empty()) return "-";
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

TEST(TorchSaveFormat, ReadsWhatPythonTorchSaveWrites) {
  TempDir d;
  {
    std::ofstream(d / "save.py") << kPyTorchSave;
  }
  ASSERT_EQ(run_python(d / "save.py", d.path), 0);
  std::ifstream in(d / "expected.txt");
  std::map<std::string, std::vector<std::string>> expected;  // file -> lines
  for (std::string line; std::getline(in, line);) expected[line.substr(0, line.find(' '))].push_back(line);
  ASSERT_EQ(expected.size(), 3u);
  for (const auto& [name, lines] : expected) {
    SCOPED_TRACE(name);
    const TorchSaveFile f = open_torch_save(d / (name + ".pt"));
    ASSERT_EQ(f.dict.tensors.size(), lines.size());
    // Storage indices in order of first use, as the Python side numbers them.
    std::map<size_t, size_t> renumber;
    for (size_t i = 0; i < lines.size(); ++i) {
      const SavedTensor& t = f.dict.tensors[i];
      const SavedStorage& s = f.dict.storages[t.storage];
      const size_t sid = renumber.emplace(t.storage, renumber.size()).first->second;
      const uint64_t nbytes = s.numel * storage_element_size(s.type);
      std::vector<uint8_t> bytes(nbytes);
      f.read_storage(t.storage, bytes.data());
      std::ostringstream got;
      got << name << ' ' << t.name << ' ' << dtype_name(s.type) << ' ' << sid << ' ' << nbytes << ' ' << t.offset << ' '
          << join(t.sizes) << ' ' << join(t.strides) << ' ' << crc32_update(0, bytes.data(), bytes.size());
      EXPECT_EQ(got.str(), lines[i]);
    }
  }
}

TEST(TorchSaveFormat, RepeatedKeyKeepsFirstPlaceAndLastValue) {
  Pk p;
  p.op('}').op('(').str("a").tensor("FloatStorage", "0", 4, 0, {4}, {1}).str("b").tensor("FloatStorage", "1", 2, 0, {2}, {1});
  p.str("a").tensor("FloatStorage", "1", 2, 1, {1}, {1}).op('u');
  const SavedStateDict d = parse_zip(testing::make_torch_zip(p.done(), {{"0", bytes_of(16)}, {"1", bytes_of(8)}}));
  ASSERT_EQ(d.tensors.size(), 2u);
  EXPECT_EQ(d.tensors[0].name, "a");
  EXPECT_EQ(d.tensors[0].offset, 1);
  EXPECT_EQ(d.tensors[1].name, "b");
  EXPECT_EQ(d.storages.size(), 1u);  // storage "0" is no longer used, so it is not read
}

TEST(TorchSaveFormat, ZipContainerLiesAreNamed) {
  const std::string pkl = Pk().op('}').str("w").tensor("FloatStorage", "0", 2, 0, {2}, {1}).op('s').done();
  testing::ZipSpec good;
  good.entries = {{"m/data.pkl", pkl}, {"m/byteorder", "little"}, {"m/data/0", bytes_of(8)}};
  auto open = [](const std::string& z) { parse_zip(z, "z.pt"); };
  EXPECT_EQ(error_of([&] { open(testing::make_zip(good)); }), "<no error>");
  testing::ZipSpec s = good;
  s.zip64 = true;
  s.comment = "a comment";
  EXPECT_EQ(error_of([&] { open(testing::make_zip(s)); }), "<no error>");

  s = good;
  s.bad_crc = true;
  expect_one_line_error([&] { open(testing::make_zip(s)); }, "z.pt", {"CRC-32"});
  s = good;
  s.method = 8;
  expect_one_line_error([&] { open(testing::make_zip(s)); }, "z.pt", {"compressed"});
  s = good;
  s.flags = 1;
  expect_one_line_error([&] { open(testing::make_zip(s)); }, "z.pt", {"encrypted"});
  s = good;
  s.entries.push_back({"m/byteorder", "big"});
  expect_one_line_error([&] { open(testing::make_zip(s)); }, "z.pt", {"appears twice"});
  s = good;
  s.claimed_count = 0xfffe;  // many entries in a directory of three: refused before reserving
  expect_one_line_error([&] { open(testing::make_zip(s)); }, "z.pt", {"cannot fit"});
  s = good;
  s.entries[2].second = bytes_of(4);
  expect_one_line_error([&] { open(testing::make_zip(s)); }, "z.pt", {"'data/0' has 4 bytes, expected 8"});
  s = good;
  s.entries[1].second = "big";
  expect_one_line_error([&] { open(testing::make_zip(s)); }, "z.pt", {"'big'-endian"});
  s = good;
  s.entries.erase(s.entries.begin());
  expect_one_line_error([&] { open(testing::make_zip(s)); }, "z.pt", {"no data.pkl"});
  s = good;
  s.entries[0].first = "data.pkl";  // not inside the archive's folder
  expect_one_line_error([&] { open(testing::make_zip(s)); }, "z.pt", {"folder"});
  // Names from the file are escaped in messages, which stay on one line.
  s = good;
  s.entries.push_back({"m/\nx", "1"});
  s.entries.push_back({"m/\nx", "2"});
  expect_one_line_error([&] { open(testing::make_zip(s)); }, "z.pt", {"entry 'm/\\x0ax' appears twice"});

  // Every truncation of a valid archive is an error naming the file, never a crash.
  const std::string z = testing::make_zip(good);
  for (size_t cut = 0; cut < z.size(); ++cut)
    expect_one_line_error([&] { open(z.substr(0, cut)); }, "z.pt", {});
}

// Storages stream whole (CRC-32 checked as the last byte arrives) or by byte range (bounds
// checked; a part of an entry cannot be checked against the entry's CRC).
TEST(TorchSaveFormat, StoragesStreamWholeOrByRange) {
  std::string data;
  for (int i = 0; i < 64; ++i) data.push_back(char(i * 3 + 1));
  const std::string pkl = Pk()
                              .op('}')
                              .op('(')
                              .str("m")
                              .tensor("FloatStorage", "0", 16, 0, {4, 4}, {4, 1})
                              .str("view")
                              .tensor("FloatStorage", "0", 16, 1, {2}, {3})
                              .str("col")
                              .tensor("FloatStorage", "0", 16, 2, {4, 1}, {1, 7})
                              .op('u')
                              .done();
  testing::ZipSpec spec;
  spec.entries = {{"a/data/0", data}, {"a/data.pkl", pkl}, {"a/byteorder", "little"}};
  const std::string good = testing::make_zip(spec);
  spec.bad_crc = true;  // the first entry: the storage
  const std::string bad = testing::make_zip(spec);
  auto open = [](const std::string& z) {
    return open_torch_save(
        ZipArchive::from_memory(reinterpret_cast<const uint8_t*>(z.data()), z.size(), "s.pt: cannot read torch.save file"),
        "s.pt");
  };
  const TorchSaveFile f = open(good);
  ASSERT_EQ(f.dict.tensors.size(), 3u);
  EXPECT_TRUE(is_contiguous(f.dict.tensors[0]));
  EXPECT_FALSE(is_contiguous(f.dict.tensors[1]));
  EXPECT_TRUE(is_contiguous(f.dict.tensors[2]));  // a stride of a size-1 dimension does not matter

  // Whole, in uneven pieces.
  ZipEntryStream whole = f.open_storage(0, 0, 64);
  EXPECT_TRUE(whole.checks_crc());
  std::string got(64, '\0');
  for (size_t at = 0, k = 5; at < 64; at += k, k += 2) {
    k = std::min<size_t>(k, 64 - at);
    whole.read(&got[at], k);
  }
  EXPECT_EQ(got, data);
  EXPECT_EQ(whole.remaining(), 0u);
  // A range: its bytes, and not one more.
  ZipEntryStream part = f.open_storage(0, 16, 40);
  EXPECT_FALSE(part.checks_crc());
  std::string slice(24, '\0');
  part.read(&slice[0], 24);
  EXPECT_EQ(slice, data.substr(16, 24));
  char extra = 0;
  expect_one_line_error([&] { part.read(&extra, 1); }, "s.pt", {"past the end of the range of entry 'a/data/0'"});
  expect_one_line_error([&] { f.open_storage(0, 10, 65); }, "s.pt", {"byte range [10, 65) lies outside storage '0' of 64 bytes"});
  expect_one_line_error([&] { f.open_storage(0, 40, 16); }, "s.pt", {"byte range [40, 16)"});

  // A corrupt storage: the whole read fails on its last piece; a range reads what is there.
  const TorchSaveFile b = open(bad);
  ZipEntryStream corrupt = b.open_storage(0, 0, 64);
  corrupt.read(&got[0], 63);
  expect_one_line_error([&] { corrupt.read(&got[63], 1); }, "s.pt", {"entry 'a/data/0' fails its CRC-32 check"});
  std::vector<uint8_t> buf(64);
  expect_one_line_error([&] { b.read_storage(0, buf.data()); }, "s.pt", {"CRC-32"});
  ZipEntryStream ranged = b.open_storage(0, 0, 63);
  ranged.read(&got[0], 63);
  EXPECT_EQ(got.substr(0, 63), data.substr(0, 63));
}

// A torch.save-format pickle that nests 100-200k one-element tuples (as a hostile state_dict
// would, to overflow a recursive reader's stack): refused at depth 32, naming the offset.
TEST(TorchSaveFormat, DeepNestingIsRefusedWithoutRecursion) {
  const size_t n = 100000;
  std::string mark_tuple = Pk().op('}').str("w").b + std::string(n, '(') + "N" + std::string(n, 't') + "s.";
  expect_one_line_error([&] { parse_zip(testing::make_torch_zip(mark_tuple), "deep.pt"); }, "deep.pt",
                        {"data.pkl offset", "nested more than 32 deep"});
  std::string tuple1 = Pk().op('}').str("w").b + "N" + std::string(2 * n, '\x85') + "s.";  // 200 KB
  expect_one_line_error([&] { parse_zip(testing::make_torch_zip(tuple1), "deep.pt"); }, "deep.pt",
                        {"offset 42:", "nested more than 32 deep"});  // the 33rd TUPLE1
  // Lists appended to lists (each a level deeper), and a dict chain through SETITEM.
  std::string lists = Pk().op(']').b;
  for (size_t i = 0; i < n; ++i) lists += "]";
  for (size_t i = 0; i < n; ++i) lists += "a";
  expect_one_line_error([&] { parse_state_dict_pickle(reinterpret_cast<const uint8_t*>(lists.data()), lists.size(), "l.pt", 0); },
                        "l.pt", {"nested more than 32 deep"});
  // A container that is already inside another may not grow deeper; nothing contains itself.
  const std::string grow = Pk().op("]q\x00]h\x00"s).op('a').op("h\x00]]a"s).op('a').done();
  expect_one_line_error([&] { parse_state_dict_pickle(reinterpret_cast<const uint8_t*>(grow.data()), grow.size(), "g.pt", 0); },
                        "g.pt", {"grows deeper"});
  const std::string self = Pk().op("]q\x00h\x00"s).op('a').done();
  expect_one_line_error([&] { parse_state_dict_pickle(reinterpret_cast<const uint8_t*>(self.data()), self.size(), "s.pt", 0); },
                        "s.pt", {"inside itself"});
  // 32 levels are fine.
  std::string ok = Pk().op('}').str("w").b + "N" + std::string(31, '\x85') + "s.";
  expect_one_line_error([&] { parse_state_dict_pickle(reinterpret_cast<const uint8_t*>(ok.data()), ok.size(), "ok.pt", 0); },
                        "ok.pt", {"'w' is a tuple, expected a tensor"});
}

TEST(TorchSaveFormat, SizesAreCheckedBeforeAnythingIsAllocated) {
  auto one = [](const std::string& type, int64_t numel, int64_t offset, std::vector<int64_t> sizes,
                std::vector<int64_t> strides) {
    return Pk().op('}').str("w").tensor(type, "0", numel, offset, sizes, strides).op('s').done();
  };
  auto parse = [](const std::string& pkl) {
    parse_state_dict_pickle(reinterpret_cast<const uint8_t*>(pkl.data()), pkl.size(), "s.pt", 1000);
  };
  expect_one_line_error([&] { parse(one("FloatStorage", int64_t(1) << 60, 0, {1}, {1})); }, "s.pt",
                        {"entry 'w'", "larger than the file"});
  expect_one_line_error([&] { parse(one("FloatStorage", 4, 0, {int64_t(1) << 62, 8}, {1, 1})); }, "s.pt",
                        {"overflows"});
  expect_one_line_error([&] { parse(one("FloatStorage", 4, 1, {4}, {1})); }, "s.pt", {"exceeds its storage of 4"});
  expect_one_line_error([&] { parse(one("FloatStorage", 4, -1, {1}, {1})); }, "s.pt", {"negative storage offset"});
  expect_one_line_error([&] { parse(one("FloatStorage", 4, 0, {2}, {-1})); }, "s.pt", {"negative"});
  expect_one_line_error([&] { parse(one("QInt8Storage", 4, 0, {4}, {1})); }, "s.pt", {"unsupported storage type"});
  // An expanded view (stride 0) may repeat elements, within the file's size.
  EXPECT_EQ(error_of([&] { parse(one("FloatStorage", 1, 0, {100}, {0})); }), "<no error>");
  expect_one_line_error([&] { parse(one("FloatStorage", 1, 0, {1000000}, {0})); }, "s.pt", {"larger than its storage"});
  // The stack, memo and object counts are capped.
  std::string gets = Pk().op("]q\x00"s).b;
  for (int i = 0; i < (1 << 20) + 10; ++i) gets += "h\x00"s;
  expect_one_line_error([&] { parse(gets + "."); }, "s.pt", {"stack grows past"});
  std::string ints = Pk().b;
  for (int i = 0; i < (1 << 21) + 10; ++i) ints += "K\x01" "0"s;
  expect_one_line_error([&] { parse(ints + "N."); }, "s.pt", {"more than 2097152 objects"});
  // A GET of a long string is a reference: a million of them cost the stack, not copies.
  std::string long_gets = Pk().op('(').str(std::string(1 << 20, 'k')).op("q\x00"s).b;
  for (int i = 0; i < 500000; ++i) long_gets += "h\x00"s;
  expect_one_line_error([&] { parse(long_gets + "l."); }, "s.pt", {"expected a state_dict", "got a list"});
}

// Random damage to valid archives: data or one-line errors (under AddressSanitizer, the
// memory-safety check of the whole reader).
TEST(TorchSaveFormat, RandomMutationsNeverCrash) {
  Pk p;
  p.op('}').op('(').str("a").tensor("FloatStorage", "0", 4, 0, {2, 2}, {2, 1});
  p.str("b").global("torch._utils", "_rebuild_parameter").op('(').tensor("HalfStorage", "1", 3, 1, {2}, {1}).op("\x89)tR");
  const std::string z = testing::make_torch_zip(p.op('u').done(), {{"0", bytes_of(16)}, {"1", bytes_of(6)}});
  EXPECT_EQ(parse_zip(z).tensors.size(), 2u);
  uint64_t seed = 12345;
  auto next = [&] { return seed = seed * 6364136223846793005ull + 1442695040888963407ull, seed >> 33; };
  int errors = 0;
  for (int it = 0; it < 3000; ++it) {
    std::string m = z;
    for (int k = 0, flips = 1 + int(next() % 4); k < flips; ++k) m[next() % m.size()] = char(next());
    const std::string msg = error_of([&] {
      ZipArchive zip = ZipArchive::from_memory(reinterpret_cast<const uint8_t*>(m.data()), m.size(), "m.pt: bad");
      zip.set_verify_crc(it % 2 == 0);
      open_torch_save(std::move(zip), "m.pt");
    });
    if (msg != "<no error>") {
      ++errors;
      EXPECT_EQ(msg.rfind("m.pt", 0), 0u) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
  EXPECT_GT(errors, 0);
}

}  // namespace
}  // namespace faceshard
