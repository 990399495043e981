#include "data/synthetic_faces.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>

#include <opencv2/imgproc.hpp>

#include "data/seed_mix.h"
#include "data/image_encode.h"
#include "data/image_transform.h"
#include "data/insightface_rec.h"
#include "data/verification_bin.h"
#include "base/error.h"

namespace faceshard {

namespace {


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
  if (opt_.family_size < 1) throw usage_error("synthetic faces: family size must be at least 1");
}

void SyntheticFaces::draw_face(uint64_t identity, cv::Mat& img) const {
  // Colours come from the identity's family, the geometry from the identity itself, so
  // siblings look alike to a colour histogram and differ in shape only.
  const uint64_t family = identity / uint64_t(opt_.family_size);
  Rng f(seed_mix(seed_mix(seed_ ^ 0xfa3117ull) ^ seed_mix(family + 1)));
  const cv::Scalar skin(f.integer(60, 200), f.integer(90, 210), f.integer(120, 240));
  const cv::Scalar hair = f.color(0, 120);
  const cv::Scalar iris = f.color(0, 160);
  const cv::Scalar lips(f.integer(40, 120), f.integer(30, 90), f.integer(120, 230));
  const double face_w = f.uni(29, 36), face_h = f.uni(37, 44);

  Rng r(seed_mix(seed_mix(seed_) ^ seed_mix(identity + 1)));
  const cv::Point2d c(56 + r.uni(-3, 3), 60 + r.uni(-3, 3));
  const cv::Size face(int(face_w + r.uni(-3, 3)), int(face_h + r.uni(-3, 3)));
  // Hair: a cap over the top of the face, its height, width and tilt identity-specific.
  cv::ellipse(img, c - cv::Point2d(0, r.uni(6, 14)), face + cv::Size(int(r.uni(2, 8)), int(r.uni(0, 6))),
              r.uni(-12, 12), 180, 360, hair, cv::FILLED, cv::LINE_AA);
  cv::ellipse(img, c, face, 0, 0, 360, skin, cv::FILLED, cv::LINE_AA);
  // A few identity marks (freckles, patches) on the face.
  const int marks = r.integer(1, 4);
  for (int i = 0; i < marks; ++i) {
    const cv::Point p(int(c.x + r.uni(-0.6, 0.6) * face.width), int(c.y + r.uni(-0.5, 0.7) * face.height));
    cv::circle(img, p, r.integer(3, 7), skin * r.uni(0.4, 0.7), cv::FILLED, cv::LINE_AA);
  }
  // A beard or moustache for some identities, in the family's hair colour.
  const double beard = r.uni(0, 1);
  if (beard < 0.25)
    cv::ellipse(img, c + cv::Point2d(0, face.height * 0.55), cv::Size(int(face.width * r.uni(0.5, 0.9)), int(face.height * 0.4)),
                0, 0, 180, hair, cv::FILLED, cv::LINE_AA);
  else if (beard < 0.5)
    cv::ellipse(img, c + cv::Point2d(0, face.height * 0.32), cv::Size(int(r.uni(8, 14)), int(r.uni(2, 4))), 0, 180, 360,
                hair, cv::FILLED, cv::LINE_AA);
  // Eyes and brows.
  const double eye_y = c.y - r.uni(3, 14), eye_dx = r.uni(9, 19);
  const cv::Size eye(int(r.uni(3, 10)), int(r.uni(2, 6)));
  const bool glasses = r.uni(0, 1) < 0.3;
  const double brow_tilt = r.uni(-18, 18), brow_up = r.uni(6, 11);
  const int brow_w = r.integer(1, 4);
  for (int side = -1; side <= 1; side += 2) {
    const cv::Point2d e(c.x + side * eye_dx, eye_y);
    cv::ellipse(img, e, eye, 0, 0, 360, cv::Scalar(245, 245, 245), cv::FILLED, cv::LINE_AA);
    cv::circle(img, e, std::max(2, eye.height), iris, cv::FILLED, cv::LINE_AA);
    cv::ellipse(img, e - cv::Point2d(0, brow_up), cv::Size(eye.width + 2, 3), side * brow_tilt, 200, 340, hair,
                brow_w, cv::LINE_AA);
    if (glasses) cv::circle(img, e, eye.width + 4, hair, 2, cv::LINE_AA);
  }
  // Nose and mouth.
  const double nose_len = r.uni(7, 17);
  cv::line(img, cv::Point2d(c.x, eye_y + 3), cv::Point2d(c.x + r.uni(-4, 4), eye_y + 3 + nose_len), skin * 0.6, 2,
           cv::LINE_AA);
  const double mouth_y = eye_y + nose_len + r.uni(8, 15);
  cv::ellipse(img, cv::Point2d(c.x + r.uni(-3, 3), mouth_y), cv::Size(int(r.uni(6, 15)), int(r.uni(2, 6))), 0,
              r.uni(0, 1) < 0.5 ? 0 : 180, r.uni(0, 1) < 0.5 ? 180 : 360, lips, cv::FILLED, cv::LINE_AA);
}

cv::Mat SyntheticFaces::identity_image(uint64_t identity) const {
  cv::Mat img(112, 112, CV_8UC3, cv::Scalar(128, 128, 128));
  draw_face(identity, img);
  if (opt_.image_size != 112) cv::resize(img, img, cv::Size(opt_.image_size, opt_.image_size), 0, 0, cv::INTER_AREA);
  return img;
}

cv::Mat SyntheticFaces::view(uint64_t identity, uint64_t view) const {
  // Everything is drawn in a 112-px frame and scaled, so faces look alike at any size.
  Rng r(seed_mix(seed_mix(seed_ ^ 0xfacefaceull) ^ seed_mix(identity + 1) ^ seed_mix(seed_mix(view + 7))));
  const int S = 112;
  // A background of this view only: a gradient between two colours and a few blobs.
  cv::Mat img(S, S, CV_8UC3);
  const cv::Scalar bg0 = r.color(20, 235), bg1 = r.color(20, 235);
  const bool vertical = r.uni(0, 1) < 0.5;
  for (int i = 0; i < S; ++i) {
    const double t = double(i) / (S - 1);
    (vertical ? img.row(i) : img.col(i)).setTo(bg0 * (1 - t) + bg1 * t);
  }
  const int blobs = r.integer(1, 4);
  for (int i = 0; i < blobs; ++i)
    cv::ellipse(img, cv::Point2d(r.uni(0, S), r.uni(0, S)), cv::Size(int(r.uni(6, 30)), int(r.uni(6, 30))),
                r.uni(0, 180), 0, 360, r.color(20, 235), cv::FILLED, cv::LINE_AA);
  draw_face(identity, img);
  cv::Mat m = cv::getRotationMatrix2D(cv::Point2f(S / 2.f, S / 2.f), r.uni(-opt_.max_rotation, opt_.max_rotation),
                                      1.0 + r.uni(-opt_.max_scale, opt_.max_scale));
  m.at<double>(0, 2) += r.uni(-opt_.max_shift, opt_.max_shift);
  m.at<double>(1, 2) += r.uni(-opt_.max_shift, opt_.max_shift);
  cv::Mat out;
  cv::warpAffine(img, out, m, img.size(), cv::INTER_LINEAR, cv::BORDER_REPLICATE);
  if (opt_.image_size != S) cv::resize(out, out, cv::Size(opt_.image_size, opt_.image_size), 0, 0, cv::INTER_AREA);
  // Light: a global gain and offset, and a colour cast (a gain per channel).
  const double gain = 1.0 + r.uni(-opt_.max_brightness, opt_.max_brightness);
  const double offset = 255.0 * r.uni(-opt_.max_brightness, opt_.max_brightness) * 0.5;
  cv::Mat f;
  out.convertTo(f, CV_32FC3, gain, offset);
  const double cast = opt_.max_color_cast;
  cv::multiply(f, cv::Scalar(1 + r.uni(-cast, cast), 1 + r.uni(-cast, cast), 1 + r.uni(-cast, cast)), f);
  if (opt_.noise_std > 0) {
    cv::Mat noise(out.size(), CV_32FC3);
    cv::RNG cvr(r.g());
    cvr.fill(noise, cv::RNG::NORMAL, 0.0, opt_.noise_std);
    f += noise;
  }
  f.convertTo(out, CV_8UC3);  // saturates to [0, 255]
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
  // Held-out identities are generator ids after the training ones, starting at a family
  // boundary; their views use view numbers the training set never drew. A different pair
  // is two siblings (one family) whenever the family has two held-out members.
  VerificationSet set;
  Rng r(seed_mix(spec.seed ^ 0xb1b1b1ull));
  const uint64_t fam = uint64_t(spec.face.family_size);
  const uint64_t first = (spec.identities + fam - 1) / fam * fam, h = spec.holdout_identities;
  for (uint64_t p = 0; p < spec.pairs; ++p) {
    const bool same = (p % 2) == 0;
    const uint64_t a = first + r.g() % h;
    uint64_t b = a;
    if (!same) {
      const uint64_t lo = std::max(first, a / fam * fam), hi = std::min(first + h, a / fam * fam + fam);
      if (hi - lo >= 2) {
        b = lo + r.g() % (hi - lo - 1);
      } else {
        b = first + r.g() % (h - 1);
      }
      if (b >= a) ++b;
    }
    set.images.push_back(faces.view_jpeg(a, 1000000 + 2 * p));
    set.images.push_back(faces.view_jpeg(b, 1000000 + 2 * p + 1));
    set.issame.push_back(same);
  }
  write_verification_bin(out_dir + "/" + spec.bin_name + ".bin", set);
}

}  // namespace faceshard
