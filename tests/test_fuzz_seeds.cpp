// The fuzz targets' seed corpora: valid files written by the project's own writers
// (RecordIO, insightface .rec, verification .bin, state_dict), by Python (pickle,
// torch.save) and by OpenCV (JPEG, PNG, BMP), the shipped configs and a small IJB meta
// set, written to <build>/fuzz/seeds/<target>/ for tools/fuzz.sh. Every seed must read
// back with the project's readers: a valid file the parsers refuse fails here.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <opencv2/imgproc.hpp>

#include "tests/cv2_reference.h"
#include "tests/test_paths.h"
#include "app/config/config.h"
#include "app/eval/ijb_meta.h"
#include "data/image_header.h"
#include "data/image_transform.h"
#include "data/insightface_rec.h"
#include "data/recordio.h"
#include "data/verification_bin.h"
#include "models/torch_save/state_dict_io.h"
#include "models/torch_save/torch_save_format.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;

// Written under a temporary name and renamed, so a fuzz run reading the folder never
// sees half a seed.
void put_seed(const std::string& target, const std::string& name, const std::string& bytes) {
  const fs::path dir = fs::path(FACESHARD_FUZZ_SEEDS_DIR) / target;
  fs::create_directories(dir);
  const std::string tmp = (dir / (name + ".tmp." + std::to_string(::getpid()))).string();
  {
    std::ofstream f(tmp, std::ios::binary);
    f.write(bytes.data(), std::streamsize(bytes.size()));
  }
  fs::rename(tmp, dir / name);
}

std::string slurp(const std::string& path) { return testing::read_text(path); }

std::vector<uint8_t> random_bytes(std::mt19937_64& g, size_t n) {
  std::vector<uint8_t> b(n);
  for (auto& x : b) x = uint8_t(g());
  return b;
}

// recordio seed format (fuzz_entries.h): u16 .idx length, .idx text, .rec bytes.
std::string rec_seed(const std::string& rec, const std::string& idx) {
  const std::string i = slurp(idx);
  EXPECT_LT(i.size(), 65536u);
  std::string s;
  s.push_back(char(i.size() & 0xff));
  s.push_back(char(i.size() >> 8));
  return s + i + slurp(rec);
}

const char* kPySeeds = R"PY(
import collections, pickle, sys, torch
d = sys.argv[1]
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Conv2d(3, 2, 1), torch.nn.BatchNorm2d(2), torch.nn.PReLU(2))
torch.save(net.state_dict(), d + '/module.pt')
a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
torch.save(collections.OrderedDict([('a', a), ('view', a[:, 1:]), ('p', torch.nn.Parameter(torch.ones(2))),
                                    ('h', torch.arange(3).half()), ('bf', torch.arange(2).bfloat16()),
                                    ('l', torch.tensor(5)), ('b', torch.tensor([True])), ('e', torch.empty(0, 2)),
                                    ('tie', a)]), d + '/mixed.pt')
torch.save({'w': torch.ones(2, dtype=torch.float64)}, d + '/plain.pt')
bins = [bytes([i % 256]) * (1 + 7 * i) for i in range(6)]
issame = [True, False, True]
for proto in (2, 3, 4, 5):
    open(d + '/p%d.bin' % proto, 'wb').write(pickle.dumps((bins, issame), protocol=proto))
dup = list(bins); dup[1] = dup[0]
open(d + '/dup.bin', 'wb').write(pickle.dumps((dup, issame), protocol=4))
open(d + '/latin1.bin', 'wb').write(pickle.dumps(([b.decode('latin1') for b in bins], issame), protocol=4))
open(d + '/list.bin', 'wb').write(pickle.dumps([bins, [1, 0, 1]], protocol=2))
)PY";

