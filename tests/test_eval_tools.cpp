// Evaluation tools: the .npy writer, IJB alignment and template protocol, and the
// faceshard-ijb / faceshard-extract binaries, checked against independent references
// (the .npy format spec and numpy; skimage's Umeyama estimate and insightface's
// eval_ijbc.py protocol re-written in numpy; a direct forward pass of the model).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <opencv2/imgproc.hpp>

#include "tests/cv2_reference.h"
#include "tests/test_paths.h"
#include "app/io/checkpoint.h"
#include "app/eval/evaluation.h"
#include "app/eval/ijb.h"
#include "app/eval/inference_model.h"
#include "app/io/npy.h"
#include "data/image_encode.h"
#include "data/image_transform.h"
#include "data/verification_bin.h"
#include "data/synthetic_faces.h"
#include "models/backbone_registry.h"
#include "base/error.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;
using testing::read_text;
using testing::run_python;
using testing::run_tool;
using testing::temp_dir;
using testing::write_text;

// Reads a float32 .npy written by write_npy_float32 (header length from bytes 8-9).
at::Tensor read_npy(const std::string& path, std::vector<int64_t> shape) {
  const std::string b = read_text(path);
  const size_t hlen = size_t(uint8_t(b[8])) | (size_t(uint8_t(b[9])) << 8);
  at::Tensor t = torch::empty(shape);
  EXPECT_EQ(b.size(), 10 + hlen + size_t(t.numel()) * 4) << path;
  if (b.size() == 10 + hlen + size_t(t.numel()) * 4) std::memcpy(t.data_ptr<float>(), b.data() + 10 + hlen, t.numel() * 4);
  return t;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no error>";
}

// A small model with its export metadata; BatchNorm statistics set by a few train-mode
// passes so that eval-mode embeddings are of a normal size.
std::shared_ptr<Backbone> write_model(const std::string& dir, int64_t dim = 32) {
  torch::manual_seed(11);
  BackboneOptions o;
  o.name = "mbf";
  o.embedding_size = dim;
  auto m = make_backbone(o);
  {
    torch::NoGradGuard ng;
    m->train();
    for (int i = 0; i < 3; ++i) m->forward(torch::randn({8, 3, 112, 112}));
  }
  m->eval();
  fs::create_directories(dir);
  save_backbone_weights(*m, dir + "/model.pt");
  write_text(dir + "/model.json", "{\"backbone\": \"mbf\", \"embedding_size\": " + std::to_string(dim) + "}\n");
  return m;
}

at::Tensor flip_embedding(Backbone& m, const cv::Mat& bgr112) {
  at::Tensor x = torch::empty({1, 3, 112, 112});
  bgr_to_normalized_chw(bgr112, false, x.data_ptr<float>());
  torch::NoGradGuard ng;
  return (m.forward(x) + m.forward(x.flip({3})))[0];
}

// ---------------------------------------------------------------------------------------
// .npy

TEST(EvalNpy, HeaderFollowsTheFormatSpecAndNumpyLoadsIt) {
  const std::string dir = temp_dir("npy");
  const at::Tensor v = torch::randn({5, 3});
  write_npy_float32(v, dir + "/a.npy");
  const std::string b = read_text(dir + "/a.npy");
  ASSERT_GT(b.size(), 10u);
  EXPECT_EQ(b.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  const size_t hlen = size_t(uint8_t(b[8])) | (size_t(uint8_t(b[9])) << 8);
  EXPECT_EQ((10 + hlen) % 64, 0u);
  const std::string header = b.substr(10, hlen);
  EXPECT_EQ(header.rfind("{'descr': '<f4', 'fortran_order': False, 'shape': (5, 3), }", 0), 0u) << header;
  EXPECT_EQ(header.back(), '\n');
  EXPECT_EQ(b.size(), 10 + hlen + 15 * 4);
  EXPECT_TRUE(torch::equal(read_npy(dir + "/a.npy", {5, 3}), v));
  write_npy_float32(torch::arange(7, torch::kDouble) / 3, dir + "/b.npy");
  std::ostringstream expect;
  expect.precision(9);
  for (int i = 0; i < 15; ++i) expect << (i ? " " : "") << v.view(-1)[i].item<float>();
  write_text(dir + "/expect.txt", expect.str());
  const auto r = run_python(dir, "npy.py", R"PY(
import sys, numpy as np
d = sys.argv[1]
a = np.load(d + '/a.npy')
assert a.dtype == np.float32 and a.shape == (5, 3), (a.dtype, a.shape)
e = np.array(open(d + '/expect.txt').read().split(), dtype=np.float32).reshape(5, 3)
assert np.allclose(a, e, rtol=1e-6, atol=1e-6), (a, e)
b = np.load(d + '/b.npy')
assert b.shape == (7,) and np.allclose(b, np.arange(7) / 3), b
print('numpy ok')
)PY",
                            {dir});
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(error_of([&] { write_npy_float32(torch::zeros({2, 2, 2}), dir + "/c.npy"); }).find("2-D"), std::string::npos);
}

// ---------------------------------------------------------------------------------------
// Alignment

TEST(EvalIjb, SimilarityEstimateMatchesUmeyamaInNumpy) {
  const std::string dir = temp_dir("umeyama");
  // Exact recovery of a known similarity.
  const double s = 1.7, a = 0.35, tx = 12.5, ty = -4.25;
  std::vector<cv::Point2f> src, dst, noisy;
  std::mt19937 g(3);
  std::normal_distribution<float> n(0, 1.5f);
  for (int i = 0; i < 5; ++i) {
    const cv::Point2f p(20.f + 17.f * float(i % 3), 30.f + 23.f * float(i / 2));
    src.push_back(p);
    dst.emplace_back(float(s * (std::cos(a) * p.x - std::sin(a) * p.y) + tx),
                     float(s * (std::sin(a) * p.x + std::cos(a) * p.y) + ty));
    noisy.emplace_back(dst.back().x + n(g), dst.back().y + n(g));
  }
  const cv::Mat M = estimate_similarity(src, dst);
  EXPECT_NEAR(M.at<double>(0, 0), s * std::cos(a), 1e-4);
  EXPECT_NEAR(M.at<double>(1, 0), s * std::sin(a), 1e-4);
  EXPECT_NEAR(M.at<double>(0, 2), tx, 1e-3);
  EXPECT_NEAR(M.at<double>(1, 2), ty, 1e-3);
  // Noisy points, and a reflection-forcing case, against skimage's _umeyama in numpy.
  std::vector<cv::Point2f> mirrored;
  for (const auto& p : src) mirrored.emplace_back(-p.x, p.y);
  std::ostringstream pts;
  pts.precision(9);
  for (const auto* set : {&src, &noisy, &mirrored})
    for (const auto& p : *set) pts << p.x << " " << p.y << "\n";
  write_text(dir + "/pts.txt", pts.str());
  const auto r = run_python(dir, "umeyama.py", R"PY(
import sys, numpy as np
def umeyama(src, dst):
    num, dim = src.shape
    src_mean, dst_mean = src.mean(0), dst.mean(0)
    sd, dd = src - src_mean, dst - dst_mean
    A = dd.T @ sd / num
    d = np.ones((dim,))
    if np.linalg.det(A) < 0: d[dim - 1] = -1
    T = np.eye(dim + 1)
    U, S, V = np.linalg.svd(A)
    T[:dim, :dim] = U @ np.diag(d) @ V
    scale = 1.0 / sd.var(axis=0).sum() * (S @ d)
    T[:dim, dim] = dst_mean - scale * (T[:dim, :dim] @ src_mean.T)
    T[:dim, :dim] *= scale
    return T[:2]
p = np.loadtxt(sys.argv[1] + '/pts.txt', dtype=np.float64)
src, noisy, mirrored = p[0:5], p[5:10], p[10:15]
for M in (umeyama(src, noisy), umeyama(mirrored, src)):
    print(' '.join('%.17g' % x for x in M.ravel()))
)PY",
                            {dir});
  ASSERT_EQ(r.status, 0) << r.output;
  std::istringstream in(r.output);
  for (const auto& pair : {std::make_pair(src, noisy), std::make_pair(mirrored, src)}) {
    const cv::Mat got = estimate_similarity(pair.first, pair.second);
    for (int k = 0; k < 6; ++k) {
      double want = 0;
      in >> want;
      EXPECT_NEAR(got.at<double>(k / 3, k % 3), want, 1e-6) << "entry " << k;
    }
  }
  EXPECT_NE(error_of([] { estimate_similarity({{1, 1}, {1, 1}}, {{0, 0}, {1, 1}}); }).find("coincide"), std::string::npos);
}

