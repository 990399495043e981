// Reading checkpoints straight into their destinations: StateDictReader's values (whole,
// by row range, converted, into strided destinations, through a small staging buffer)
// against what Python's torch.load gives for the same file (written out as raw float64 by
// Python, so no faceshard reader takes part in the reference); the CRC of a whole storage
// and the bounds of a ranged read; the peak memory of loading a backbone; ReshardedRows
// against the tensors that were saved, on another number of ranks, opening only the files
// it needs; a classifier allocated for a resume refusing to run until filled; every value
// a resume reads checked, naming the file and the key.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "app/io/checkpoint.h"
#include "app/io/checkpoint_verify.h"
#include "app/io/resharded_rows.h"
#include "app/train/train_state.h"
#include "models/backbone.h"
#include "models/backbone_registry.h"
#include "models/torch_save/state_dict_io.h"
#include "models/torch_save/state_dict_reader.h"
#include "partial_fc/classifier/class_shard.h"
#include "partial_fc/classifier/partial_fc.h"
#include "partial_fc/distributed/dist_env.h"
#include "base/error.h"
#include "tests/harness.h"
#include "tests/test_errors.h"

namespace faceshard {
namespace {

using testing::error_of;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

const char* kPySave = R"PY(
import sys, torch
d = sys.argv[1]
g = torch.Generator().manual_seed(5)
w = torch.randn(1000, 7, generator=g)
big = torch.randn(400, 6, generator=g)
sd = {
    'w': w,
    'h': torch.randn(517, 33, generator=g).half(),
    'bf': torch.randn(100, 5, generator=g).bfloat16(),
    'l': torch.arange(1000) * 3 - 7,
    'b': torch.rand(60, generator=g) > 0.5,
    'slice': w[:, 2:5],
    't': torch.randn(9, 4, generator=g).t(),
    'off': big[100:300],
    's': torch.tensor(3.5, dtype=torch.float64),
    'conv': torch.randn(8, 3, 3, 3, generator=g),
    'e': torch.empty(0, 5),
}
torch.save(sd, d + '/sd.pt')
# The reference: torch.load's values, as raw float64, and each entry's dtype and shape.
with open(d + '/expected.txt', 'w') as out:
    for k, t in torch.load(d + '/sd.pt').items():
        t.double().contiguous().numpy().tofile('%s/%s.f64' % (d, k))
        out.write('%s %s %s\n' % (k, str(t.dtype).replace('torch.', ''), ','.join(map(str, t.shape)) or '-'))
)PY";

struct Expected {
  std::string dtype;
  at::Tensor values;  // float64
};

std::map<std::string, Expected> python_reference(const std::string& dir) {
  const auto r = testing::run_python(dir, "save.py", kPySave, {dir});
  EXPECT_EQ(r.status, 0) << r.output;
  std::map<std::string, Expected> out;
  std::ifstream in(dir + "/expected.txt");
  std::string name, dtype, shape;
  while (in >> name >> dtype >> shape) {
    std::vector<int64_t> sizes;
    if (shape != "-") {
      std::stringstream ss(shape);
      for (std::string v; std::getline(ss, v, ',');) sizes.push_back(std::stoll(v));
    }
    at::Tensor t = at::empty(sizes, at::kDouble);
    std::ifstream raw(dir + "/" + name + ".f64", std::ios::binary);
    raw.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.numel() * 8));
    EXPECT_EQ(raw.gcount(), t.numel() * 8) << name;
    out[name] = {dtype, t};
  }
  return out;
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    default: return "other";
  }
}

