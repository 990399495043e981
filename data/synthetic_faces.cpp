#include "data/synthetic_faces.h"

#include <cmath>
#include <filesystem>
#include <random>

#include <opencv2/imgproc.hpp>

#include "data/image_transform.h"
#include "data/insightface_rec.h"
#include "data/verification_bin.h"
#include "partial_fc/error.h"

namespace faceshard {

namespace {

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct Rng {
  explicit Rng(uint64_t s) : g(s) {}
  double uni(double a, double b) { return a + (b - a) * (double(g() >> 11) * (1.0 / 9007199254740992.0)); }
  int integer(int a, int b) { return a + int(g() % uint64_t(b - a + 1)); }
  cv::Scalar color(int lo, int hi) { return cv::Scalar(integer(lo, hi), integer(lo, hi), integer(lo, hi)); }
  std::mt19937_64 g;
};

}  // namespace

SyntheticFaces::SyntheticFaces(uint64_t seed, SynthFaceOptions options) : seed_(seed), opt_(options) {
  if (opt_.image_size < 16) throw usage_error("synthetic faces: image size must be at least 16");
}

cv::Mat SyntheticFaces::identity_image(uint64_t identity) const {
  // Everything is drawn in a 112-px frame and scaled, so faces look alike at any size.
  Rng r(mix(mix(seed_) ^ mix(identity + 1)));
  const int S = 112;
  cv::Mat img(S, S, CV_8UC3);
  // Background: a vertical gradient between two identity colours.
  const cv::Scalar bg0 = r.color(20, 235), bg1 = r.color(20, 235);
  for (int y = 0; y < S; ++y) {
    const double t = double(y) / (S - 1);
    img.row(y).setTo(bg0 * (1 - t) + bg1 * t);
  }
  const cv::Point2d c(56 + r.uni(-4, 4), 60 + r.uni(-4, 4));
  const cv::Size face(int(r.uni(28, 38)), int(r.uni(36, 46)));
  const cv::Scalar skin(r.integer(60, 200), r.integer(90, 210), r.integer(120, 240));
  const cv::Scalar hair = r.color(0, 120);
  // Hair: a cap over the top of the face, its height and parting identity-specific.
  cv::ellipse(img, c - cv::Point2d(0, r.uni(6, 14)), face + cv::Size(int(r.uni(2, 8)), int(r.uni(0, 6))),
              r.uni(-10, 10), 180, 360, hair, cv::FILLED, cv::LINE_AA);
  cv::ellipse(img, c, face, 0, 0, 360, skin, cv::FILLED, cv::LINE_AA);
  // A few identity marks (freckles, patches) on the face.
  const int marks = r.integer(2, 5);
  for (int i = 0; i < marks; ++i) {
    const cv::Point p(int(c.x + r.uni(-0.6, 0.6) * face.width), int(c.y + r.uni(-0.5, 0.7) * face.height));
    cv::circle(img, p, r.integer(2, 6), skin * r.uni(0.6, 0.9) + r.color(0, 40), cv::FILLED, cv::LINE_AA);
  }
  // Eyes and brows.
  const double eye_y = c.y - r.uni(4, 12), eye_dx = r.uni(11, 17);
  const cv::Size eye(int(r.uni(4, 8)), int(r.uni(2, 5)));
  const cv::Scalar iris = r.color(0, 160);
  const double brow_tilt = r.uni(-15, 15), brow_up = r.uni(6, 11);
  const int brow_w = r.integer(1, 4);
  for (int side = -1; side <= 1; side += 2) {
    const cv::Point2d e(c.x + side * eye_dx, eye_y);
    cv::ellipse(img, e, eye, 0, 0, 360, cv::Scalar(245, 245, 245), cv::FILLED, cv::LINE_AA);
    cv::circle(img, e, std::max(2, eye.height), iris, cv::FILLED, cv::LINE_AA);
    cv::ellipse(img, e - cv::Point2d(0, brow_up), cv::Size(eye.width + 2, 3), side * brow_tilt, 200, 340, hair,
                brow_w, cv::LINE_AA);
  }
  // Nose and mouth.
  const double nose_len = r.uni(8, 16);
  cv::line(img, cv::Point2d(c.x, eye_y + 3), cv::Point2d(c.x + r.uni(-3, 3), eye_y + 3 + nose_len),
           skin * 0.6, 2, cv::LINE_AA);
  const double mouth_y = eye_y + nose_len + r.uni(9, 15);
  const cv::Scalar lips(r.integer(40, 120), r.integer(30, 90), r.integer(120, 230));
  cv::ellipse(img, cv::Point2d(c.x, mouth_y), cv::Size(int(r.uni(7, 15)), int(r.uni(2, 6))), 0,
              r.uni(0, 1) < 0.5 ? 0 : 180, r.uni(0, 1) < 0.5 ? 180 : 360, lips, cv::FILLED, cv::LINE_AA);
  if (opt_.image_size != S) cv::resize(img, img, cv::Size(opt_.image_size, opt_.image_size), 0, 0, cv::INTER_AREA);
  return img;
}

cv::Mat SyntheticFaces::view(uint64_t identity, uint64_t view) const {
  const cv::Mat base = identity_image(identity);
  Rng r(mix(mix(seed_ ^ 0xfacefaceull) ^ mix(identity + 1) ^ mix(mix(view + 7))));
  const int S = opt_.image_size;
  const double k = S / 112.0;
  cv::Mat m = cv::getRotationMatrix2D(cv::Point2f(S / 2.f, S / 2.f), r.uni(-opt_.max_rotation, opt_.max_rotation),
                                      1.0 + r.uni(-opt_.max_scale, opt_.max_scale));
  m.at<double>(0, 2) += r.uni(-opt_.max_shift, opt_.max_shift) * k;
  m.at<double>(1, 2) += r.uni(-opt_.max_shift, opt_.max_shift) * k;
  cv::Mat out;
  cv::warpAffine(base, out, m, base.size(), cv::INTER_LINEAR, cv::BORDER_REPLICATE);
  const double gain = 1.0 + r.uni(-opt_.max_brightness, opt_.max_brightness);
  const double offset = 255.0 * r.uni(-opt_.max_brightness, opt_.max_brightness) * 0.5;
  if (opt_.noise_std > 0) {
    cv::Mat noise(out.size(), CV_32FC3);
    cv::RNG cvr(r.g());
    cvr.fill(noise, cv::RNG::NORMAL, 0.0, opt_.noise_std);
    cv::Mat f;
    out.convertTo(f, CV_32FC3, gain, offset);
    f += noise;
    f.convertTo(out, CV_8UC3);  // saturates to [0, 255]
  } else {
    out.convertTo(out, CV_8UC3, gain, offset);
  }
  if (r.uni(0, 1) < opt_.blur_prob) cv::GaussianBlur(out, out, cv::Size(3, 3), r.uni(0.4, 1.1));
  return out;
}

std::vector<uint8_t> SyntheticFaces::view_jpeg(uint64_t identity, uint64_t v) const {
  return encode_jpeg(view(identity, v), opt_.jpeg_quality);
}

void write_synthetic_dataset(const std::string& out_dir, const SynthDatasetSpec& spec) {
  if (spec.identities == 0 || spec.images_per_identity == 0) {
    throw usage_error("synthetic data set: identities and images per identity must be positive");
  }
  if (spec.pairs > 0 && spec.holdout_identities < 2) {
    throw usage_error("synthetic data set: verification pairs need at least 2 held-out identities");
  }
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) throw usage_error(out_dir, ": cannot create directory: ", ec.message());
  const SyntheticFaces faces(spec.seed, spec.face);
  {
    InsightFaceRecWriter w(out_dir + "/train.rec", out_dir + "/train.idx");
    for (uint64_t id = 0; id < spec.identities; ++id) {
      for (uint64_t v = 0; v < spec.images_per_identity; ++v) w.add(int64_t(id), faces.view_jpeg(id, v));
    }
    w.commit(int64_t(spec.identities));
  }
  if (spec.pairs == 0) return;
  // Held-out identities are generator ids after the training ones; their views use
  // view numbers the training set never drew.
  VerificationSet set;
  Rng r(mix(spec.seed ^ 0xb1b1b1ull));
  const uint64_t first = spec.identities, h = spec.holdout_identities;
  for (uint64_t p = 0; p < spec.pairs; ++p) {
    const bool same = (p % 2) == 0;
    const uint64_t a = first + r.g() % h;
    uint64_t b = a;
    if (!same) {
      b = first + r.g() % (h - 1);
      if (b >= a) ++b;
    }
    set.images.push_back(faces.view_jpeg(a, 1000000 + 2 * p));
    set.images.push_back(faces.view_jpeg(b, 1000000 + 2 * p + 1));
    set.issame.push_back(same);
  }
  write_verification_bin(out_dir + "/" + spec.bin_name + ".bin", set);
}

}  // namespace faceshard
