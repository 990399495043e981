// Image encoders: JPEG through libjpeg-turbo and PNG through libpng, called directly (the
// decoders' libraries; no OpenCV codec module). The JPEG settings are libjpeg's defaults
// with the quality's tables limited to baseline values, the settings cv::imencode uses, so
// a face written by faceshard-synth or faceshard-pack is the file OpenCV would write.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <opencv2/core.hpp>

namespace faceshard {

struct JpegEncodeOptions {
  int quality = 95;           // 1..100
  bool progressive = false;   // a progressive scan script (jpeg_simple_progression)
  bool optimize = false;      // optimal Huffman tables (a second pass over the data)
  int restart_interval = 0;   // restart markers every N MCUs (0: none)
};

// JPEG of an 8-bit BGR (CV_8UC3) or greyscale (CV_8UC1) image; BGRA drops its alpha.
// Throws faceshard::Error naming what is wrong (an empty image, another pixel type, a
// quality outside 1..100, a side over 65,500 pixels).
std::vector<uint8_t> encode_jpeg(const cv::Mat& image, const JpegEncodeOptions& options);
std::vector<uint8_t> encode_jpeg(const cv::Mat& image, int quality);

// PNG of an 8- or 16-bit image with 1 (grey), 3 (BGR) or 4 (BGRA) channels; compression
// 0..9 (zlib's level).
std::vector<uint8_t> encode_png(const cv::Mat& image, int compression = 1);

}  // namespace faceshard