TEST(StateDictReader, ValuesEqualPythonTorchLoadWholeAndByRows) {
  const std::string dir = testing::temp_dir("sd_reader");
  const auto expected = python_reference(dir);
  ASSERT_EQ(expected.size(), 11u);
  const StateDictReader direct(dir + "/sd.pt");
  const StateDictReader chunked(dir + "/sd.pt", /*staging_bytes=*/100);  // many chunks, odd sizes
  ASSERT_EQ(direct.size(), expected.size());
  for (size_t i = 0; i < direct.size(); ++i) {
    const std::string& name = direct.name(i);
    SCOPED_TRACE(name);
    const Expected& e = expected.at(name);
    const at::Tensor ref = e.values;
    EXPECT_EQ(dtype_name(direct.dtype(i)), e.dtype);
    EXPECT_EQ(c10::IntArrayRef(direct.sizes(i)), ref.sizes());
    // Whole, in the saved dtype (the direct read) and converted (through the staging buffer).
    const at::Tensor t = direct.read(i);
    EXPECT_EQ(t.scalar_type(), direct.dtype(i));
    EXPECT_TRUE(torch::equal(t.to(at::kDouble), ref));
    for (const StateDictReader* r : {&direct, &chunked}) {
      at::Tensor d = at::empty(ref.sizes(), at::kDouble);
      r->read_into(i, d);
      EXPECT_TRUE(torch::equal(d, ref));
    }
    if (ref.dim() == 0) continue;
    // Row ranges into destinations of the saved dtype, of another dtype, and strided.
    const int64_t n = ref.size(0);
    for (auto [lo, hi] : std::vector<std::pair<int64_t, int64_t>>{{0, n}, {n / 3, n - n / 4}, {n - 1, n}, {0, 1}, {2, 2}}) {
      if (lo < 0 || hi > n || lo > hi) continue;
      std::vector<int64_t> shape = ref.sizes().vec();
      shape[0] = hi - lo;
      at::Tensor same = at::empty(shape, at::TensorOptions().dtype(direct.dtype(i)));
      direct.read_rows_into(i, lo, same);
      EXPECT_TRUE(torch::equal(same.to(at::kDouble), ref.narrow(0, lo, hi - lo))) << lo << ".." << hi;
      for (const StateDictReader* r : {&direct, &chunked}) {
        at::Tensor conv = at::empty(shape, at::kDouble);
        r->read_rows_into(i, lo, conv);
        EXPECT_TRUE(torch::equal(conv, ref.narrow(0, lo, hi - lo))) << lo << ".." << hi;
        if (ref.dim() == 2) {  // a transposed destination: written row chunk by row chunk
          std::swap(shape[0], shape[1]);
          at::Tensor strided = at::empty(shape, at::kFloat).t();
          std::swap(shape[0], shape[1]);
          r->read_rows_into(i, lo, strided);
          EXPECT_TRUE(torch::equal(strided.to(at::kDouble), ref.narrow(0, lo, hi - lo).to(at::kFloat).to(at::kDouble)));
        }
      }
    }
  }
  // A channels-last destination (a backbone's conv weight).
  const size_t conv = direct.find("conv");
  ASSERT_NE(conv, TensorSource::npos);
  for (const StateDictReader* r : {&direct, &chunked}) {
    at::Tensor cl = at::empty({8, 3, 3, 3}).contiguous(at::MemoryFormat::ChannelsLast);
    r->read_into(conv, cl);
    EXPECT_TRUE(torch::equal(cl.to(at::kDouble), expected.at("conv").values));
  }

  // Out-of-range rows and wrong shapes: one line naming the file and the key.
  const size_t w = direct.find("w");
  std::string msg = error_of([&] { direct.read_rows_into(w, 995, at::empty({10, 7})); });
  EXPECT_TRUE(contains(msg, dir + "/sd.pt: 'w' has 1000 rows; rows [995, 1005) are not among them")) << msg;
  msg = error_of([&] { direct.read_rows_into(w, -1, at::empty({1, 7})); });
  EXPECT_TRUE(contains(msg, "rows [-1, 0)")) << msg;
  msg = error_of([&] { direct.read_rows_into(w, 0, at::empty({10, 8})); });
  EXPECT_TRUE(contains(msg, "'w' has shape [1000,7], expected rows of shape [10,8]")) << msg;
  msg = error_of([&] { direct.read_into(w, at::empty({1000, 6})); });
  EXPECT_TRUE(contains(msg, "'w' has shape [1000,7], expected [1000,6]")) << msg;
  msg = error_of([&] { direct.read_rows_into(direct.find("s"), 0, at::empty({1})); });
  EXPECT_TRUE(contains(msg, "'s' has shape []")) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// The file offset of the first byte of a torch.save record (its local header read here,
// independently of the reader).
uint64_t record_data_offset(const std::string& path, const std::string& suffix) {
  const ZipArchive zip = ZipArchive::open_file(path, path);
  for (const auto& e : zip.entries()) {
    if (e.name.size() < suffix.size() || e.name.compare(e.name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    std::ifstream f(path, std::ios::binary);
    f.seekg(static_cast<std::streamoff>(e.local_offset + 26));
    unsigned char h[4];
    f.read(reinterpret_cast<char*>(h), 4);
    return e.local_offset + 30 + (h[0] | (h[1] << 8)) + (h[2] | (h[3] << 8));
  }
  ADD_FAILURE() << "no record " << suffix;
  return 0;
}

TEST(StateDictReader, WholeStorageChecksItsCrcRangedReadsTheirBounds) {
  const std::string dir = testing::temp_dir("sd_reader_crc");
  const std::string path = dir + "/rows.pt";
  const at::Tensor w = at::arange(4000, at::kFloat).reshape({1000, 4});
  write_state_dict({{"w", w}}, path);
  const uint64_t at = record_data_offset(path, "/data/0");
  {  // one byte of the last row flipped
    std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
    f.seekg(static_cast<std::streamoff>(at + 999 * 16 + 5));
    char c = 0;
    f.get(c);
    f.seekp(static_cast<std::streamoff>(at + 999 * 16 + 5));
    f.put(static_cast<char>(c ^ 0x40));
  }
  const StateDictReader r(path);
  std::string msg = error_of([&] { r.read_into(0, at::empty({1000, 4})); });
  EXPECT_TRUE(contains(msg, path) && contains(msg, "fails its CRC-32 check")) << msg;
  msg = error_of([&] { r.read_rows_into(0, 0, at::empty({1000, 4}, at::kDouble)); });  // whole, staged
  EXPECT_TRUE(contains(msg, "fails its CRC-32 check")) << msg;
  // A range of rows cannot be checked against the entry's CRC: its bytes come back as they
  // are in the file (the untouched rows exactly, the flipped row changed).
  at::Tensor head = at::empty({10, 4});
  r.read_rows_into(0, 0, head);
  EXPECT_TRUE(torch::equal(head, w.narrow(0, 0, 10)));
  at::Tensor tail = at::empty({10, 4});
  r.read_rows_into(0, 990, tail);
  EXPECT_TRUE(torch::equal(tail.narrow(0, 0, 9), w.narrow(0, 990, 9)));
  EXPECT_FALSE(torch::equal(tail[9], w[999]));
}

// VmRSS or VmHWM of this process in MB.
int64_t status_mb(const std::string& field) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) / 1024;
  return -1;
}

// faceshard-verify and -extract load a model with load_backbone_weights: the file's values
// go straight into the parameters, so the peak RSS while loading an r100 (261 MB of
// weights) stays within the staging buffer and the pickle's objects of what it was before.
TEST(StateDictReader, LoadingABackboneHoldsNoSecondCopyOfIt) {
  const std::string dir = testing::temp_dir("sd_reader_backbone");
  BackboneOptions o;
  o.name = "r100";
  auto saved = make_backbone(o);
  save_backbone_weights(*saved, dir + "/r100.pt");
  auto loaded = make_backbone(o);
  int64_t model_mb = 0;
  for (const auto& kv : loaded->state_dict()) model_mb += kv.second.nbytes() >> 20;
  ASSERT_GT(model_mb, 200);
  std::ofstream("/proc/self/clear_refs") << "5";  // the peak (VmHWM) restarts from now
  const int64_t before = status_mb("VmRSS");
  ASSERT_LE(status_mb("VmHWM"), before + 1) << "cannot reset the peak RSS";
  load_backbone_weights(*loaded, dir + "/r100.pt");
  const int64_t extra = status_mb("VmHWM") - before;
  EXPECT_LT(extra, 64) << "loading a " << model_mb << " MB model took " << extra << " MB more at its peak";
  const StateDict a = saved->state_dict(), b = loaded->state_dict();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
}

// ---- resharding ---------------------------------------------------------------------------

// A checkpoint folder of `W` shards over `C` classes, each with rows/weight and
// rows/opt.momentum from the given full tensors.
void write_checkpoint(const std::string& dir, int64_t C, int W, const at::Tensor& weight, const at::Tensor& momentum) {
  std::filesystem::create_directories(dir);
  for (const ClassShard& s : ClassShard::all(C, W)) {
    write_state_dict({{"rows.start", torch::tensor({s.start})},
                      {"rows.count", torch::tensor({s.count})},
                      {"rows/weight", weight.narrow(0, s.start, s.count)},
                      {"rows/opt.momentum", momentum.narrow(0, s.start, s.count)},
                      {"rng.cpu", at::detail::getDefaultCPUGenerator().get_state()}},
                     dir + "/fc_shard_" + std::to_string(s.rank) + ".pt");
  }
  testing::write_text(dir + "/COMMITTED", "step 3\nworld_size " + std::to_string(W) + "\nnum_classes " +
                                              std::to_string(C) + "\n");
}

TEST(ReshardedRows, EveryRankGetsItsClassesFromTheSavedShards) {
  const std::string dir = testing::temp_dir("resharded_rows");
  const int64_t C = 23;
  const at::Tensor weight = torch::randn({C, 5}), momentum = torch::randn({C, 5});
  write_checkpoint(dir + "/two", C, 2, weight, momentum);
  const CheckpointInfo info = read_checkpoint_info(dir + "/two");
  for (int W : {1, 2, 3, 5}) {
    for (const ClassShard& s : ClassShard::all(C, W)) {
      SCOPED_TRACE("rank " + std::to_string(s.rank) + " of " + std::to_string(W));
      const ReshardedRows rows(info, s.start, s.count);
      EXPECT_EQ(rows.names(), (std::vector<std::string>{"weight", "opt.momentum"}));
      at::Tensor w = at::empty({s.count, 5}), m = at::empty({s.count, 5}, at::kDouble);
      rows.read_into("weight", w);
      rows.read_into("opt.momentum", m);
      EXPECT_TRUE(torch::equal(w, weight.narrow(0, s.start, s.count)));
      EXPECT_TRUE(torch::equal(m, momentum.narrow(0, s.start, s.count).to(at::kDouble)));
    }
  }
  // Only the files whose classes overlap are opened: ranks within shard 0's classes need
  // no fc_shard_1.pt.
  std::filesystem::copy(dir + "/two", dir + "/half");
  std::filesystem::remove(dir + "/half/fc_shard_1.pt");
  const CheckpointInfo half = read_checkpoint_info(dir + "/half");
  at::Tensor w = at::empty({12, 5});
  ReshardedRows(half, 0, 12).read_into("weight", w);
  EXPECT_TRUE(torch::equal(w, weight.narrow(0, 0, 12)));
  std::string msg = error_of([&] { ReshardedRows(half, 0, 13); });
  EXPECT_TRUE(contains(msg, "has no fc_shard_1.pt (saved on 2 ranks)")) << msg;

  // A missing entry, another row shape, a shard with other classes or other entries.
  const ReshardedRows rows(info, 0, C);
  msg = error_of([&] { rows.read_into("opt.exp_avg", at::empty({C, 5})); });
  EXPECT_TRUE(contains(msg, "has no classifier state 'rows/opt.exp_avg'")) << msg;
  msg = error_of([&] { rows.read_into("weight", at::empty({C, 4})); });
  EXPECT_TRUE(contains(msg, "fc_shard_0.pt: 'rows/weight' has rows of shape [5], this run's classifier has [4]")) << msg;
  write_state_dict({{"rows.start", torch::tensor({11})},
                    {"rows.count", torch::tensor({12})},
                    {"rows/weight", weight.narrow(0, 11, 12)},
                    {"rows/opt.momentum", momentum.narrow(0, 11, 12)}},
                   dir + "/half/fc_shard_1.pt");
  msg = error_of([&] { ReshardedRows(half, 0, C); });
  EXPECT_TRUE(contains(msg, "fc_shard_1.pt: holds classes [11, 23), expected [12, 23) (rank 1 of 2 with 23 classes)"))
      << msg;
  write_state_dict({{"rows.start", torch::tensor({12})},
                    {"rows.count", torch::tensor({11})},
                    {"rows/weight", weight.narrow(0, 12, 10)},
                    {"rows/opt.momentum", momentum.narrow(0, 12, 11)}},
                   dir + "/half/fc_shard_1.pt");
  msg = error_of([&] { ReshardedRows(half, 0, C); });
  EXPECT_TRUE(contains(msg, "fc_shard_1.pt: 'rows/weight' has 10 rows, expected 11")) << msg;
  write_state_dict({{"rows.start", torch::tensor({12})},
                    {"rows.count", torch::tensor({11})},
                    {"rows/weight", weight.narrow(0, 12, 11)}},
                   dir + "/half/fc_shard_1.pt");
  msg = error_of([&] { ReshardedRows(half, 0, C); });
  EXPECT_TRUE(contains(msg, "classifier entries differ")) << msg;
  write_state_dict({{"rows.start", torch::tensor({12.0})}, {"rows.count", torch::tensor({11})}},
                   dir + "/half/fc_shard_1.pt");
  msg = error_of([&] { ReshardedRows(half, 0, C); });
  EXPECT_TRUE(contains(msg, "fc_shard_1.pt: key 'rows.start' is ") && contains(msg, "expected an integer")) << msg;
  write_state_dict({{"rows.count", torch::tensor({11})}}, dir + "/half/fc_shard_1.pt");
  msg = error_of([&] { ReshardedRows(half, 0, C); });
  EXPECT_TRUE(contains(msg, "fc_shard_1.pt: key 'rows.start' is missing")) << msg;
  // A marker whose numbers cannot describe a layout.
  testing::write_text(dir + "/half/COMMITTED", "step 3\nworld_size 0\nnum_classes 23\n");
  msg = error_of([&] { read_checkpoint_info(dir + "/half"); });
  EXPECT_TRUE(contains(msg, "half/COMMITTED:2: key 'world_size' is '0', expected an integer in [1, 1048576]")) << msg;
  testing::write_text(dir + "/half/COMMITTED", "step 3\nworld_size 2\n");
  msg = error_of([&] { read_checkpoint_info(dir + "/half"); });
  EXPECT_TRUE(contains(msg, "half/COMMITTED: key 'num_classes' is missing")) << msg;
  testing::write_text(dir + "/half/COMMITTED", "step 3\nworld_size 2\nnum_classes 99999999999999999999\n");
  msg = error_of([&] { read_checkpoint_info(dir + "/half"); });
  EXPECT_TRUE(contains(msg, "half/COMMITTED:3: key 'num_classes' is '99999999999999999999'")) << msg;
}

// Values read into the classifier are checked where they are read, naming the file, the
// key and the class: a non-finite weight or moment, a negative second moment or step count,
// rows of another kind of number.
TEST(ReshardedRows, ValuesAreCheckedNamingFileKeyAndClass) {
  const std::string dir = testing::temp_dir("resharded_values");
  const int64_t C = 23;
  at::Tensor weight = torch::randn({C, 5}), momentum = torch::randn({C, 5});
  weight[17][2] = std::nan("");
  write_checkpoint(dir + "/nan", C, 2, weight, momentum);
  const CheckpointInfo info = read_checkpoint_info(dir + "/nan");
  std::string msg = error_of([&] { ReshardedRows(info, 0, C).read_into("weight", at::empty({C, 5})); });
  EXPECT_TRUE(contains(msg, "nan/fc_shard_1.pt: key 'rows/weight': the value at class 17 is nan, expected a finite number"))
      << msg;
  // On 3 ranks, rank 2 owns classes [16, 23): the same class is named.
  msg = error_of([&] { ReshardedRows(info, 16, 7).read_into("weight", at::empty({7, 5})); });
  EXPECT_TRUE(contains(msg, "fc_shard_1.pt: key 'rows/weight': the value at class 17 is nan")) << msg;
  EXPECT_EQ(error_of([&] { ReshardedRows(info, 0, 12).read_into("weight", at::empty({12, 5})); }), "<no error>");
  // Non-negative entries (AdamW's second moment, its step counts).
  weight[17][2] = 0.5;
  momentum = momentum.abs();
  momentum[3][1] = -1;
  write_checkpoint(dir + "/neg", C, 2, weight, momentum);
  const ReshardedRows neg(read_checkpoint_info(dir + "/neg"), 0, C);
  EXPECT_EQ(error_of([&] { neg.read_into("opt.momentum", at::empty({C, 5})); }), "<no error>");
  msg = error_of([&] { neg.read_into("opt.momentum", at::empty({C, 5}), /*non_negative=*/true); });
  EXPECT_TRUE(contains(msg, "neg/fc_shard_0.pt: key 'rows/opt.momentum': the value at class 3 is -1, expected a value >= 0"))
      << msg;
  // Rows of another kind of number: integers or booleans into fp32 rows.
  for (const at::Tensor& bad : {torch::ones({C, 5}, at::kLong), torch::ones({C, 5}, at::kBool)}) {
    write_checkpoint(dir + "/type", C, 2, bad, momentum);
    msg = error_of([&] { ReshardedRows(read_checkpoint_info(dir + "/type"), 0, C).read_into("weight", at::empty({C, 5})); });
    EXPECT_TRUE(contains(msg, "type/fc_shard_0.pt: key 'rows/weight' is ") && contains(msg, "expected floating-point rows"))
        << msg;
  }
}

// A checkpoint whose files are well-formed but hold wrong values: a resume ends with one
// line naming the file and the key (not LibTorch's message from deep inside), each case
// made from a good checkpoint by changing one entry.
TEST(TrainStateLoad, WrongValuesNameTheFileAndKey) {
  const std::string dir = testing::temp_dir("train_state_values");
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const Config cfg = load_config_text("output: " + dir + "/out\n" + R"(data: {rec: synthetic, num_classes: 10, batch_size: 4, num_workers: 1}
model: {backbone: mbf, embedding_size: 8}
optim: {optimizer: adamw, fused: false}
loss: {head: curricularface}
train: {verify_every: 0, tensorboard: false}
dist: {device: cpu}
)", "job.yaml");
  // (The per-parameter optimiser: the cases below give one parameter AdamW state and not the
  // others, which only it can hold; the fused one's refusal is AppOptim.FusedFlatAdamW*.)
  TrainJob job = build_train_job(cfg, dist);
  const std::vector<int64_t> param0(job.backbone_params[0].sizes().begin(), job.backbone_params[0].sizes().end());
  {
    TrainState state(job);
    state.progress().step = 3;
    state.progress().best_accuracy["lfw"] = 0.5;
    CheckpointManager checkpoints(dir + "/ck", *dist, 100);
    state.save(checkpoints);
  }
  const std::string good = dir + "/ck/step_00000003";
  // The good checkpoint with `file`'s entries changed (`change` edits them in place).
  int n = 0;
  auto variant = [&](const std::string& file, const std::function<void(StateDict&)>& change) {
    const std::string out = dir + "/v" + std::to_string(n++);
    std::filesystem::copy(good, out);
    StateDict sd = read_state_dict(good + "/" + file);
    change(sd);
    write_state_dict(sd, out + "/" + file);
    return out;
  };
  auto set = [](const std::string& key, const at::Tensor& v) {
    return [key, v](StateDict& sd) {
      for (auto& kv : sd)
        if (kv.first == key) return void(kv.second = v);
      sd.emplace_back(key, v);
    };
  };
  auto resume = [&](const std::string& ck) {
    return error_of([&] {
      TrainJob j = build_train_job(cfg, dist, ClassifierStart::FromCheckpoint);
      TrainState(j).load(ck);
    });
  };
  EXPECT_EQ(resume(good), "<no error>");
  struct Case {
    std::string file, key;
    at::Tensor value;
    std::string expected;
  };
  const at::Tensor nan_rows = [&] {
    for (const auto& kv : read_state_dict(good + "/fc_shard_0.pt"))
      if (kv.first == "rows/weight") {
        at::Tensor w = kv.second.clone();
        w[4][1] = std::nan("");
        return w;
      }
    return at::Tensor();
  }();
  const std::vector<Case> cases = {
      {"fc_shard_0.pt", "rng.cpu", torch::zeros({7}, at::kByte), "fc_shard_0.pt: key 'rng.cpu' is Byte of shape [7]"},
      {"fc_shard_0.pt", "rng.cpu", torch::zeros({5056}, at::kFloat), "fc_shard_0.pt: key 'rng.cpu' is Float of shape"},
      {"fc_shard_0.pt", "rows.start", torch::tensor({0, 1}), "fc_shard_0.pt: key 'rows.start' holds 2 values, expected one"},
      {"fc_shard_0.pt", "rows/weight", nan_rows, "fc_shard_0.pt: key 'rows/weight': the value at class 4 is nan"},
      {"fc_shard_0.pt", "rows/opt.exp_avg_sq", -torch::ones({10, 8}),
       "fc_shard_0.pt: key 'rows/opt.exp_avg_sq': the value at class 0 is -1, expected a value >= 0"},
      {"fc_shard_0.pt", "rows/opt.row_steps", torch::full({10}, 1.5), "fc_shard_0.pt: key 'rows/opt.row_steps' is Float, expected integer rows"},
      {"train_state.pt", "step", torch::tensor({4}), "train_state.pt: key 'step' is 4, but the checkpoint's COMMITTED marker says step 3"},
      {"train_state.pt", "step", torch::tensor({3, 3}), "train_state.pt: key 'step' holds 2 values, expected one"},
      {"train_state.pt", "world_size", torch::tensor({2}), "train_state.pt: key 'world_size' is 2, but the checkpoint's COMMITTED marker says 1"},
      {"train_state.pt", "data.epoch", torch::tensor({-1}), "train_state.pt: key 'data.epoch' is -1"},
      {"train_state.pt", "data.epoch_samples", torch::tensor({int64_t(-8)}), "train_state.pt: key 'data.epoch_samples' is -8"},
      {"train_state.pt", "data.global_batch", torch::tensor({int64_t(0)}), "train_state.pt: key 'data.global_batch' is 0, expected a batch in [1, 2^40]"},
      {"train_state.pt", "best/lfw", torch::tensor({std::nan("")}, at::kDouble), "train_state.pt: key 'best/lfw' is nan, expected an accuracy in [0, 1]"},
      {"train_state.pt", "best/lfw", torch::tensor({1.5}), "train_state.pt: key 'best/lfw' is 1.5"},
      {"train_state.pt", "head/t", torch::tensor({0.1, 0.2}), "train_state.pt: key 'head/t' is Float of 2 values, expected 1 floating-point values"},
      {"train_state.pt", "head/t", torch::tensor({INFINITY}), "train_state.pt: key 'head/t': the value at index 0 is inf, expected a finite number"},
      {"train_state.pt", "head/x", torch::tensor({0.1}), "train_state.pt: key 'head/x' is not state of the curricularface head"},
      // Another head's state, and another head's name: both heads named.
      {"train_state.pt", "head/batch_mean", torch::tensor({0.1}),
       "train_state.pt: key 'head/batch_mean' is state of the adaface head, not of this run's curricularface head (loss.head)"},
      {"train_state.pt", "head.name", torch::tensor({97, 100, 97, 102, 97, 99, 101}, at::kByte),
       "train_state.pt: the checkpoint was trained with loss.head adaface, this run has loss.head curricularface"},
      {"train_state.pt", "head.name", torch::zeros({100}, at::kByte), "train_state.pt: key 'head.name' is not a head's name"},
      {"train_state.pt", "opt/exp_avg.0", torch::zeros(param0, at::kLong), "train_state.pt: optimiser state 'exp_avg.0': is Long, expected floating-point values"},
      {"train_state.pt", "opt/exp_avg_sq.0", torch::zeros(param0), "optimiser state 'exp_avg.0' is missing"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.file + " " + c.key);
    const std::string msg = resume(variant(c.file, set(c.key, c.value)));
    EXPECT_TRUE(contains(msg, c.expected)) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  // AdamW's state of one param, with one bad value each.
  auto adam = [&](const at::Tensor& avg, const at::Tensor& sq, const at::Tensor& step) {
    return [=](StateDict& sd) {
      sd.emplace_back("opt/exp_avg.0", avg);
      sd.emplace_back("opt/exp_avg_sq.0", sq);
      sd.emplace_back("opt/step.0", step);
    };
  };
  const at::Tensor z = torch::zeros(param0);
  EXPECT_EQ(resume(variant("train_state.pt", adam(z, z, torch::tensor({2.0})))), "<no error>");
  std::string msg = resume(variant("train_state.pt", adam(z.clone().fill_(NAN), z, torch::tensor({2.0}))));
  EXPECT_TRUE(contains(msg, "train_state.pt: key 'opt/exp_avg.0': the value at index 0 is nan")) << msg;
  msg = resume(variant("train_state.pt", adam(z, z.clone().fill_(-2), torch::tensor({2.0}))));
  EXPECT_TRUE(contains(msg, "train_state.pt: key 'opt/exp_avg_sq.0': the value at index 0 is -2, expected a value >= 0")) << msg;
  msg = resume(variant("train_state.pt", adam(z, z, torch::tensor({-1.0}))));
  EXPECT_TRUE(contains(msg, "train_state.pt: key 'opt/step.0': the value at index 0 is -1")) << msg;
  // A backbone value that is not finite, a negative running variance.
  const StateDict bb = read_state_dict(good + "/backbone.pt");
  std::string var_key, weight_key;
  for (const auto& kv : bb) {
    if (var_key.empty() && kv.first.find("running_var") != std::string::npos) var_key = kv.first;
    if (weight_key.empty() && kv.second.is_floating_point() && kv.second.dim() == 4) weight_key = kv.first;
  }
  msg = resume(variant("backbone.pt", [&](StateDict& sd) {
    for (auto& kv : sd)
      if (kv.first == weight_key) kv.second = kv.second.clone().fill_(INFINITY);
  }));
  EXPECT_TRUE(contains(msg, "backbone.pt: key '" + weight_key + "': the value at index 0 is inf")) << msg;
  msg = resume(variant("backbone.pt", [&](StateDict& sd) {
    for (auto& kv : sd)
      if (kv.first == var_key) kv.second = -kv.second.abs() - 1;
  }));
  EXPECT_TRUE(contains(msg, "backbone.pt: key '" + var_key + "': the value at index 0 is")) << msg;
  EXPECT_TRUE(contains(msg, "expected a value >= 0")) << msg;
  // A CPU generator state of the right size whose Mersenne Twister position is out of range.
  msg = resume(variant("fc_shard_0.pt", [&](StateDict& sd) {
    for (auto& kv : sd)
      if (kv.first == "rng.cpu") kv.second = kv.second.clone().fill_(255);
  }));
  EXPECT_TRUE(contains(msg, "fc_shard_0.pt: key 'rng.cpu': not a valid")) << msg;
  // The marker: a key that is not a number.
  const std::string marker = variant("backbone.pt", [](StateDict&) {});
  testing::write_text(marker + "/COMMITTED", "step 3\nworld_size 1\nnum_classes ten\n");
  msg = resume(marker);
  EXPECT_TRUE(contains(msg, "/COMMITTED:3: key 'num_classes' is 'ten'")) << msg;
}

TEST(PartialFCState, RowsAllocatedForACheckpointAreFilledBeforeUse) {
  auto dist = Distributed::init(DistEnv{});
  PartialFCOptions o;
  o.num_classes = 20;
  o.embedding_size = 4;
  PartialFC fresh(*dist, o);
  o.initialise_rows = false;
  PartialFC resumed(*dist, o);
  const at::Tensor emb = torch::randn({6, 4}), labels = torch::randint(0, 20, {6}, torch::kLong);
  std::string msg = error_of([&] { resumed.forward(emb, labels); });
  EXPECT_TRUE(contains(msg, "allocated for a checkpoint that has not been loaded")) << msg;
  // load_state on such a shard needs every entry.
  msg = error_of([&] { resumed.load_state({{"weight", fresh.weight()}}, "ckpt"); });
  EXPECT_TRUE(contains(msg, "ckpt: classifier state 'opt.momentum' is missing")) << msg;
  std::vector<std::string> filled;
  resumed.fill_state([&](const std::string& name, const at::Tensor& rows) {
    filled.push_back(name);
    for (const auto& kv : fresh.state())
      if (kv.first == name) rows.copy_(kv.second);
  });
  EXPECT_EQ(filled, (std::vector<std::string>{"weight", "opt.momentum"}));
  for (PartialFC* fc : {&fresh, &resumed}) {
    fc->forward(emb, labels).loss.backward();
    fc->step(0.1);
  }
  EXPECT_TRUE(torch::equal(fresh.weight(), resumed.weight()));
}

// A save that fails on one rank (here rank 1's shard cannot be written) is given up by both
// ranks at the same point: it returns false everywhere, nothing of it stays, the previous
// committed checkpoint is the newest and still verifies, and the next save commits again.
TEST(CheckpointSave, FailureOnOneRankIsGivenUpByAll) {
  testing::run_ranks(2, [&](Distributed& d) {
    // One folder for both ranks: rank 0's, told to rank 1 through the store.
    if (d.rank() == 0) {
      const std::string made = testing::temp_dir("ckfail");
      d.store()->set("ckfail_dir", std::vector<uint8_t>(made.begin(), made.end()));
    }
    const std::vector<uint8_t> got = d.store()->get("ckfail_dir");
    const std::string dir(got.begin(), got.end());
    CheckpointManager ck(dir + "/ck", d, 3);
    const StateDict backbone{{"w", torch::arange(6, torch::kFloat)}};
    const StateDict ts{{"step", torch::tensor({2}, torch::kLong)}};
    StateDict shard{{"rows.start", torch::tensor({d.rank() * 4}, torch::kLong)},
                    {"rows.count", torch::tensor({4}, torch::kLong)},
                    {"rows/weight", torch::ones({4, 3})}};
    ASSERT_TRUE(ck.save(2, 8, backbone, ts, shard)) << ck.last_problem();
    StateDict bad = shard;
    if (d.rank() == 1) bad.emplace_back("rows/broken", at::Tensor());  // cannot be written
    EXPECT_FALSE(ck.save(4, 8, backbone, ts, bad));
    EXPECT_EQ(ck.failed_in_a_row(), 1);
    EXPECT_NE(ck.last_problem().find("rank 1: "), std::string::npos) << ck.last_problem();
    d.barrier();
    EXPECT_FALSE(std::filesystem::exists(dir + "/ck/step_00000004"));
    EXPECT_EQ(std::filesystem::path(ck.latest()).filename(), "step_00000002");
    EXPECT_EQ(verify_checkpoint(ck.latest(), d), "");
    EXPECT_TRUE(ck.save(6, 8, backbone, ts, shard));
    EXPECT_EQ(ck.failed_in_a_row(), 0);
    EXPECT_EQ(std::filesystem::path(ck.latest()).filename(), "step_00000006");
    // A bit flipped in a committed file: the read-back names the file and its CRC.
    d.barrier();
    if (d.rank() == 0) {
      const std::string f = dir + "/ck/step_00000006/fc_shard_1.pt";
      std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
      std::string bytes((std::istreambuf_iterator<char>(io)), std::istreambuf_iterator<char>());
      const size_t at = bytes.find(std::string(reinterpret_cast<const char*>(torch::ones({1}).data_ptr<float>()), 4));
      ASSERT_NE(at, std::string::npos);
      io.seekp(static_cast<std::streamoff>(at + 3));
      io.put(static_cast<char>(bytes[at + 3] ^ 0x10));
    }
    d.barrier();
    const std::string problem = verify_checkpoint(dir + "/ck/step_00000006", d);
    EXPECT_NE(problem.find("fc_shard_1.pt"), std::string::npos) << problem;
    EXPECT_NE(problem.find("CRC"), std::string::npos) << problem;
    EXPECT_EQ(std::filesystem::path(choose_verified_checkpoint(dir + "/ck/step_00000006", true, d)).filename(),
              "step_00000002");
  });
}

}  // namespace
}  // namespace faceshard