// A loose crop made by a known similarity from an aligned face, with the template points
// carried along as its landmarks: alignment must give the aligned face back.
struct LooseCrop {
  cv::Mat image;
  std::array<float, 10> landmarks;
};
LooseCrop make_loose_crop(const cv::Mat& aligned, double scale, double angle_deg, cv::Point2d shift, int size) {
  cv::Mat S = cv::getRotationMatrix2D(cv::Point2f(56, 56), angle_deg, scale);
  S.at<double>(0, 2) += shift.x;
  S.at<double>(1, 2) += shift.y;
  LooseCrop c;
  cv::warpAffine(aligned, c.image, S, cv::Size(size, size), cv::INTER_LINEAR, cv::BORDER_REPLICATE);
  for (int k = 0; k < 5; ++k) {
    const cv::Point2f t = arcface_template()[size_t(k)];
    c.landmarks[size_t(2 * k)] = float(S.at<double>(0, 0) * t.x + S.at<double>(0, 1) * t.y + S.at<double>(0, 2));
    c.landmarks[size_t(2 * k + 1)] = float(S.at<double>(1, 0) * t.x + S.at<double>(1, 1) * t.y + S.at<double>(1, 2));
  }
  return c;
}

double interior_mean_abs(const cv::Mat& a, const cv::Mat& b) {
  const cv::Rect r(6, 6, 100, 100);
  cv::Mat d;
  cv::absdiff(a(r), b(r), d);
  const cv::Scalar m = cv::mean(d);
  return (m[0] + m[1] + m[2]) / 3;
}

TEST(EvalIjb, AlignmentUndoesAKnownSimilarity) {
  const SyntheticFaces faces(9);
  const cv::Mat aligned = faces.view(3, 1);
  const LooseCrop c = make_loose_crop(aligned, 1.8, 17.0, cv::Point2d(70, 55), 260);
  // The similarity alignment estimates is the inverse of the one that made the crop, in
  // closed form: S maps the aligned face into the crop, so S^-1 maps the crop's landmarks
  // (the template carried by S) back onto the template.
  cv::Mat S = cv::getRotationMatrix2D(cv::Point2f(56, 56), 17.0, 1.8);
  S.at<double>(0, 2) += 70;
  S.at<double>(1, 2) += 55;
  cv::Mat S_inv;
  cv::invertAffineTransform(S, S_inv);
  std::vector<cv::Point2f> lm, tpl(arcface_template().begin(), arcface_template().end());
  for (int k = 0; k < 5; ++k) lm.emplace_back(c.landmarks[size_t(2 * k)], c.landmarks[size_t(2 * k + 1)]);
  const cv::Mat M = estimate_similarity(lm, tpl);
  for (int k = 0; k < 6; ++k)
    EXPECT_NEAR(M.at<double>(k / 3, k % 3), S_inv.at<double>(k / 3, k % 3), k % 3 == 2 ? 1e-3 : 1e-5) << "entry " << k;
  // align_face warps with that similarity: the same pixels as warping by S^-1 itself (bilinear
  // weights that differ by the estimate's rounding move a pixel by at most one level).
  const cv::Mat back = align_face(c.image, c.landmarks);
  ASSERT_EQ(back.rows, 112);
  ASSERT_EQ(back.cols, 112);
  cv::Mat want;
  cv::warpAffine(c.image, want, S_inv, cv::Size(112, 112), cv::INTER_LINEAR, cv::BORDER_CONSTANT, cv::Scalar(0, 0, 0));
  EXPECT_LE(cv::norm(back, want, cv::NORM_INF), 1.0);
  // And close to the aligned face it came from (two bilinear resamplings apart), far closer
  // than with landmarks 9 px off.
  const double good = interior_mean_abs(back, aligned);
  std::array<float, 10> off = c.landmarks;
  for (int k = 0; k < 5; ++k) off[size_t(2 * k)] += 9.0f;  // landmarks 9 px off (5 px in the crop)
  const double bad = interior_mean_abs(align_face(c.image, off), aligned);
  EXPECT_LT(good, 0.4 * bad) << "good " << good << " bad " << bad;
}

// ---------------------------------------------------------------------------------------
// Meta files

void write_meta(const std::string& root, const std::string& lmk, const std::string& tid, const std::string& pairs) {
  fs::create_directories(root + "/meta");
  write_text(root + "/meta/ijbc_name_5pts_score.txt", lmk);
  write_text(root + "/meta/ijbc_face_tid_mid.txt", tid);
  write_text(root + "/meta/ijbc_template_pair_label.txt", pairs);
}

