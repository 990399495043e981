#include "data/image_codec.h"

#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <vector>

#include <jpeglib.h>
#include <jerror.h>
#include <png.h>

#include "base/error.h"

// libjpeg and libpng report errors through callbacks that must not return; they leave by
// longjmp to the decode function, which then throws. Between setjmp and longjmp only C
// code runs and no C++ object is created, so nothing is skipped.

namespace faceshard {

namespace {

// ---------------------------------------------------------------------------------------
// JPEG

constexpr int kScanLimitCode = -2;  // our own "message code": too many scans

struct JpegErrors {
  jpeg_error_mgr pub;  // first: libjpeg sees a jpeg_error_mgr*
  std::jmp_buf jump;
  int code = 0;
};

extern "C" void jpeg_on_error(j_common_ptr c) {
  auto* e = reinterpret_cast<JpegErrors*>(c->err);
  e->code = c->err->msg_code;
  std::longjmp(e->jump, 1);
}

// level -1: a warning (corrupt data that libjpeg would patch over); >= 0: trace messages.
extern "C" void jpeg_on_message(j_common_ptr c, int level) {
  if (level >= 0) return;
  auto* e = reinterpret_cast<JpegErrors*>(c->err);
  e->code = c->err->msg_code;
  std::longjmp(e->jump, 1);
}

extern "C" void jpeg_print_nothing(j_common_ptr) {}

extern "C" void jpeg_on_progress(j_common_ptr c) {
  auto* d = reinterpret_cast<j_decompress_ptr>(c);
  if (d->input_scan_number > kMaxJpegScans) {
    auto* e = reinterpret_cast<JpegErrors*>(c->err);
    e->code = kScanLimitCode;
      std::longjmp(e->jump, 1);
  }
}

// libjpeg's report in faceshard's words (its own text is not shown).
std::string jpeg_problem(int code) {
  switch (code) {
    case kScanLimitCode:
      return detail::concat("progressive JPEG has more than ", kMaxJpegScans, " scans");
    case JWRN_JPEG_EOF:
    case JERR_INPUT_EOF:
    case JERR_INPUT_EMPTY:
      return "JPEG data ends before the image does (truncated)";
    case JWRN_HIT_MARKER:
      return "corrupt JPEG data: a marker inside the compressed pixels (data missing)";
    case JWRN_EXTRANEOUS_DATA:
      return "corrupt JPEG data: stray bytes before a marker";
    case JWRN_HUFF_BAD_CODE:
    case JWRN_ARITH_BAD_CODE:
    case JERR_BAD_DCT_COEF:
      return "corrupt JPEG data: invalid compressed pixels";
    case JWRN_MUST_RESYNC:
      return "corrupt JPEG data: a restart marker is missing or out of order";
    case JWRN_NOT_SEQUENTIAL:
    case JWRN_BOGUS_PROGRESSION:
    case JERR_BAD_PROGRESSION:
    case JERR_BAD_COMPONENT_ID:
    case JERR_EOI_EXPECTED:
      return "corrupt JPEG data: invalid scan parameters";
    case JWRN_BOGUS_ICC:
      return "corrupt JPEG data: a malformed ICC profile marker";
    case JWRN_ADOBE_XFORM:
      return "JPEG names an unknown Adobe colour transform";
    case JWRN_JFIF_MAJOR:
      return "JPEG names an unknown JFIF version";
    case JERR_NO_BACKING_STORE:
    case JERR_OUT_OF_MEMORY:
      return detail::concat("JPEG needs more than ", kJpegDecoderMemory >> 20, " MiB to decode");
    case JERR_BAD_HUFF_TABLE:
    case JERR_DHT_INDEX:
    case JERR_NO_HUFF_TABLE:
    case JERR_HUFF_CLEN_OVERFLOW:
    case JERR_HUFF_MISSING_CODE:
      return "corrupt JPEG data: invalid Huffman table";
    case JERR_DQT_INDEX:
    case JERR_NO_QUANT_TABLE:
      return "corrupt JPEG data: invalid quantisation table";
    case JERR_BAD_LENGTH:
      return "corrupt JPEG data: invalid marker length";
    case JERR_BAD_SAMPLING:
    case JERR_BAD_MCU_SIZE:
      return "JPEG has invalid sampling factors";
    case JERR_NO_IMAGE:
    case JERR_SOF_NO_SOS:
      return "JPEG has no image data (no scan)";
    default:
      return detail::concat("invalid JPEG data (decoder code ", code, ")");
  }
}

void decode_jpeg(const uint8_t* data, size_t size, const EncodedImageHeader& h, uint8_t* dst, size_t stride,
                 const std::string& where) {
  jpeg_decompress_struct cinfo;
  std::memset(&cinfo, 0, sizeof cinfo);
  JpegErrors err;
  jpeg_progress_mgr progress;
  std::memset(&progress, 0, sizeof progress);
  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = jpeg_on_error;
  err.pub.emit_message = jpeg_on_message;
  err.pub.output_message = jpeg_print_nothing;
  progress.progress_monitor = jpeg_on_progress;
  // 0: fine; 1: libjpeg's header disagrees with ours.
  volatile int mismatch = 0;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    throw runtime_error(where, ": ", jpeg_problem(err.code));
  }
  jpeg_create_decompress(&cinfo);
  cinfo.mem->max_memory_to_use = long(kJpegDecoderMemory);
  cinfo.progress = &progress;
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  if (int64_t(cinfo.image_width) != h.width || int64_t(cinfo.image_height) != h.height ||
      cinfo.num_components != h.channels) {
    mismatch = 1;
  } else {
    cinfo.out_color_space = JCS_EXT_BGR;
    jpeg_start_decompress(&cinfo);
    while (cinfo.output_scanline < cinfo.output_height) {
      JSAMPROW row = dst + size_t(cinfo.output_scanline) * stride;
      jpeg_read_scanlines(&cinfo, &row, 1);
    }
    jpeg_finish_decompress(&cinfo);
  }
  jpeg_destroy_decompress(&cinfo);
  if (mismatch) throw runtime_error(where, ": JPEG frame header is inconsistent (two readings differ)");
}

// ---------------------------------------------------------------------------------------
// PNG

struct PngSource {
  const uint8_t* data;
  size_t size;
  size_t pos;
  bool truncated;
  const char* warning;  // the first warning, classified (nullptr: none)
  const char* error;
};

// libpng's messages classified into faceshard's words.
const char* png_problem(const char* msg) {
  const auto has = [&](const char* s) { return std::strstr(msg, s) != nullptr; };
  if (has("CRC")) return "corrupt PNG data: a chunk fails its CRC check";
  if (has("IDAT") || has("zlib") || has("compressed") || has("distance") || has("check") || has("inflate") ||
      has("filter") || has("Not enough image data") || has("Too much image data"))
    return "corrupt PNG data: invalid compressed pixels";
  if (has("exceeds") || has("limit") || has("too large") || has("Image width") || has("Image height"))
    return "PNG exceeds faceshard's image limits";
  if (has("PLTE") || has("tRNS") || has("palette")) return "corrupt PNG data: invalid palette or transparency";
  return "invalid PNG data";
}

extern "C" void png_read_bytes(png_structp png, png_bytep out, size_t n) {
  auto* s = static_cast<PngSource*>(png_get_io_ptr(png));
  if (n > s->size - s->pos) {
    s->truncated = true;
    png_error(png, "truncated");
  }
  std::memcpy(out, s->data + s->pos, n);
  s->pos += n;
}

extern "C" void png_on_error(png_structp png, png_const_charp msg) {
  auto* s = static_cast<PngSource*>(png_get_error_ptr(png));
  if (!s->error) s->error = png_problem(msg ? msg : "");
  png_longjmp(png, 1);
}

extern "C" void png_on_warning(png_structp png, png_const_charp msg) {
  auto* s = static_cast<PngSource*>(png_get_error_ptr(png));
  if (!s->warning) s->warning = png_problem(msg ? msg : "");
}

void decode_png(const uint8_t* data, size_t size, const EncodedImageHeader& h, uint8_t* dst, size_t stride,
                const std::string& where) {
  PngSource src{data, size, 0, false, nullptr, nullptr};
  std::vector<png_bytep> rows(size_t(h.height));
  for (size_t y = 0; y < rows.size(); ++y) rows[y] = dst + y * stride;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, png_on_error, png_on_warning);
  if (!png) throw runtime_error(where, ": out of memory starting the PNG decoder");
  png_infop info = png_create_info_struct(png);
  volatile int mismatch = 0;
  if (!info || setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, info ? &info : nullptr, nullptr);
    if (src.truncated) throw runtime_error(where, ": PNG data ends before the image does (truncated)");
    throw runtime_error(where, ": ", src.error ? src.error : "invalid PNG data");
  }
  png_set_read_fn(png, &src, png_read_bytes);
  png_set_user_limits(png, uint32_t(kMaxImageSide), uint32_t(kMaxImageSide));
  png_set_chunk_malloc_max(png, 8u << 20);
  png_set_chunk_cache_max(png, 128);
  // Ancillary chunks that never change the pixels are skipped unread: text, profiles and
  // metadata (some are zlib-compressed, and the sRGB profile check warns on harmless files).
  static const png_byte kSkipped[] = "iCCP\0iTXt\0tEXt\0zTXt\0eXIf\0sPLT\0tIME\0pHYs\0oFFs\0pCAL\0sCAL\0hIST\0sBIT\0"
                                     "cHRM\0gAMA\0sRGB\0bKGD";
  png_set_keep_unknown_chunks(png, PNG_HANDLE_CHUNK_NEVER, nullptr, 0);
  png_set_keep_unknown_chunks(png, PNG_HANDLE_CHUNK_NEVER, kSkipped, int(sizeof kSkipped / 5));
  png_read_info(png, info);
  png_uint_32 w = 0, ht = 0;
  int depth = 0, type = 0, interlace = 0;
  png_get_IHDR(png, info, &w, &ht, &depth, &type, &interlace, nullptr, nullptr);
  if (int64_t(w) != h.width || int64_t(ht) != h.height || depth != h.bit_depth) {
    mismatch = 1;
  } else {
    // The transformations cv::imdecode(IMREAD_COLOR) asks of libpng: 8 bits (16-bit
    // samples keep their high byte), alpha dropped, palettes and grey expanded, BGR order.
    if (depth == 16) png_set_strip_16(png);
    png_set_strip_alpha(png);
    if (type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
    if ((type & PNG_COLOR_MASK_COLOR) == 0 && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
    if (type & PNG_COLOR_MASK_COLOR) png_set_bgr(png);
    else png_set_gray_to_rgb(png);
    png_set_interlace_handling(png);
    png_read_update_info(png, info);
    if (png_get_rowbytes(png, info) != size_t(3) * w) {
      mismatch = 2;
    } else {
      png_read_image(png, rows.data());
      png_read_end(png, nullptr);
    }
  }
  png_destroy_read_struct(&png, &info, nullptr);
  if (mismatch == 1) throw runtime_error(where, ": PNG header is inconsistent (two readings differ)");
  if (mismatch == 2) throw runtime_error(where, ": PNG does not decode to 8-bit BGR");
  if (src.warning) throw runtime_error(where, ": ", src.warning);
}

// ---------------------------------------------------------------------------------------
// BMP (uncompressed; the header reader checked that every row is in the data)

void decode_bmp(const uint8_t* data, size_t size, const EncodedImageHeader& h, uint8_t* dst, size_t stride) {
  const int bpp = h.bit_depth;
  const size_t w = size_t(h.width), rows = size_t(h.height);
  const size_t src_stride = (w * size_t(bpp) + 31) / 32 * 4;
  uint8_t palette[256][3] = {};
  for (int i = 0; i < h.bmp_palette_entries; ++i) {
    const uint8_t* p = data + h.bmp_palette_offset + size_t(i) * size_t(h.bmp_palette_entry_size);
    palette[i][0] = p[0];  // stored B, G, R(, 0)
    palette[i][1] = p[1];
    palette[i][2] = p[2];
  }
  for (size_t y = 0; y < rows; ++y) {
    const uint8_t* s = data + h.bmp_pixel_offset + (h.bmp_top_down ? y : rows - 1 - y) * src_stride;
    uint8_t* d = dst + y * stride;
    for (size_t x = 0; x < w; ++x, d += 3) {
      if (bpp >= 24) {
        const uint8_t* px = s + x * size_t(bpp / 8);
        d[0] = px[0];
        d[1] = px[1];
        d[2] = px[2];
        continue;
      }
      unsigned idx;
      if (bpp == 8) idx = s[x];
      else if (bpp == 4) idx = (s[x / 2] >> (x % 2 ? 0 : 4)) & 15;
      else idx = (s[x / 8] >> (7 - x % 8)) & 1;
      std::memcpy(d, palette[idx], 3);
    }
  }
  (void)size;
}

}  // namespace

void decode_to_bgr(const uint8_t* data, size_t size, const EncodedImageHeader& h, uint8_t* dst, size_t stride,
                   const std::string& where) {
  switch (h.format) {
    case ImageFormat::jpeg: return decode_jpeg(data, size, h, dst, stride, where);
    case ImageFormat::png: return decode_png(data, size, h, dst, stride, where);
    case ImageFormat::bmp: return decode_bmp(data, size, h, dst, stride);
  }
}

}  // namespace faceshard
