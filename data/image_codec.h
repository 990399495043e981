// Strict, silent decoders of JPEG (libjpeg-turbo), PNG (libpng) and uncompressed BMP to
// 8-bit BGR, the pixels cv::imdecode(IMREAD_COLOR) gives for a valid file. Strict: a
// decoder warning (corrupt or truncated data, a bad CRC) fails the decode instead of
// yielding a patched image. Silent: the libraries print nothing; what they report becomes
// one faceshard::Error line in faceshard's words. Plain C++ over bytes (no OpenCV), so
// the fuzz target runs it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "data/image_header.h"

namespace faceshard {

// Decodes the image whose header read_image_header gave (`h`, from the same bytes) into
// h.height rows of 3 * h.width bytes (BGR), `stride` bytes apart from dst, as stored (the
// EXIF orientation is the caller's). Throws faceshard::Error "<where>: ..." on any error
// or warning of the decoder; dst may then hold part of the image.
void decode_to_bgr(const uint8_t* data, size_t size, const EncodedImageHeader& h, uint8_t* dst, size_t stride,
                   const std::string& where);

// The most a JPEG decode may allocate (libjpeg's own memory manager, enforced): above
// what the largest progressive image allowed by kMaxImagePixels needs.
constexpr uint64_t kJpegDecoderMemory = uint64_t(128) << 20;
// Scans of one progressive JPEG: typical encoders write about 10; thousands of tiny scans
// make a small file decode for minutes.
constexpr int kMaxJpegScans = 256;

}  // namespace faceshard