TEST(EvalIjb, MetaFilesAreCheckedLineByLine) {
  const std::string root = temp_dir("ijbmeta");
  const std::string l1 = "1.jpg 1 2 3 4 5 6 7 8 9 10 0.9\n", l2 = "2.jpg 1 2 3 4 5 6 7 8 9 10 0.8\n";
  write_meta(root, l1 + l2, "1.jpg 5 7\n2.jpg 6 8\n", "5 6 0\n5 5 1\n");
  const IjbMeta m = read_ijb_meta(root, "IJBC");
  EXPECT_EQ(m.images.size(), 2u);
  EXPECT_EQ(m.templates, (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(m.medias, (std::vector<int64_t>{7, 8}));
  EXPECT_FLOAT_EQ(m.landmarks[1][9], 10.0f);
  EXPECT_DOUBLE_EQ(m.faceness[1], 0.8);
  EXPECT_EQ(m.pair_label, (std::vector<int>{0, 1}));
  write_meta(root, l1 + "2.jpg 1 2 3 0.8\n", "1.jpg 5 7\n2.jpg 6 8\n", "5 6 0\n");
  EXPECT_NE(error_of([&] { read_ijb_meta(root, "ijbc"); }).find("ijbc_name_5pts_score.txt:2: expected 12 fields"),
            std::string::npos);
  write_meta(root, l1 + l2, "1.jpg 5 7\n3.jpg 6 8\n", "5 6 0\n");
  EXPECT_NE(error_of([&] { read_ijb_meta(root, "ijbc"); }).find("same order"), std::string::npos);
  write_meta(root, l1 + l2, "1.jpg 5 7\n2.jpg 6 8\n", "5 6 2\n");
  EXPECT_NE(error_of([&] { read_ijb_meta(root, "ijbc"); }).find("label must be 0 or 1"), std::string::npos);
  write_meta(root, l1 + l2, "1.jpg 5 7\n2.jpg x 8\n", "5 6 1\n");
  EXPECT_NE(error_of([&] { read_ijb_meta(root, "ijbc"); }).find("'x' is not an integer"), std::string::npos);
  EXPECT_NE(error_of([&] { read_ijb_meta(root, "IJBB"); }).find("ijbb_name_5pts_score.txt"), std::string::npos);
  EXPECT_NE(error_of([&] { read_ijb_meta(root, "LFW"); }).find("IJBC or IJBB"), std::string::npos);
  // Line numbers are the file's own, blank lines counted.
  write_meta(root, l1 + "\n\n" + "2.jpg 1 2 3 4 5 6 7 8 9 10 high\n", "1.jpg 5 7\n2.jpg 6 8\n", "5 6 0\n");
  std::string e = error_of([&] { read_ijb_meta(root, "ijbc"); });
  EXPECT_NE(e.find("ijbc_name_5pts_score.txt:4: 'high' is not a number"), std::string::npos) << e;
  write_meta(root, l1 + l2, "1.jpg 5 7\n\n2.jpg 6 x\n", "5 6 0\n");
  e = error_of([&] { read_ijb_meta(root, "ijbc"); });
  EXPECT_NE(e.find("ijbc_face_tid_mid.txt:3: 'x' is not an integer"), std::string::npos) << e;
  write_meta(root, l1 + l2, "1.jpg 5 7\n2.jpg 6 8\n", "5 6 0\n\n\n5 6 3\n");
  e = error_of([&] { read_ijb_meta(root, "ijbc"); });
  EXPECT_NE(e.find("ijbc_template_pair_label.txt:4: label must be 0 or 1"), std::string::npos) << e;
  // A pair naming a template without images is an error of the meta files, found when
  // they are read (not after embedding every image).
  write_meta(root, l1 + l2, "1.jpg 5 7\n2.jpg 6 8\n", "5 6 0\n\n5 9 0\n6 6 1\n");
  e = error_of([&] { read_ijb_meta(root, "ijbc"); });
  EXPECT_NE(e.find("ijbc_template_pair_label.txt:3: template 9 has no images in"), std::string::npos) << e;
  EXPECT_NE(e.find("ijbc_face_tid_mid.txt"), std::string::npos) << e;
  // Every crop is looked for before any embedding: the first missing one is named, with
  // its line in the landmark file.
  write_meta(root, "\n" + l1 + l2, "1.jpg 5 7\n2.jpg 6 8\n", "5 6 0\n");
  const IjbMeta ok = read_ijb_meta(root, "ijbc");
  EXPECT_EQ(ok.image_lines, (std::vector<size_t>{2, 3}));
  fs::create_directories(root + "/loose_crop");
  write_text(root + "/loose_crop/1.jpg", "x");
  e = error_of([&] { check_ijb_images(ok, root + "/loose_crop"); });
  EXPECT_NE(e.find("loose_crop/2.jpg: cannot open image"), std::string::npos) << e;
  EXPECT_NE(e.find("ijbc_name_5pts_score.txt:3"), std::string::npos) << e;
  write_text(root + "/loose_crop/2.jpg", "x");
  EXPECT_EQ(error_of([&] { check_ijb_images(ok, root + "/loose_crop"); }), "<no error>");
}

// Image names stay inside loose_crop/ and faceness scores are finite and > 0 (a score of
// 0 weighs an image to nothing and used to give templates of zeros, and scores of 0).
TEST(EvalIjb, ImageNamesStayInsideTheRootAndFacenessIsPositive) {
  const std::string root = temp_dir("ijbconfine");
  const std::string l1 = "1.jpg 1 2 3 4 5 6 7 8 9 10 0.9\n";
  const std::string tid = "1.jpg 5 7\nNAME 6 8\n", pairs = "5 6 0\n";
  for (const std::string name : {"../../../../etc/passwd", "/etc/passwd", "a/../../b.jpg", "a/..", ".."}) {
    std::string t = tid;
    t.replace(t.find("NAME"), 4, name);
    write_meta(root, l1 + "\n" + name + " 1 2 3 4 5 6 7 8 9 10 0.8\n", t, pairs);
    const std::string e = error_of([&] { read_ijb_meta(root, "ijbc"); });
    EXPECT_NE(e.find("ijbc_name_5pts_score.txt:3: image '" + name + "' is not a path inside loose_crop/"),
              std::string::npos)
        << e;
  }
  for (const std::string name : {"a/b/c.jpg", "..jpg", "a..b/c.jpg", "./x.jpg"}) {
    std::string t = tid;
    t.replace(t.find("NAME"), 4, name);
    write_meta(root, l1 + name + " 1 2 3 4 5 6 7 8 9 10 0.8\n", t, pairs);
    EXPECT_EQ(read_ijb_meta(root, "ijbc").images[1], name);
  }
  std::string t = tid;
  t.replace(t.find("NAME"), 4, "2.jpg");
  for (const std::string score : {"0", "-0.5", "-0", "1e-400"}) {
    write_meta(root, l1 + "2.jpg 1 2 3 4 5 6 7 8 9 10 " + score + "\n", t, pairs);
    const std::string e = error_of([&] { read_ijb_meta(root, "ijbc"); });
    EXPECT_NE(e.find("ijbc_name_5pts_score.txt:2: faceness score must be > 0, got '" + score + "'"), std::string::npos)
        << e;
  }
  for (const std::string score : {"inf", "nan", "-inf", "1e999"}) {
    write_meta(root, l1 + "2.jpg 1 2 3 4 5 6 7 8 9 10 " + score + "\n", t, pairs);
    const std::string e = error_of([&] { read_ijb_meta(root, "ijbc"); });
    EXPECT_NE(e.find("ijbc_name_5pts_score.txt:2: '" + score + "' is not a finite number"), std::string::npos) << e;
  }
  write_meta(root, l1 + "2.jpg 1 2 3 4 5 6 7 8 9 10 1e-30\n", t, pairs);
  EXPECT_DOUBLE_EQ(read_ijb_meta(root, "ijbc").faceness[1], 1e-30);
}

// Pair scores are computed a chunk at a time: more pairs than two chunks, every pair
// checked against its dot product summed here.
TEST(EvalIjb, PairScoresCoverEveryChunk) {
  torch::manual_seed(8);
  const int64_t t = 50, e = 8, p = 70001;
  const at::Tensor f = torch::nn::functional::normalize(torch::randn({t, e}, torch::kDouble),
                                                        torch::nn::functional::NormalizeFuncOptions().dim(1));
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < t; ++i) ids.push_back(100 + 3 * i);
  IjbMeta m;
  std::mt19937 g(2);
  for (int64_t i = 0; i < p; ++i) {
    m.pair_t1.push_back(ids[size_t(g() % t)]);
    m.pair_t2.push_back(ids[size_t(g() % t)]);
  }
  const std::vector<double> s = ijb_pair_scores(f, ids, m);
  ASSERT_EQ(s.size(), size_t(p));
  const double* fp = f.data_ptr<double>();
  int64_t bad = 0;
  for (int64_t i = 0; i < p; ++i) {
    const int64_t a = (m.pair_t1[size_t(i)] - 100) / 3, b = (m.pair_t2[size_t(i)] - 100) / 3;
    double want = 0;
    for (int64_t k = 0; k < e; ++k) want += fp[a * e + k] * fp[b * e + k];
    bad += std::abs(s[size_t(i)] - want) > 1e-12 ? 1 : 0;
  }
  EXPECT_EQ(bad, 0);
}

// ---------------------------------------------------------------------------------------
// faceshard-ijb on a tiny IJB-style folder

// The eval_ijbc.py protocol in numpy, from the tool's per-image features and the meta files.
const char* kIjbReference = R"PY(
import json, sys, numpy as np
root, feats_path, out_dir, json_path = sys.argv[1:5]
feats = np.load(feats_path).astype(np.float64)
lines = [l.split() for l in open(root + '/meta/ijbc_name_5pts_score.txt') if l.strip()]
faceness = np.array([float(l[-1]) for l in lines])
tm = np.array([[int(x) for x in l.split()[1:]] for l in open(root + '/meta/ijbc_face_tid_mid.txt') if l.strip()])
templates, medias = tm[:, 0], tm[:, 1]
pairs = np.array([[int(x) for x in l.split()] for l in open(root + '/meta/ijbc_template_pair_label.txt') if l.strip()])
f = feats * faceness[:, None]
ut = np.unique(templates)
tf = np.zeros((len(ut), f.shape[1]))
for k, u in enumerate(ut):
    idx = np.where(templates == u)[0]
    fm = medias[idx]
    for m in np.unique(fm):
        tf[k] += f[idx[fm == m]].mean(axis=0)
tf /= np.linalg.norm(tf, axis=1, keepdims=True)
row = {u: k for k, u in enumerate(ut)}
score = np.array([tf[row[a]] @ tf[row[b]] for a, b, _ in pairs])
label = pairs[:, 2]
order = np.argsort(-score, kind='mergesort')
s, y = score[order], label[order]
thr = np.r_[np.where(np.diff(s))[0], y.size - 1]
tps = np.r_[0, np.cumsum(y)[thr]]
fps = np.r_[0, 1 + thr - np.cumsum(y)[thr]]
fpr, tpr = np.flipud(fps / fps[-1]), np.flipud(tps / tps[-1])
got = json.load(open(json_path))
saved = np.load(out_dir + '/IJBC_scores.npy')
assert saved.dtype == np.float32 and saved.shape == score.shape, (saved.dtype, saved.shape)
assert np.allclose(saved, score, atol=1e-6), np.abs(saved - score).max()
chosen = {}
for e in range(6, 0, -1):
    chosen[e] = np.argmin(np.abs(fpr - 10.0 ** -e))
    want = tpr[chosen[e]]
    have = got['tar_at_far']['1e-%d' % e]
    negatives = int((label == 0).sum())
    if negatives < round(10.0 ** e):
        # Not measured by these pairs: null, as the console says "not enough pairs".
        assert have is None, ('1e-%d' % e, have, negatives)
        continue
    assert abs(have - want) < 1e-12, ('1e-%d' % e, have, want)
    print('TAR@FAR=1e-%d %.6f (FPR %.5f)' % (e, want, fpr[chosen[e]]))
# The data set resolves the larger FARs: each on its own ROC point, none at FPR 0.
assert len({chosen[3], chosen[2], chosen[1]}) == 3 and min(fpr[chosen[e]] for e in (3, 2, 1)) > 0, chosen
assert got['pairs'] == len(pairs) and got['templates'] == len(ut)
)PY";

