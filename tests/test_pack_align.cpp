// faceshard-pack for photos that are not 112x112 aligned crops: alignment from five
// landmarks against insightface's own face_align.norm_crop (Python, .venv), the landmark
// file's errors (one line each, nothing written), and --resize's three fits against their
// definition computed with Python's cv2.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <opencv2/imgproc.hpp>

#include "data/dataset.h"
#include "data/face_align.h"
#include "data/image_encode.h"
#include "data/image_transform.h"
#include "data/pack_transform.h"
#include "data/synthetic_faces.h"
#include "tests/harness.h"
#include "tests/test_files.h"
#include "tests/test_paths.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

cv::Mat read_image(const std::string& path) {
  const std::vector<uint8_t> b = testing::slurp(path);
  return decode_image(b.data(), b.size(), path);
}

double mean_abs(const cv::Mat& a, const cv::Mat& b) {
  cv::Mat d;
  cv::absdiff(a, b, d);
  const cv::Scalar m = cv::mean(d);
  return (m[0] + m[1] + m[2]) / 3;
}

// A photo: an aligned synthetic face placed into a larger picture by a similarity (scale,
// rotation, shift), with the template's points carried along and moved by up to 2 px, as a
// detector's landmarks are.
struct Photo {
  cv::Mat image;
  std::array<float, 10> landmarks;
};
Photo make_photo(const cv::Mat& face, double scale, double angle, cv::Point2d shift, cv::Size size, uint32_t seed) {
  cv::Mat S = cv::getRotationMatrix2D(cv::Point2f(56, 56), angle, scale);
  S.at<double>(0, 2) += shift.x;
  S.at<double>(1, 2) += shift.y;
  Photo p;
  cv::warpAffine(face, p.image, S, size, cv::INTER_LINEAR, cv::BORDER_REFLECT);
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> jitter(-2.f, 2.f);
  for (int k = 0; k < 5; ++k) {
    const cv::Point2f t = arcface_template()[size_t(k)];
    p.landmarks[size_t(2 * k)] = float(S.at<double>(0, 0) * t.x + S.at<double>(0, 1) * t.y + S.at<double>(0, 2)) + jitter(g);
    p.landmarks[size_t(2 * k + 1)] =
        float(S.at<double>(1, 0) * t.x + S.at<double>(1, 1) * t.y + S.at<double>(1, 2)) + jitter(g);
  }
  return p;
}

std::string landmark_line(const std::string& path, const std::array<float, 10>& lm) {
  std::ostringstream os;
  os.precision(9);
  os << path;
  for (float v : lm) os << " " << v;
  return os.str() + "\n";
}

// Four photos of four identities (SOURCE/id_k/photo.png, PNG: both sides read the same
// pixels) and their landmark file.
struct PhotoSet {
  std::vector<Photo> photos;
  std::string source, landmarks;
};
PhotoSet make_photo_set(const TempDir& d) {
  const SyntheticFaces faces(21);
  PhotoSet s;
  s.source = d / "photos";
  s.landmarks = d / "landmarks.txt";
  const struct {
    double scale, angle, x, y;
    int w, h;
  } how[] = {{2.2, 12, 60, 40, 320, 300}, {1.4, -25, 30, 70, 240, 260}, {0.8, 5, 20, 10, 150, 140}, {3.0, 170, 200, 260, 420, 400}};
  std::string text = "# path, then x y of: left eye, right eye, nose, left mouth corner, right mouth corner\n";
  for (int k = 0; k < 4; ++k) {
    const Photo p = make_photo(faces.view(uint64_t(k), 0), how[k].scale, how[k].angle, {how[k].x, how[k].y},
                               cv::Size(how[k].w, how[k].h), uint32_t(k));
    const std::string rel = "id_" + std::to_string(k) + "/photo.png";
    fs::create_directories(fs::path(s.source) / ("id_" + std::to_string(k)));
    testing::spit(s.source + "/" + rel, encode_png(p.image));
    text += landmark_line(rel, p.landmarks);
    s.photos.push_back(p);
  }
  testing::write_text(s.landmarks, text);
  return s;
}

