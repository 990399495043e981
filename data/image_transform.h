// Per-image work of the loader, on OpenCV matrices and plain float buffers (no tensors):
// decode, the optional extra augmentations, and the conversion to the network input,
// normalised RGB float CHW: (x/255 - 0.5)/0.5, optionally mirrored.
#pragma once
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <opencv2/core.hpp>

#include "data/image_header.h"

namespace faceshard {

// Decodes a JPEG, PNG or uncompressed BMP to an 8-bit BGR image (OpenCV's channel order;
// the pixels cv::imdecode gives, EXIF orientation applied). Reads the header first
// (data/image_header.h): an image over kMaxImageSide / kMaxImagePixels is refused before
// any pixel is decoded. Throws faceshard::Error "<where>: ..." (one line, nothing printed
// by the libraries) when the bytes do not decode, and when the decoder warns (truncated or
// corrupt data): a patched-up image is a failed decode.
cv::Mat decode_image(const uint8_t* data, size_t size, const std::string& where);
// The same with the header already read from these bytes (read_image_header), for a
// caller that checks the declared size first.
cv::Mat decode_image(const uint8_t* data, size_t size, const EncodedImageHeader& header, const std::string& where);

// Writes 3 x H x W floats in RGB order to dst from a BGR image; flip mirrors left-right.
void bgr_to_normalized_chw(const cv::Mat& bgr, bool flip, float* dst);
// The same from packed HWC RGB pixels (SyntheticDataset).
void rgb_to_normalized_chw(const uint8_t* rgb, int height, int width, bool flip, float* dst);

// Optional augmentations, all off by default (arcface_torch's DALI extras): grayscale,
// Gaussian blur, and a downscale-then-upscale, each with its own probability.
struct ExtraAugment {
  double gray_prob = 0.0;
  double blur_prob = 0.0;
  double downscale_prob = 0.0;
  bool any() const { return gray_prob > 0 || blur_prob > 0 || downscale_prob > 0; }
};
void apply_extra_augment(cv::Mat& bgr, const ExtraAugment& aug, std::mt19937_64& rng);

}  // namespace faceshard