struct TinyIjb {
  std::string root;
  std::vector<LooseCrop> crops;
};

// 30 identities x 2 templates; each template 2 media of 1-2 images; every template pair
// (30 genuine, 1740 impostor: enough that FAR 1e-3, 1e-2 and 1e-1 are distinct points).
constexpr int kIjbIdentities = 30;
TinyIjb write_tiny_ijb(const std::string& root) {
  const SyntheticFaces faces(21);
  std::mt19937 g(5);
  std::uniform_real_distribution<double> u(0, 1);
  fs::create_directories(root + "/loose_crop");
  std::ostringstream lmk, tid, pairs;
  TinyIjb t;
  t.root = root;
  int image = 0, media = 100;
  for (int id = 0; id < kIjbIdentities; ++id)
    for (int tpl = 0; tpl < 2; ++tpl) {
      const int template_id = 10 * id + tpl + 1;
      for (int med = 0; med < 2; ++med, ++media)
        for (int k = 0; k < 1 + (id + tpl + med) % 2; ++k, ++image) {
          LooseCrop c = make_loose_crop(faces.view(uint64_t(id), uint64_t(image)), 1.2 + u(g), -20 + 40 * u(g),
                                        cv::Point2d(20 + 40 * u(g), 20 + 40 * u(g)), 220);
          const std::string name = std::to_string(image) + ".jpg";
          const auto bytes = encode_jpeg(c.image, 95);
          write_text(root + "/loose_crop/" + name, std::string(bytes.begin(), bytes.end()));
          lmk << name;
          lmk.precision(9);
          for (float v : c.landmarks) lmk << " " << v;
          lmk << " " << 0.5 + 0.5 * u(g) << "\n";
          tid << name << " " << template_id << " " << media << "\n";
          t.crops.push_back(std::move(c));
        }
    }
  for (int a = 0; a < 2 * kIjbIdentities; ++a)
    for (int b = a + 1; b < 2 * kIjbIdentities; ++b)
      pairs << 10 * (a / 2) + a % 2 + 1 << " " << 10 * (b / 2) + b % 2 + 1 << " " << int(a / 2 == b / 2) << "\n";
  write_meta(root, lmk.str(), tid.str(), pairs.str());
  return t;
}