// insightface's norm_crop of every listed photo, written as ref_<k>.png.
const char* kNormCrop = R"PY(
import sys, os, cv2, numpy as np
from insightface.utils import face_align
src, lm_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
k = 0
for line in open(lm_file):
    if not line.strip() or line.startswith('#'): continue
    f = line.split()
    img = cv2.imread(os.path.join(src, f[0]))
    lm = np.array([float(x) for x in f[1:11]], dtype=np.float32).reshape(5, 2)
    crop = face_align.norm_crop(img, lm, image_size=112)
    cv2.imwrite(os.path.join(out, 'ref_%d.png' % k), crop)
    # What pack stores is JPEG of quality 95: the reference stored the same way.
    cv2.imwrite(os.path.join(out, 'ref_%d.jpg' % k), crop, [cv2.IMWRITE_JPEG_QUALITY, 95])
    k += 1
print('norm_crop', k)
)PY";

TEST(PackAlign, LandmarksMatchInsightfaceNormCrop) {
  TempDir d;
  const PhotoSet s = make_photo_set(d);
  const auto py = testing::run_python(d.path, "norm_crop.py", kNormCrop, {s.source, s.landmarks, d.path});
  ASSERT_EQ(py.status, 0) << py.output;
  ASSERT_NE(py.output.find("norm_crop 4"), std::string::npos) << py.output;
  const auto r = testing::run_tool("faceshard-pack", "pack '" + s.source + "' '" + d / "out/train" + "' --landmarks '" +
                                                         s.landmarks + "' 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("aligned to the ArcFace 112x112 template"), std::string::npos) << r.output;
  const RecordIODataset ds(d / "out/train.rec", d / "out/train.idx");
  ASSERT_EQ(ds.size(), 4u);
  RawSample sample;
  for (int k = 0; k < 4; ++k) {
    const cv::Mat ref = read_image(d / ("ref_" + std::to_string(k) + ".png"));
    ASSERT_EQ(ref.size(), cv::Size(112, 112));
    EXPECT_GT(cv::mean(ref)[1], 20.0) << "the reference crop must hold the face, not the black border";
    // The aligner itself, on the same pixels: the same template and transform as norm_crop.
    const cv::Mat mine = align_face(read_image(s.source + "/id_" + std::to_string(k) + "/photo.png"), s.photos[size_t(k)].landmarks);
    EXPECT_LT(mean_abs(mine, ref), 1.0) << "photo " << k;
    // What pack stored (JPEG of quality 95), decoded, against norm_crop's crop stored by cv2
    // as JPEG of quality 95.
    ds.read(uint64_t(k), sample);
    EXPECT_EQ(sample.label, k);
    const cv::Mat packed = decode_image(sample.bytes.data(), sample.bytes.size(), "record");
    ASSERT_EQ(packed.size(), cv::Size(112, 112));
    EXPECT_LT(mean_abs(packed, read_image(d / ("ref_" + std::to_string(k) + ".jpg"))), 1.0) << "photo " << k;
    std::printf("photo %d: mean |align_face - norm_crop| %.4f, mean |packed - norm_crop as JPEG 95| %.4f\n", k,
                mean_abs(mine, ref), mean_abs(packed, read_image(d / ("ref_" + std::to_string(k) + ".jpg"))));
  }
}

int lines_with(const std::string& out, const std::string& what) {
  int n = 0;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) n += line.find(what) != std::string::npos;
  return n;
}

