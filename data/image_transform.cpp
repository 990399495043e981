#include "data/image_transform.h"

#include <array>

#include <opencv2/core.hpp>
#include <opencv2/imgproc.hpp>

#include "data/image_codec.h"
#include "base/error.h"

namespace faceshard {

cv::Mat decode_image(const uint8_t* data, size_t size, const std::string& where) {
  return decode_image(data, size, read_image_header(data, size, where), where);
}

cv::Mat decode_image(const uint8_t* data, size_t size, const EncodedImageHeader& header, const std::string& where) {
  cv::Mat img(int(header.height), int(header.width), CV_8UC3);
  decode_to_bgr(data, size, header, img.data, img.step[0], where);
  // The EXIF orientation, applied as cv::imdecode applies it.
  switch (header.orientation) {
    case 2: cv::flip(img, img, 1); break;
    case 3: cv::flip(img, img, -1); break;
    case 4: cv::flip(img, img, 0); break;
    case 5: cv::transpose(img, img); break;
    case 6: cv::transpose(img, img); cv::flip(img, img, 1); break;
    case 7: cv::transpose(img, img); cv::flip(img, img, -1); break;
    case 8: cv::transpose(img, img); cv::flip(img, img, 0); break;
    default: break;
  }
  return img;
}

void bgr_to_normalized_chw(const cv::Mat& bgr, bool flip, float* dst) {
  const int h = bgr.rows, w = bgr.cols;
  const size_t plane = size_t(h) * w;
  float* r = dst;
  float* g = dst + plane;
  float* b = dst + 2 * plane;
  // (x/255 - 0.5)/0.5 == x/127.5 - 1; a table keeps the per-pixel cost to three loads.
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = (float(i) / 255.f - 0.5f) / 0.5f;
    return t;
  }();
  for (int y = 0; y < h; ++y) {
    const uint8_t* row = bgr.ptr<uint8_t>(y);
    const size_t o = size_t(y) * w;
    for (int x = 0; x < w; ++x) {
      const uint8_t* px = row + 3 * (flip ? w - 1 - x : x);
      b[o + x] = table[px[0]];
      g[o + x] = table[px[1]];
      r[o + x] = table[px[2]];
    }
  }
}

void rgb_to_normalized_chw(const uint8_t* rgb, int height, int width, bool flip, float* dst) {
  // Same loop with R and B swapped: view the RGB buffer as a "BGR" Mat and exchange planes.
  const cv::Mat m(height, width, CV_8UC3, const_cast<uint8_t*>(rgb));
  const size_t plane = size_t(height) * width;
  bgr_to_normalized_chw(m, flip, dst);
  for (size_t i = 0; i < plane; ++i) std::swap(dst[i], dst[2 * plane + i]);
}

void apply_extra_augment(cv::Mat& bgr, const ExtraAugment& aug, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  if (aug.downscale_prob > 0 && u(rng) < aug.downscale_prob) {
    const double scale = 0.5 + 0.3 * u(rng);  // DALI extra: 56..89.6 px of 112
    cv::Mat small;
    cv::resize(bgr, small, cv::Size(), scale, scale, cv::INTER_AREA);
    cv::resize(small, bgr, bgr.size(), 0, 0, cv::INTER_LINEAR);
  }
  if (aug.blur_prob > 0 && u(rng) < aug.blur_prob) {
    cv::GaussianBlur(bgr, bgr, cv::Size(5, 5), 0.5 + 1.0 * u(rng));
  }
  if (aug.gray_prob > 0 && u(rng) < aug.gray_prob) {
    cv::Mat gray;
    cv::cvtColor(bgr, gray, cv::COLOR_BGR2GRAY);
    cv::cvtColor(gray, bgr, cv::COLOR_GRAY2BGR);
  }
}

}  // namespace faceshard