TEST(EvalTools, IjbFollowsTheProtocolOnOneAndTwoRanks) {
  ASSERT_TRUE(fs::exists(std::string(FACESHARD_BIN_DIR) + "/faceshard-ijb")) << "faceshard-ijb missing from " << FACESHARD_BIN_DIR;
  const std::string dir = temp_dir("ijb");
  const TinyIjb ijb = write_tiny_ijb(dir + "/IJB");
  auto model = write_model(dir + "/model");
  auto r = run_tool("faceshard-ijb", "--model " + dir + "/model --root " + dir + "/IJB --target IJBC --device cpu --batch 5 " +
                                         "--output " + dir + "/out --image-features " + dir + "/feats.npy --json " + dir +
                                         "/one.json");
  ASSERT_EQ(r.status, 0) << r.output;
  // Fractions, as faceshard-verify prints them; FARs the 1740 negatives cannot measure in words.
  EXPECT_NE(r.output.find("IJBC  TAR@FAR: 1e-6 not enough pairs (1740 negatives, 1000000 needed)"), std::string::npos)
      << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("1e-3 0\\.\\d{4}  1e-2 0\\.\\d{4}  1e-1 [01]\\.\\d{4}"))) << r.output;
  // The per-image features are the flip-test embeddings of the aligned faces.
  const int64_t n = int64_t(ijb.crops.size());
  const at::Tensor feats = read_npy(dir + "/feats.npy", {n, 32});
  for (int64_t i : {int64_t(0), n / 2, n - 1}) {
    // The reference decodes the same file, aligns and embeds it (the tool batches images).
    const std::string file = dir + "/IJB/loose_crop/" + std::to_string(i) + ".jpg";
    const std::string bytes = read_text(file);
    const cv::Mat decoded = decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), file);
    const at::Tensor want = flip_embedding(*model, align_face(decoded, ijb.crops[size_t(i)].landmarks));
    EXPECT_LT(testing::relative_error(feats[i], want), 1e-4) << "image " << i;
  }
  auto py = run_python(dir, "ijb_ref.py", kIjbReference, {dir + "/IJB", dir + "/feats.npy", dir + "/out", dir + "/one.json"});
  EXPECT_EQ(py.status, 0) << py.output;
  EXPECT_TRUE(fs::exists(dir + "/out/IJBC_roc.csv"));
  EXPECT_EQ(read_text(dir + "/out/IJBC_roc.png").substr(1, 3), "PNG");
  // Two ranks split the images and give the same answer.
  r = testing::run_command(std::string(FACESHARD_SOURCE_DIR) + "/tools/launch.sh --nproc 2 -- " + FACESHARD_BIN_DIR +
                           "/faceshard-ijb --model " + dir + "/model --root " + dir + "/IJB --device cpu --batch 5 --output " +
                           dir + "/out2 --image-features " + dir + "/feats2.npy --json " + dir + "/two.json");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(torch::allclose(read_npy(dir + "/feats2.npy", {n, 32}), feats, 1e-4, 1e-5));
  py = run_python(dir, "ijb_ref.py", kIjbReference, {dir + "/IJB", dir + "/feats2.npy", dir + "/out2", dir + "/two.json"});
  EXPECT_EQ(py.status, 0) << py.output;
  // An --output that cannot be a folder (below a file) fails before any embedding too.
  r = run_tool("faceshard-ijb", "--model " + dir + "/model --root " + dir + "/IJB --device cpu --output " + dir +
                                    "/feats2.npy/out");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--output: cannot create"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("embeds images"), std::string::npos) << "checked before embedding:\n" << r.output;
  // Bad input: a missing crop names the file; exit status 2.
  fs::remove(dir + "/IJB/loose_crop/3.jpg");
  r = run_tool("faceshard-ijb", "--model " + dir + "/model --root " + dir + "/IJB --device cpu --output " + dir + "/out3");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("3.jpg: cannot open image"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("embeds images"), std::string::npos) << "checked before embedding:\n" << r.output;
  EXPECT_FALSE(fs::exists(dir + "/out3/IJBC_roc.csv"));
  r = run_tool("faceshard-ijb", "--model " + dir + "/model --root " + dir + "/nowhere");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("nowhere/meta/ijbc_name_5pts_score.txt"), std::string::npos) << r.output;
}

// ---------------------------------------------------------------------------------------
// Verification protocol (the trainer and faceshard-verify share evaluate_verification)

// verification.py's XNorm and flip-test scores recomputed in numpy from the two raw passes
// (the model run directly here): XNorm is the mean norm over the rows of both passes, the
// flip sum is taken in float64.
TEST(EvalVerification, XNormAndFlipSumFollowInsightfaceInNumpy) {
  const std::string dir = temp_dir("xnorm");
  auto model = write_model(dir + "/model", 16);
  torch::manual_seed(4);
  VerificationData data;
  data.name = "tiny";
  const int64_t pairs = 20;
  data.pixels = torch::rand({2 * pairs, 3, 112, 112}) * 2 - 1;
  for (int64_t i = 0; i < pairs; ++i) data.issame.push_back(i % 3 == 0);
  at::Tensor plain, mirrored;
  {
    torch::NoGradGuard ng;
    plain = model->forward(data.pixels);
    mirrored = model->forward(data.pixels.flip({3}));
  }
  const VerificationResult r = evaluate_verification(*model, data, 2 * pairs, torch::kCPU);
  std::ostringstream raw;
  raw.precision(9);
  for (const at::Tensor& t : {plain, mirrored})
    for (int64_t i = 0; i < t.numel(); ++i) raw << t.view(-1)[i].item<float>() << (i % 16 == 15 ? "\n" : " ");
  write_text(dir + "/raw.txt", raw.str());
  std::string same;
  for (bool b : data.issame) same += b ? "1\n" : "0\n";
  write_text(dir + "/issame.txt", same);
  const auto py = run_python(dir, "xnorm.py", R"PY(
import sys, numpy as np
raw = np.loadtxt(sys.argv[1] + '/raw.txt', dtype=np.float32)
issame = np.loadtxt(sys.argv[1] + '/issame.txt').astype(bool)
n = raw.shape[0] // 2
embeddings_list = [np.zeros((n, 16)), np.zeros((n, 16))]  # float64, as verification.py
embeddings_list[0][:] = raw[:n]
embeddings_list[1][:] = raw[n:]
xnorm, cnt = 0.0, 0
for embed in embeddings_list:
    for i in range(embed.shape[0]):
        xnorm += np.linalg.norm(embed[i]); cnt += 1
xnorm /= cnt
e = embeddings_list[0] + embeddings_list[1]
e = e / np.linalg.norm(e, axis=1, keepdims=True)
dist = np.sum((e[0::2] - e[1::2]) ** 2, axis=1)
score = 1 - dist / 2
print('%.17g' % xnorm)
print('%.17g' % score[~issame].mean())  # what a collapse warning reads: near 1 when collapsed
print(' '.join('%.17g' % x for x in np.unique(score)[::-1]))
)PY",
                             {dir});
  ASSERT_EQ(py.status, 0) << py.output;
  std::istringstream in(py.output);
  double xnorm = 0, negative_cosine = 0;
  in >> xnorm >> negative_cosine;
  EXPECT_NEAR(r.xnorm, xnorm, 1e-9 * xnorm);
  EXPECT_NEAR(r.negative_cosine, negative_cosine, 1e-12);
  // Not the norm of the summed embeddings (what an earlier version reported).
  EXPECT_GT(std::abs(r.xnorm - (plain + mirrored).norm(2, 1).mean().item<double>()), 0.1 * xnorm);
  // ROC thresholds are the distinct scores, descending, after +inf. At 1e-12 a flip sum
  // taken in float32 (errors ~1e-8) would not pass.
  std::vector<double> want;
  for (double v; in >> v;) want.push_back(v);
  ASSERT_EQ(r.roc.thresholds.size(), want.size() + 1);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(r.roc.thresholds[i + 1], want[i], 1e-12) << "score " << i;
}