TEST(PackAlign, BadLandmarkFilesAreOneLineEachAndWriteNothing) {
  TempDir d;
  const PhotoSet s = make_photo_set(d);
  std::vector<std::string> good;
  for (int k = 0; k < 4; ++k) good.push_back(landmark_line("id_" + std::to_string(k) + "/photo.png", s.photos[size_t(k)].landmarks));
  auto lm_text = [&](int k) { return good[size_t(k)].substr(good[size_t(k)].find(' ')); };  // " x1 y1 ..."
  const std::string all3 = good[1] + good[2] + good[3];
  std::array<float, 10> mirrored{};
  for (int k = 0; k < 5; ++k) {  // the five points mirrored left-right about x = 100
    mirrored[size_t(2 * k)] = 200 - s.photos[0].landmarks[size_t(2 * k)];
    mirrored[size_t(2 * k + 1)] = s.photos[0].landmarks[size_t(2 * k + 1)];
  }
  const struct {
    const char* name;
    std::string text;
    std::string want;
  } cases[] = {
      {"missing image", "id_0/nope.png" + lm_text(0) + good[0] + all3, "landmarks.txt:1: 'id_0/nope.png': no such image"},
      {"wrong count", "id_0/photo.png 1 2 3 4 5 6 7 8 9\n" + all3,
       "landmarks.txt:1: expected 10 numbers after the image path"},
      {"not a number", "id_0/photo.png 70 80 x 90 100 110 80 130 120 130\n" + all3, "'x', which is not a number"},
      {"degenerate", "id_0/photo.png 50 50 50 50 50 50 50 50 50 50\n" + all3, "degenerate landmarks: the eyes are 0 px apart"},
      {"mirrored", landmark_line("id_0/photo.png", mirrored) + all3, "mirrored or out of order"},
      {"outside", "id_0/photo.png 5000 5000 5035 5000 5018 5020 5004 5040 5032 5040\n" + all3,
       "every landmark lies outside the 320x300 image"},
      {"no line", all3, "id_0/photo.png: no landmarks for this image"},
      {"twice", good[0] + good[0] + all3, "landmarks.txt:2: 'id_0/photo.png': listed twice (first on line 1)"},
  };
  for (const auto& c : cases) {
    testing::write_text(s.landmarks, c.text);
    fs::remove_all(d / "out");
    const auto r = testing::run_tool("faceshard-pack", "pack '" + s.source + "' '" + d / "out/train" + "' --landmarks '" +
                                                           s.landmarks + "' 2>&1");
    EXPECT_NE(r.status, 0) << c.name << "\n" << r.output;
    EXPECT_EQ(lines_with(r.output, c.want), 1) << c.name << "\n" << r.output;
    EXPECT_EQ(lines_with(r.output, "error"), 1) << c.name << ": one line\n" << r.output;
    EXPECT_FALSE(fs::exists(d / "out")) << c.name << ": nothing written";
  }
  // Several problems at once: each listed, then one summary, still nothing written.
  testing::write_text(s.landmarks, "id_0/photo.png 1 2 3\n" + good[1] + good[1] + good[2] + good[3]);
  const auto r = testing::run_tool("faceshard-pack", "pack '" + s.source + "' '" + d / "out/train" + "' --landmarks '" +
                                                         s.landmarks + "' 2>&1");
  EXPECT_EQ(r.status, 2) << r.output;
  for (const char* want : {"landmarks.txt:1: expected 10 numbers", "listed twice", "2 problems found"})
    EXPECT_EQ(lines_with(r.output, want), 1) << want << "\n" << r.output;
  EXPECT_EQ(lines_with(r.output, "no landmarks"), 0) << "a bad line is one problem, not two\n" << r.output;
  EXPECT_FALSE(fs::exists(d / "out"));
  // --skip-bad leaves the image without landmarks out and packs the rest.
  const auto skip = testing::run_tool("faceshard-pack", "pack '" + s.source + "' '" + d / "out/train" + "' --landmarks '" +
                                                            s.landmarks + "' --skip-bad 2>&1");
  ASSERT_EQ(skip.status, 0) << skip.output;
  EXPECT_EQ(RecordIODataset(d / "out/train.rec", d / "out/train.idx").size(), 3u);
  // The options that do not go together: one line, status 2.
  for (const std::string& args : std::vector<std::string>{"--landmarks '" + s.landmarks + "' --resize 112", "--resize 128",
                                                          "--fit center", "--landmarks /nonexistent/lm.txt",
                                                          "--resize 112 --no-check", "--resize 112 --fit wide"}) {
    const auto bad = testing::run_tool("faceshard-pack", "pack '" + s.source + "' '" + d / "bad/train" + "' " + args + " 2>&1");
    EXPECT_EQ(bad.status, 2) << args << "\n" << bad.output;
    EXPECT_EQ(std::count(bad.output.begin(), bad.output.end(), '\n'), 1) << args << "\n" << bad.output;
    EXPECT_FALSE(fs::exists(d / "bad")) << args;
  }
}

// --fit's three definitions, computed with Python's cv2 from the words of the help.
const char* kFitReference = R"PY(
import sys, cv2, numpy as np
src, out = sys.argv[1], sys.argv[2]
img = cv2.imread(src)
h, w = img.shape[:2]
N = 112
def scaled(im, nw, nh):
    if (nw, nh) == (im.shape[1], im.shape[0]): return im
    shrink = nw <= im.shape[1] and nh <= im.shape[0]
    return cv2.resize(im, (nw, nh), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
s = N / max(w, h)
r = scaled(img, min(N, max(1, round(w * s))), min(N, max(1, round(h * s))))
pad = np.zeros((N, N, 3), np.uint8)
y0, x0 = (N - r.shape[0]) // 2, (N - r.shape[1]) // 2
pad[y0:y0 + r.shape[0], x0:x0 + r.shape[1]] = r
cv2.imwrite(out + '_pad.png', pad)
s = N / min(w, h)
r = scaled(img, max(N, max(1, round(w * s))), max(N, max(1, round(h * s))))
y0, x0 = (r.shape[0] - N) // 2, (r.shape[1] - N) // 2
cv2.imwrite(out + '_center.png', r[y0:y0 + N, x0:x0 + N])
cv2.imwrite(out + '_stretch.png', scaled(img, N, N))
)PY";