TEST(FuzzSeeds, WrittenByTheProjectAndPython) {
  const std::string dir = testing::temp_dir("fuzz_seeds");
  std::mt19937_64 g(11);
  // .rec/.idx: insightface's layout, and a plain RecordIO with sparse keys and payloads
  // that hold the magic word (multi-part records).
  {
    InsightFaceRecWriter w(dir + "/if.rec", dir + "/if.idx");
    for (int c = 0; c < 3; ++c)
      for (int i = 0; i < 2; ++i) w.add(c, random_bytes(g, 8 + g() % 40));
    w.commit(4);
    const IndexedRecordIO r(dir + "/if.rec", dir + "/if.idx");
    EXPECT_EQ(read_insightface_layout(r).num_images(), 6u);
    put_seed("recordio", "insightface", rec_seed(dir + "/if.rec", dir + "/if.idx"));
  }
  {
    RecordIOWriter w(dir + "/p.rec", dir + "/p.idx");
    std::vector<uint8_t> magic = random_bytes(g, 40);
    const uint8_t m[4] = {0x0a, 0x23, 0xd7, 0xce};
    std::copy(m, m + 4, magic.begin() + 8);
    std::copy(m, m + 4, magic.begin() + 20);
    w.write(7, magic);
    w.write(123456789, random_bytes(g, 13));
    w.write(3, std::vector<uint8_t>{});
    w.commit();
    const IndexedRecordIO r(dir + "/p.rec", dir + "/p.idx");
    std::vector<uint8_t> back;
    r.read(7, back);
    EXPECT_EQ(back, magic);
    put_seed("recordio", "multipart-sparse", rec_seed(dir + "/p.rec", dir + "/p.idx"));
  }
  // Verification .bin: ours, and Python's pickles of several protocols and styles.
  {
    VerificationSet s;
    for (int i = 0; i < 4; ++i) s.images.push_back(random_bytes(g, 1 + g() % 300));
    s.issame = {true, false};
    const auto b = encode_verification_bin(s);
    EXPECT_EQ(parse_verification_bin(b.data(), b.size(), "ours").num_pairs(), 2u);
    put_seed("verification_bin", "ours", std::string(b.begin(), b.end()));
  }
  const auto py = testing::run_python(dir, "seeds.py", kPySeeds, {dir});
  ASSERT_EQ(py.status, 0) << py.output;
  for (const char* name : {"p2.bin", "p3.bin", "p4.bin", "p5.bin", "dup.bin", "latin1.bin", "list.bin"}) {
    const std::string b = slurp(dir + "/" + name);
    EXPECT_EQ(read_verification_bin(dir + "/" + name).num_pairs(), 3u) << name;
    put_seed("verification_bin", name, b);
  }
  // state_dicts: ours and torch.save's; their data.pkl alone for the pickle target.
  write_state_dict({{"w", torch::arange(6, torch::kFloat).reshape({2, 3})},
                    {"v", torch::arange(6, torch::kFloat).reshape({2, 3}).slice(1, 1)},
                    {"h", torch::ones({2}, torch::kHalf)},
                    {"i", torch::tensor(3, torch::kLong)},
                    {"b", torch::zeros({1}, torch::kBool)}},
                   dir + "/ours.pt");
  for (const char* name : {"ours.pt", "module.pt", "mixed.pt", "plain.pt"}) {
    const std::string path = dir + "/" + name;
    EXPECT_FALSE(read_state_dict(path).empty()) << name;
    put_seed("state_dict_zip", name, slurp(path));
    const TorchSaveFile f = open_torch_save(path);
    const ZipArchive::Entry* pkl = nullptr;
    for (const auto& e : f.zip.entries())
      if (e.name.size() >= 8 && e.name.compare(e.name.size() - 8, 8, "data.pkl") == 0) pkl = &e;
    ASSERT_NE(pkl, nullptr) << name;
    const std::vector<uint8_t> b = f.zip.read(*pkl);
    put_seed("state_dict_pickle", std::string(name) + ".pkl", std::string(b.begin(), b.end()));
  }
  // Configs: the shipped ones (those with a base name a file the target cannot read, and
  // still exercise everything before it) and small ones with --set overrides after a NUL.
  for (const auto& e : fs::directory_iterator(std::string(FACESHARD_SOURCE_DIR) + "/configs"))
    if (e.path().extension() == ".yaml") put_seed("config_yaml", e.path().filename().string(), slurp(e.path().string()));
  const std::string small = "data:\n  num_classes: 10\n  val_targets: [lfw]\noptim: {lr: 0.1, betas: [0.9, 0.99]}\n";
  EXPECT_NO_THROW(load_config_text(small, "small.yaml", {"train.precision=bf16", "loss.margin=[1.0, 0.0, 0.4]"}));
  put_seed("config_yaml", "small", small);
  put_seed("config_yaml", "small-with-set", small + std::string(1, '\0') + "train.precision=bf16\nloss.margin=[1.0, 0.0, 0.4]");
  // IJB meta: landmarks, templates and pairs, NUL-separated.
  const std::string lmk = "1.jpg 1 2 3 4 5 6 7 8 9 10 0.9\n2.jpg 1 2 3 4 5 6 7 8 9 10 0.8\n\n3.jpg 1 2 3 4 5 6 7 8 9 10 0.5\n";
  const std::string tid = "1.jpg 1 1\n2.jpg 1 2\n3.jpg 2 3\n";
  const std::string pairs = "1 2 0\n1 1 1\n";
  EXPECT_EQ(parse_ijb_meta("IJBC", {"l", lmk}, {"t", tid}, {"p", pairs}).pair_t1.size(), 2u);
  put_seed("ijb_meta", "small", lmk + std::string(1, '\0') + tid + std::string(1, '\0') + pairs);
  // Images: JPEG (baseline, progressive, greyscale, restart markers, EXIF orientation),
  // PNG (8/16-bit, grey, alpha), BMP (24/32-bit, 8-bit palette), written by OpenCV.
  cv::Mat bgr(24, 40, CV_8UC3), grey, bgra, bgr16;
  cv::randu(bgr, 0, 256);
  cv::cvtColor(bgr, grey, cv::COLOR_BGR2GRAY);
  cv::cvtColor(bgr, bgra, cv::COLOR_BGR2BGRA);
  bgr.convertTo(bgr16, CV_16U, 257);
  const auto enc = [](const char* ext, const cv::Mat& m, const std::vector<int>& params = {}) {
    std::vector<uint8_t> b;
    b = testing::cv2_imencode(ext, m, params);
    EXPECT_FALSE(b.empty()) << ext;
    return b;
  };
  const std::vector<uint8_t> jpeg = enc(".jpg", bgr);
  std::vector<uint8_t> exif(jpeg.begin(), jpeg.begin() + 2);
  const uint8_t app1[] = {0xFF, 0xE1, 0, 34, 'E', 'x', 'i', 'f', 0, 0, 'I', 'I', 42, 0, 8, 0, 0, 0, 1, 0,
                          0x12, 0x01, 3, 0, 1, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0};
  exif.insert(exif.end(), app1, app1 + sizeof app1);
  exif.insert(exif.end(), jpeg.begin() + 2, jpeg.end());
  const std::vector<std::pair<std::string, std::vector<uint8_t>>> images = {
      {"baseline.jpg", jpeg},
      {"progressive.jpg", enc(".jpg", bgr, {testing::cv2::IMWRITE_JPEG_PROGRESSIVE, 1})},
      {"grey.jpg", enc(".jpg", grey)},
      {"restarts.jpg", enc(".jpg", bgr, {testing::cv2::IMWRITE_JPEG_RST_INTERVAL, 2})},
      {"exif-orientation-6.jpg", exif},
      {"bgr.png", enc(".png", bgr)},
      {"grey.png", enc(".png", grey)},
      {"bgra.png", enc(".png", bgra)},
      {"bgr16.png", enc(".png", bgr16)},
      {"bgr.bmp", enc(".bmp", bgr)},
      {"grey.bmp", enc(".bmp", grey)},
      {"bgra.bmp", enc(".bmp", bgra)},
  };
  for (const auto& [name, b] : images) {
    const EncodedImageHeader h = read_image_header(b.data(), b.size(), name);
    EXPECT_EQ(h.decoded_width() * h.decoded_height(), 24 * 40) << name;
    EXPECT_EQ(decode_image(b.data(), b.size(), name).size(), h.orientation == 6 ? cv::Size(24, 40) : cv::Size(40, 24))
        << name;
    put_seed("image_header", name, std::string(b.begin(), b.end()));
  }
}

}  // namespace
}  // namespace faceshard