// A protocol-2 pickle of (images, issame) as insightface writes it, built by hand so that
// images can be repeated through the pickle memo: `refs[i]` indexes `distinct`.
std::string memo_bin(const std::vector<std::vector<uint8_t>>& distinct, const std::vector<int>& refs) {
  std::string b("\x80\x02]q\x00(", 6);
  const auto u32 = [&](size_t v) {
    for (int k = 0; k < 4; ++k) b += char((v >> (8 * k)) & 0xff);
  };
  std::vector<bool> stored(distinct.size(), false);
  for (const int r : refs) {
    if (stored[size_t(r)]) {
      b += 'j';  // LONG_BINGET: memo slot r + 1 (slot 0 is the list)
      u32(size_t(r) + 1);
      continue;
    }
    const std::vector<uint8_t>& img = distinct[size_t(r)];
    b += 'B';
    u32(img.size());
    b.append(img.begin(), img.end());
    b += 'r';  // LONG_BINPUT
    u32(size_t(r) + 1);
    stored[size_t(r)] = true;
  }
  b += "e]r";
  u32(distinct.size() + 1);
  b += '(';
  for (size_t p = 0; p < refs.size() / 2; ++p) b += p % 2 ? '\x89' : '\x88';
  b += "e\x86.";
  return b;
}

int64_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

// A .bin is held as its encoded images (a repeated image is one buffer) and decoded a
// batch at a time: 9,000 references to small JPEGs (3,000 stored, each used 3 times) cost
// a few MB, not the 1.4 GB of their decoded floats. The per-batch decode gives the very
// embeddings of a whole decode.
TEST(EvalVerification, SetsHoldEncodedImagesAndDecodePerBatch) {
  const std::string dir = temp_dir("perbatch");
  const SyntheticFaces faces(5);
  const std::vector<uint8_t> tiny = encode_jpeg(cv::Mat(8, 8, CV_8UC3, cv::Scalar(40, 90, 200)), 90);
  std::vector<int> thrice;
  for (int i = 0; i < 9000; ++i) thrice.push_back(i / 3);
  write_text(dir + "/many.bin", memo_bin(std::vector<std::vector<uint8_t>>(3000, tiny), thrice));
  const int64_t before = resident_bytes();
  const VerificationData many = load_verification_data(dir + "/many.bin");
  const int64_t grown = resident_bytes() - before;
  EXPECT_LT(grown, int64_t(64) << 20) << grown;
  ASSERT_EQ(many.num_images(), 9000);
  EXPECT_FALSE(many.pixels.defined());
  EXPECT_TRUE(many.images[8997].shares(many.images[8999]));
  EXPECT_FALSE(many.images[0].shares(many.images[8999]));
  EXPECT_EQ(many.issame.size(), 4500u);

  // 24 distinct faces (one of them 150x150, resized) as 12 pairs; batches of 3.
  std::vector<std::vector<uint8_t>> distinct;
  std::vector<int> refs;
  for (int i = 0; i < 24; ++i) {
    distinct.push_back(faces.view_jpeg(uint64_t(i / 3), uint64_t(i)));
    refs.push_back(i);
  }
  cv::Mat big;
  cv::resize(decode_image(distinct[5].data(), distinct[5].size(), "5"), big, cv::Size(150, 150));
  distinct[5] = encode_jpeg(big, 90);
  write_text(dir + "/small.bin", memo_bin(distinct, refs));
  const VerificationData small = load_verification_data(dir + "/small.bin");
  EXPECT_EQ(small.name, "small");
  // The one 150x150 face is counted (and warned about); the 8x8 set is all of another size.
  EXPECT_EQ(small.other_size_images, 1);
  EXPECT_EQ(small.other_size, "150x150");
  EXPECT_EQ(many.other_size_images, 3000);  // distinct buffers, each referenced thrice
  EXPECT_EQ(many.other_size, "8x8");
  VerificationData whole;
  whole.pixels = torch::empty({24, 3, 112, 112});
  for (int i = 0; i < 24; ++i) {
    cv::Mat m = testing::cv2_imdecode(distinct[size_t(i)], testing::cv2::IMREAD_COLOR);
    if (m.rows != 112) cv::resize(m, m, cv::Size(112, 112), 0, 0, cv::INTER_LINEAR);
    bgr_to_normalized_chw(m, false, whole.pixels[i].data_ptr<float>());
  }
  whole.issame = small.issame;
  auto model = write_model(dir + "/model", 16);
  const VerificationResult a = evaluate_verification(*model, small, 3, torch::kCPU);
  const VerificationResult b = evaluate_verification(*model, whole, 24, torch::kCPU);
  EXPECT_NEAR(a.xnorm, b.xnorm, 1e-6 * b.xnorm);
  EXPECT_EQ(a.kfold.accuracy_mean, b.kfold.accuracy_mean);
  ASSERT_EQ(a.roc.thresholds.size(), b.roc.thresholds.size());
  for (size_t i = 1; i < a.roc.thresholds.size(); ++i) EXPECT_NEAR(a.roc.thresholds[i], b.roc.thresholds[i], 1e-6);
  EXPECT_TRUE(torch::allclose(embed_with_flip(*model, small, 5, torch::kCPU), embed_with_flip(*model, whole, 24, torch::kCPU),
                              1e-5, 1e-6));
}