TEST(PackResize, FitModesFollowTheirDefinition) {
  TempDir d;
  const SyntheticFaces faces(5);
  // LFW-style 250x250, an insightface 96x112 crop (W x H), a wide 250x200 and a small 64x80.
  const cv::Mat face = faces.view(1, 0);
  cv::Mat lfw, narrow, wide, small;
  cv::resize(face, lfw, cv::Size(250, 250), 0, 0, cv::INTER_LINEAR);
  narrow = face(cv::Rect(8, 0, 96, 112)).clone();
  cv::resize(face, wide, cv::Size(250, 200), 0, 0, cv::INTER_LINEAR);
  cv::resize(face, small, cv::Size(64, 80), 0, 0, cv::INTER_AREA);
  const std::pair<const char*, cv::Mat> images[] = {{"lfw", lfw}, {"narrow", narrow}, {"wide", wide}, {"small", small}};
  for (const auto& [name, img] : images) {
    const std::string src = d / (std::string(name) + ".png");
    testing::spit(src, encode_png(img));
    const auto py = testing::run_python(d.path, "fit.py", kFitReference, {src, d / name});
    ASSERT_EQ(py.status, 0) << py.output;
    const cv::Mat decoded = read_image(src);
    for (FitMode mode : {FitMode::pad, FitMode::center, FitMode::stretch}) {
      const cv::Mat got = fit_to_square(decoded, 112, mode);
      const cv::Mat want = read_image(d / (std::string(name) + "_" + fit_mode_name(mode) + ".png"));
      ASSERT_EQ(got.size(), cv::Size(112, 112)) << name << " " << fit_mode_name(mode);
      // OpenCV's resamplers may differ by a level between its C++ and Python builds.
      EXPECT_LE(cv::norm(got, want, cv::NORM_INF), 1.0) << name << " " << fit_mode_name(mode);
      EXPECT_LT(mean_abs(got, want), 0.05) << name << " " << fit_mode_name(mode);
    }
  }
  // The 96x112 crop padded is insightface's 112x112 layout: the crop unchanged, 8 black
  // columns on each side.
  const cv::Mat padded = fit_to_square(narrow, 112, FitMode::pad);
  EXPECT_EQ(cv::norm(padded(cv::Rect(8, 0, 96, 112)), narrow, cv::NORM_INF), 0.0);
  EXPECT_EQ(cv::countNonZero(padded(cv::Rect(0, 0, 8, 112)).reshape(1)), 0);
  EXPECT_EQ(cv::countNonZero(padded(cv::Rect(104, 0, 8, 112)).reshape(1)), 0);

  // The tool: refused without --resize (the message says what to do), packed with it.
  for (const auto& [name, img] : images) {
    fs::create_directories(d / (std::string("src/") + name));
    testing::spit(d / (std::string("src/") + name + "/a.png"), encode_png(img));
  }
  auto r = testing::run_tool("faceshard-pack", "pack '" + d / "src" + "' '" + d / "out/train" + "' 2>&1");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("image is 250x250, expected 112x112 (faceshard-pack --resize 112"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(d / "out"));
  r = testing::run_tool("faceshard-pack", "pack '" + d / "src" + "' '" + d / "out/train" + "' --resize 112 --fit center 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  const RecordIODataset ds(d / "out/train.rec", d / "out/train.idx");
  ASSERT_EQ(ds.size(), 4u);
  // Records in identity order: lfw, narrow, small, wide.
  const cv::Mat by_name[] = {lfw, narrow, small, wide};
  RawSample sample;
  for (uint64_t i = 0; i < 4; ++i) {
    ds.read(i, sample);
    const cv::Mat packed = decode_image(sample.bytes.data(), sample.bytes.size(), "record");
    ASSERT_EQ(packed.size(), cv::Size(112, 112));
    // The centre fit of the decoded source, stored as JPEG of quality 95.
    const std::vector<uint8_t> jpeg = encode_jpeg(fit_to_square(by_name[i], 112, FitMode::center), 95);
    EXPECT_LT(mean_abs(packed, decode_image(jpeg.data(), jpeg.size(), "want")), 0.5) << i;
  }
}

}  // namespace
}  // namespace faceshard
