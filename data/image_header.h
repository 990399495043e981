// What an encoded image says about itself before any pixel is decoded: its format (JPEG,
// PNG, BMP) and the size it declares, read from the JPEG frame header (SOF), the PNG IHDR
// chunk or the BMP info header. Every decode reads this first and refuses an image over
// the limits below, so a small file that declares a huge image (a decompression bomb)
// costs nothing. Plain C++ over bytes (parses untrusted input; also in the fuzz target).
#pragma once
#include <cstdint>
#include <string>

namespace faceshard {

// The largest image any faceshard reader decodes: 8192 pixels a side and 2^24 pixels in
// all (4096 x 4096; 48 MiB as 8-bit BGR). Faces are 112 x 112; IJB's loose crops and
// photos given to faceshard-extract are far below this.
constexpr int64_t kMaxImageSide = 8192;
constexpr int64_t kMaxImagePixels = int64_t(1) << 24;

enum class ImageFormat { jpeg, png, bmp };
const char* image_format_name(ImageFormat f);  // "JPEG", "PNG", "BMP"

struct EncodedImageHeader {
  ImageFormat format = ImageFormat::jpeg;
  int64_t width = 0, height = 0;  // as stored (before the EXIF orientation)
  int channels = 0;               // JPEG: 1 or 3 components; PNG: 1-4; BMP: 3, or 1 for palettes
  int bit_depth = 8;              // bits per sample (PNG 1-16; BMP bits per pixel)
  bool progressive = false;       // JPEG progressive (whole-image coefficient buffer) / PNG interlaced
  int orientation = 1;            // JPEG EXIF orientation 1-8 (5-8 swap width and height)
  // BMP only: where the pixel rows start, whether row 0 is the top row, the palette.
  uint64_t bmp_pixel_offset = 0;
  bool bmp_top_down = false;
  uint64_t bmp_palette_offset = 0;
  int bmp_palette_entries = 0;  // at most 256
  int bmp_palette_entry_size = 4;

  // The size of the decoded image (after the EXIF orientation).
  int64_t decoded_width() const { return orientation >= 5 ? height : width; }
  int64_t decoded_height() const { return orientation >= 5 ? width : height; }
  // Memory a decode holds at most: the 8-bit BGR output plus the decoder's own buffers (a
  // progressive JPEG keeps every DCT coefficient, 2 bytes per sample, until its last scan).
  uint64_t decode_bytes() const;
};

// Reads the header of a JPEG, PNG or BMP held in data[0, size). Throws faceshard::Error
// "<where>: ..." (one line) when the bytes are none of these, the header is cut short or
// malformed, the image uses a variant faceshard does not decode (12-bit or lossless JPEG,
// CMYK JPEG, compressed BMP, ...), or it declares more than kMaxImageSide a side or
// kMaxImagePixels in all.
EncodedImageHeader read_image_header(const uint8_t* data, size_t size, const std::string& where);

}  // namespace faceshard