// A bad image fails the load (before any model runs), naming the file, the pair and the
// image: truncated data, a decompression bomb, an image repeated after its first use.
TEST(EvalVerification, BadImagesNameTheFilePairAndImage) {
  const std::string dir = temp_dir("badbin");
  const SyntheticFaces faces(6);
  const std::vector<uint8_t> face = faces.view_jpeg(0, 0);
  std::vector<uint8_t> bomb = face;
  for (size_t i = 2; i + 8 < bomb.size();) {  // SOF0 -> 30000 x 30000
    const size_t len = size_t(bomb[i + 2]) << 8 | bomb[i + 3];
    if (bomb[i + 1] == 0xC0) {
      bomb[i + 5] = bomb[i + 7] = 0x75;
      bomb[i + 6] = bomb[i + 8] = 0x30;
      break;
    }
    i += 2 + len;
  }
  const std::vector<uint8_t> cut(face.begin(), face.begin() + long(face.size() / 3));
  const std::vector<std::tuple<std::vector<int>, std::string>> cases = {
      {{0, 0, 0, 0, 0, 0, 0, 1}, "t.bin: pair 3, image 7: JPEG data ends before the image does (truncated)"},
      {{0, 2, 0, 0, 0, 0, 2, 0}, "t.bin: pair 0, image 1: JPEG header declares a 30000x30000 image"},
      {{0, 0, 1, 0, 0, 1, 0, 0}, "t.bin: pair 1, image 2: JPEG data ends"},
  };
  for (const auto& [refs, expect] : cases) {
    write_text(dir + "/t.bin", memo_bin({face, cut, bomb}, refs));
    const std::string msg = error_of([&] { load_verification_data(dir + "/t.bin"); });
    EXPECT_NE(msg.find(expect), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// ---------------------------------------------------------------------------------------
// faceshard-extract

// A set of fewer pairs than the default 10 folds runs with the folds asked for; fewer pairs
// than folds, no pairs or pairs of one kind end with an error naming the file.
TEST(EvalVerification, SmallSetsTakeTheFoldsAskedForAndBadSetsNameTheirFile) {
  const std::string dir = temp_dir("smallsets");
  auto model = write_model(dir + "/model", 16);
  torch::manual_seed(5);
  VerificationData data;
  data.name = "eight";
  data.pixels = torch::rand({16, 3, 112, 112}) * 2 - 1;
  for (int64_t i = 0; i < 8; ++i) data.issame.push_back(i % 2 == 0);
  const VerificationResult two = evaluate_verification(*model, data, 16, torch::kCPU, 2);
  EXPECT_EQ(two.kfold.fold_accuracy.size(), 2u);
  EXPECT_EQ(evaluate_verification(*model, data, 16, torch::kCPU, 8).kfold.fold_accuracy.size(), 8u);
  std::string e = error_of([&] { evaluate_verification(*model, data, 16, torch::kCPU); });
  EXPECT_NE(e.find("verification set 'eight': 8 pairs, fewer than the 10 folds"), std::string::npos) << e;
  data.path = dir + "/eight.bin";
  e = error_of([&] { check_verification_folds(data, 9); });
  EXPECT_NE(e.find(dir + "/eight.bin: 8 pairs, fewer than the 9 folds of the protocol (faceshard-verify --folds K takes "
                         "K <= 8)"),
            std::string::npos)
      << e;
  // Sets checked when they are read (their images are not decoded first).
  write_verification_bin(dir + "/empty.bin", VerificationSet{});
  e = error_of([&] { load_verification_data(dir + "/empty.bin"); });
  EXPECT_EQ(e, dir + "/empty.bin: the verification set has no pairs");
  VerificationSet same;
  for (int i = 0; i < 6; ++i) same.images.push_back(std::vector<uint8_t>{1, 2, 3});
  same.issame = {true, true, true};
  write_verification_bin(dir + "/same.bin", same);
  e = error_of([&] { load_verification_data(dir + "/same.bin"); });
  EXPECT_EQ(e, dir + "/same.bin: 3 pairs, all genuine; the protocol needs genuine and impostor pairs");
}

TEST(EvalTools, ExtractWritesNpyThatNumpyLoadsAndTheNames) {
  ASSERT_TRUE(fs::exists(std::string(FACESHARD_BIN_DIR) + "/faceshard-extract")) << "faceshard-extract missing from " << FACESHARD_BIN_DIR;
  const std::string dir = temp_dir("extract");
  auto model = write_model(dir + "/model", 24);
  const SyntheticFaces faces(4);
  fs::create_directories(dir + "/imgs/sub");
  std::vector<std::string> names = {"a.jpg", "sub/b.jpg", "c.jpg", "d.jpg", "e.jpg"};
  std::vector<at::Tensor> want;
  for (size_t i = 0; i < names.size(); ++i) {
    const auto bytes = encode_jpeg(faces.view(i, i), 95);
    write_text(dir + "/imgs/" + names[i], std::string(bytes.begin(), bytes.end()));
    const at::Tensor e = flip_embedding(*model, decode_image(bytes.data(), bytes.size(), names[i]));
    want.push_back(e / e.norm());
  }
  write_text(dir + "/imgs/list.txt", "# images\na.jpg 0\nsub/b.jpg\n\nc.jpg\td\nd.jpg\ne.jpg\n");
  auto r = run_tool("faceshard-extract", "--model " + dir + "/model/model.pt --list " + dir + "/imgs/list.txt --device cpu " +
                                             "--batch 2 --output " + dir + "/emb");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_text(dir + "/emb.txt"), "a.jpg\nsub/b.jpg\nc.jpg\nd.jpg\ne.jpg\n");
  const at::Tensor got = read_npy(dir + "/emb.npy", {5, 24});
  EXPECT_TRUE(torch::allclose(got, torch::stack(want), 1e-4, 1e-5)) << got - torch::stack(want);
  std::ostringstream expect;
  expect.precision(9);
  for (int64_t i = 0; i < got.numel(); ++i) expect << torch::stack(want).view(-1)[i].item<float>() << " ";
  write_text(dir + "/expect.txt", expect.str());
  const auto py = run_python(dir, "emb.py", R"PY(
import sys, numpy as np
d = sys.argv[1]
e = np.load(d + '/emb.npy')
assert e.dtype == np.float32 and e.shape == (5, 24), (e.dtype, e.shape)
assert np.allclose(np.linalg.norm(e, axis=1), 1, atol=1e-5)
w = np.array(open(d + '/expect.txt').read().split(), dtype=np.float32).reshape(5, 24)
assert np.allclose(e, w, atol=1e-4), np.abs(e - w).max()
names = open(d + '/emb.txt').read().split()
assert names == ['a.jpg', 'sub/b.jpg', 'c.jpg', 'd.jpg', 'e.jpg'], names
print('ok')
)PY",
                             {dir});
  EXPECT_EQ(py.status, 0) << py.output;
  // A folder: sorted relative paths, the same embeddings.
  r = run_tool("faceshard-extract", "--model " + dir + "/model --images " + dir + "/imgs --device cpu --output " + dir + "/f");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_text(dir + "/f.txt"), "a.jpg\nc.jpg\nd.jpg\ne.jpg\nsub/b.jpg\n");
  // Raw (not normalised, no flip) embeddings.
  r = run_tool("faceshard-extract", "--model " + dir + "/model --list " + dir + "/imgs/list.txt --no-flip --no-normalize " +
                                         "--device cpu --output " + dir + "/raw");
  ASSERT_EQ(r.status, 0) << r.output;
  {
    at::Tensor x = torch::empty({1, 3, 112, 112});
    const std::string b = read_text(dir + "/imgs/a.jpg");
    bgr_to_normalized_chw(decode_image(reinterpret_cast<const uint8_t*>(b.data()), b.size(), "a"), false, x.data_ptr<float>());
    torch::NoGradGuard ng;
    EXPECT_TRUE(torch::allclose(read_npy(dir + "/raw.npy", {5, 24})[0], model->forward(x)[0], 1e-4, 1e-5));
  }
  // A .rec: names "<index> <label>", in record order.
  SynthDatasetSpec spec;
  spec.identities = 3;
  spec.images_per_identity = 2;
  spec.pairs = 0;
  spec.seed = 2;
  write_synthetic_dataset(dir + "/rec", spec);
  r = run_tool("faceshard-extract", "--model " + dir + "/model --rec " + dir + "/rec --device cpu --batch 4 --output " + dir + "/r");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(read_text(dir + "/r.txt"), "0 0\n1 0\n2 1\n3 1\n4 2\n5 2\n");
  {
    const SyntheticFaces gen(spec.seed, spec.face);
    const auto bytes = gen.view_jpeg(2, 1);  // record 5: identity 2, view 1
    const at::Tensor e = flip_embedding(*model, decode_image(bytes.data(), bytes.size(), "record 5"));
    EXPECT_TRUE(torch::allclose(read_npy(dir + "/r.npy", {6, 24})[5], e / e.norm(), 1e-4, 1e-5));
  }
  // Bad input: one line, exit 2, earlier outputs kept.
  write_text(dir + "/imgs/bad.txt", "a.jpg\nmissing.jpg\n");
  r = run_tool("faceshard-extract", "--model " + dir + "/model --list " + dir + "/imgs/bad.txt --device cpu --output " + dir + "/emb");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("bad.txt:2: image"), std::string::npos) << r.output;
  EXPECT_EQ(read_text(dir + "/emb.txt"), "a.jpg\nsub/b.jpg\nc.jpg\nd.jpg\ne.jpg\n");
  r = run_tool("faceshard-extract", "--model " + dir + "/model --list a --rec b --output " + dir + "/x");
  EXPECT_EQ(r.status, 2) << r.output;
  r = run_tool("faceshard-extract", "--model " + dir + "/model/model.pt --network r50 --list " + dir +
                                         "/imgs/list.txt --device cpu --output " + dir + "/x");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/x.npy"));
}

