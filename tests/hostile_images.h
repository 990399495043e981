// Small encoded images for the decoder tests: valid ones written by OpenCV (Python's cv2), and the
// hostile kinds made from them: headers that declare a huge image (decompression bombs),
// truncated and corrupted data, an EXIF orientation block.
#pragma once
#include <zlib.h>

#include <cstdint>
#include <string>
#include <vector>

#include <opencv2/core.hpp>

#include "tests/cv2_reference.h"

namespace faceshard::testing {

inline std::vector<uint8_t> encode(const char* ext, const cv::Mat& m, const std::vector<int>& params = {}) {
  return cv2_imencode(ext, m, params);
}

inline cv::Mat noise_image(int width, int height, int type = CV_8UC3, uint64_t seed = 1) {
  cv::Mat m(height, width, type);
  cv::RNG rng(seed);
  rng.fill(m, cv::RNG::UNIFORM, 0, CV_MAT_DEPTH(type) == CV_16U ? 65536 : 256);
  return m;
}

// A JPEG whose frame header (SOF) is rewritten to declare width x height; the data stays
// that of the original image.
inline std::vector<uint8_t> jpeg_declaring(std::vector<uint8_t> j, int width, int height) {
  for (size_t i = 2; i + 8 < j.size();) {
    const int m = j[i + 1];
    const size_t len = size_t(j[i + 2]) << 8 | j[i + 3];
    if (m >= 0xC0 && m <= 0xC2) {
      j[i + 5] = uint8_t(height >> 8);
      j[i + 6] = uint8_t(height);
      j[i + 7] = uint8_t(width >> 8);
      j[i + 8] = uint8_t(width);
      return j;
    }
    i += 2 + len;
  }
  return j;
}

// A PNG whose IHDR declares width x height (with a valid CRC: only the size is wrong).
inline std::vector<uint8_t> png_declaring(std::vector<uint8_t> p, uint32_t width, uint32_t height) {
  for (int k = 0; k < 4; ++k) {
    p[16 + k] = uint8_t(width >> (24 - 8 * k));
    p[20 + k] = uint8_t(height >> (24 - 8 * k));
  }
  const uint32_t crc = uint32_t(crc32(0, p.data() + 12, 17));
  for (int k = 0; k < 4; ++k) p[29 + k] = uint8_t(crc >> (24 - 8 * k));
  return p;
}

// A BMP info header declaring width x height (the pixel data stays as it was).
inline std::vector<uint8_t> bmp_declaring(std::vector<uint8_t> b, int32_t width, int32_t height) {
  for (int k = 0; k < 4; ++k) {
    b[18 + k] = uint8_t(uint32_t(width) >> (8 * k));
    b[22 + k] = uint8_t(uint32_t(height) >> (8 * k));
  }
  return b;
}

inline std::vector<uint8_t> truncated(const std::vector<uint8_t>& b, size_t keep) {
  return std::vector<uint8_t>(b.begin(), b.begin() + std::min(keep, b.size()));
}

// A JPEG with an APP1 EXIF block (IFD0 with one entry: orientation) right after SOI.
inline std::vector<uint8_t> jpeg_with_orientation(const std::vector<uint8_t>& j, int orientation, bool little_endian) {
  const uint8_t o = uint8_t(orientation);
  const std::vector<uint8_t> tiff =
      little_endian ? std::vector<uint8_t>{'I', 'I', 42, 0, 8, 0, 0, 0, 1, 0, 0x12, 0x01, 3, 0, 1, 0, 0, 0, o, 0, 0, 0, 0, 0, 0, 0}
                    : std::vector<uint8_t>{'M', 'M', 0, 42, 0, 0, 0, 8, 0, 1, 0x01, 0x12, 0, 3, 0, 0, 0, 1, 0, o, 0, 0, 0, 0, 0, 0};
  const size_t len = 2 + 6 + tiff.size();
  std::vector<uint8_t> out;
  out.reserve(j.size() + 2 + len);
  out.insert(out.end(), j.begin(), j.begin() + 2);
  const uint8_t head[] = {0xFF, 0xE1, uint8_t(len >> 8), uint8_t(len), 'E', 'x', 'i', 'f', 0, 0};
  out.insert(out.end(), head, head + sizeof head);
  out.insert(out.end(), tiff.begin(), tiff.end());
  out.insert(out.end(), j.begin() + 2, j.end());
  return out;
}

}  // namespace faceshard::testing