// Model resolution: export folder, weights file with metadata, bare state_dict with
// --network, and clear errors.
TEST(EvalModel, ResolvesExportsWeightsAndReportsMissingMetadata) {
  const std::string dir = temp_dir("model");
  auto model = write_model(dir + "/export", 16);
  const at::Tensor x = torch::randn({2, 3, 112, 112});
  torch::NoGradGuard ng;
  const at::Tensor want = model->forward(x);
  for (const std::string& p : {dir + "/export", dir + "/export/model.pt"}) {
    ModelSpec s;
    s.path = p;
    InferenceModel m = load_inference_model(s, torch::kCPU);
    EXPECT_TRUE(torch::allclose(m.backbone->forward(x), want, 1e-5, 1e-6)) << p;
  }
  // The training precision in the metadata is the default; --precision overrides it.
  write_text(dir + "/export/model.json", "{\"backbone\": \"mbf\", \"embedding_size\": 16, \"precision\": \"bf16\"}\n");
  {
    ModelSpec p;
    p.path = dir + "/export";
    EXPECT_EQ(load_inference_model(p, torch::kCPU).backbone->options().precision, BodyPrecision::BFloat16);
    p.precision = "fp32";
    EXPECT_EQ(load_inference_model(p, torch::kCPU).backbone->options().precision, BodyPrecision::Float32);
    p.precision = "fp8";
    EXPECT_NE(error_of([&] { load_inference_model(p, torch::kCPU); }).find("fp8"), std::string::npos);
  }
  fs::create_directories(dir + "/bare");
  fs::copy_file(dir + "/export/model.pt", dir + "/bare/backbone.pth");
  ModelSpec s;
  s.path = dir + "/bare/backbone.pth";
  EXPECT_NE(error_of([&] { load_inference_model(s, torch::kCPU); }).find("--network"), std::string::npos);
  s.network = "mbf";
  s.embedding_size = 16;
  EXPECT_TRUE(torch::allclose(load_inference_model(s, torch::kCPU).backbone->forward(x), want, 1e-5, 1e-6));
  // A run folder without an export: its newest committed checkpoint, the backbone named by
  // the run's config.yaml; an uncommitted newer step is passed over.
  const std::string run = dir + "/run";
  for (int step : {4, 8, 12}) fs::create_directories(run + "/checkpoints/step_" + std::to_string(step));
  write_text(run + "/config.yaml", "output: run\nmodel:\n  backbone: mbf\n  embedding_size: 16\n");
  write_text(run + "/checkpoints/step_4/COMMITTED", "step 4\nworld_size 2\nnum_classes 10\n");
  write_text(run + "/checkpoints/step_8/COMMITTED", "step 8\nworld_size 2\nnum_classes 10\n");
  fs::copy_file(dir + "/export/model.pt", run + "/checkpoints/step_8/backbone.pt");
  write_text(run + "/checkpoints/step_4/backbone.pt", "not a checkpoint");
  write_text(run + "/checkpoints/step_12/backbone.pt", "not a checkpoint");
  ModelSpec r;
  r.path = run;
  InferenceModel from_run = load_inference_model(r, torch::kCPU);
  EXPECT_EQ(from_run.weights, run + "/checkpoints/step_8/backbone.pt");
  EXPECT_TRUE(torch::allclose(from_run.backbone->forward(x), want, 1e-5, 1e-6));
  r.path = run + "/checkpoints/step_12";
  EXPECT_NE(error_of([&] { load_inference_model(r, torch::kCPU); }).find("not committed"), std::string::npos);
  s.path = dir + "/nothing";
  EXPECT_NE(error_of([&] { load_inference_model(s, torch::kCPU); }).find("does not exist"), std::string::npos);
  s.path = dir;
  EXPECT_NE(error_of([&] { load_inference_model(s, torch::kCPU); }).find("not a faceshard run"), std::string::npos);
}

}  // namespace
}  // namespace faceshard
