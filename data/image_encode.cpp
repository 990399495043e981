#include "data/image_encode.h"

#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <jerror.h>
#include <jpeglib.h>
#include <png.h>

#include "base/error.h"

// As in the decoders (image_codec.cpp), the libraries' error callbacks leave by longjmp to
// the encode function, which then throws; between setjmp and longjmp only C code runs.

namespace faceshard {

namespace {

struct JpegEncodeErrors {
  jpeg_error_mgr pub;  // first: libjpeg sees a jpeg_error_mgr*
  std::jmp_buf jump;
  int code = 0;
};

extern "C" void jpeg_encode_on_error(j_common_ptr c) {
  auto* e = reinterpret_cast<JpegEncodeErrors*>(c->err);
  e->code = c->err->msg_code;
  std::longjmp(e->jump, 1);
}

extern "C" void jpeg_encode_print_nothing(j_common_ptr) {}

// The rows to encode: 8-bit, 1 or 3 channels (BGRA is converted first).
cv::Mat encodable(const cv::Mat& image, const char* what) {
  if (image.empty()) throw usage_error(what, ": the image is empty");
  if (image.depth() != CV_8U) throw usage_error(what, ": JPEG takes 8-bit images, got depth ", image.depth());
  if (image.channels() == 4) {
    cv::Mat bgr(image.rows, image.cols, CV_8UC3);
    const int from_to[] = {0, 0, 1, 1, 2, 2};
    cv::mixChannels(&image, 1, &bgr, 1, from_to, 3);
    return bgr;
  }
  if (image.channels() != 1 && image.channels() != 3)
    throw usage_error(what, ": JPEG takes 1, 3 or 4 channels, got ", image.channels());
  return image;
}

}  // namespace

std::vector<uint8_t> encode_jpeg(const cv::Mat& image, const JpegEncodeOptions& o) {
  const cv::Mat img = encodable(image, "JPEG encoder");
  if (o.quality < 1 || o.quality > 100) throw usage_error("JPEG encoder: quality ", o.quality, " is not in 1..100");
  if (o.restart_interval < 0 || o.restart_interval > 65535)
    throw usage_error("JPEG encoder: restart interval ", o.restart_interval, " is not in 0..65535");
  if (img.rows > JPEG_MAX_DIMENSION || img.cols > JPEG_MAX_DIMENSION)
    throw usage_error("JPEG encoder: ", img.cols, "x", img.rows, " exceeds JPEG's ", JPEG_MAX_DIMENSION,
                      " pixels a side");
  jpeg_compress_struct cinfo;
  std::memset(&cinfo, 0, sizeof cinfo);
  JpegEncodeErrors err;
  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = jpeg_encode_on_error;
  err.pub.output_message = jpeg_encode_print_nothing;
  unsigned char* buffer = nullptr;  // libjpeg grows it with malloc; freed below
  unsigned long size = 0;
  if (setjmp(err.jump)) {
    jpeg_destroy_compress(&cinfo);
    std::free(buffer);
    throw runtime_error("JPEG encoder: libjpeg failed (code ", err.code, ")");
  }
  jpeg_create_compress(&cinfo);
  jpeg_mem_dest(&cinfo, &buffer, &size);
  cinfo.image_width = JDIMENSION(img.cols);
  cinfo.image_height = JDIMENSION(img.rows);
  cinfo.input_components = img.channels();
  cinfo.in_color_space = img.channels() == 3 ? JCS_EXT_BGR : JCS_GRAYSCALE;
  jpeg_set_defaults(&cinfo);
  cinfo.restart_interval = static_cast<unsigned int>(o.restart_interval);
  jpeg_set_quality(&cinfo, o.quality, TRUE);  // TRUE: tables limited to baseline values
  if (o.progressive) jpeg_simple_progression(&cinfo);
  if (o.optimize) cinfo.optimize_coding = TRUE;
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(img.ptr<uint8_t>(int(cinfo.next_scanline)));
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  std::vector<uint8_t> out(buffer, buffer + size);
  jpeg_destroy_compress(&cinfo);
  std::free(buffer);
  return out;
}

std::vector<uint8_t> encode_jpeg(const cv::Mat& image, int quality) {
  JpegEncodeOptions o;
  o.quality = quality;
  return encode_jpeg(image, o);
}

namespace {

struct PngSink {
  std::vector<uint8_t>* out;
  const char* error;
};

extern "C" void png_encode_write(png_structp png, png_bytep data, size_t n) {
  auto* s = static_cast<PngSink*>(png_get_io_ptr(png));
  s->out->insert(s->out->end(), data, data + n);
}

extern "C" void png_encode_flush(png_structp) {}

extern "C" void png_encode_on_error(png_structp png, png_const_charp) {
  auto* s = static_cast<PngSink*>(png_get_error_ptr(png));
  if (!s->error) s->error = "libpng failed";
  png_longjmp(png, 1);
}

extern "C" void png_encode_on_warning(png_structp, png_const_charp) {}

}  // namespace

std::vector<uint8_t> encode_png(const cv::Mat& image, int compression) {
  if (image.empty()) throw usage_error("PNG encoder: the image is empty");
  if (image.depth() != CV_8U && image.depth() != CV_16U)
    throw usage_error("PNG encoder: PNG takes 8- or 16-bit images, got depth ", image.depth());
  const int ch = image.channels();
  if (ch != 1 && ch != 3 && ch != 4) throw usage_error("PNG encoder: PNG takes 1, 3 or 4 channels, got ", ch);
  if (compression < 0 || compression > 9) throw usage_error("PNG encoder: compression ", compression, " is not in 0..9");
  const int depth = image.depth() == CV_16U ? 16 : 8;
  std::vector<uint8_t> out;
  PngSink sink{&out, nullptr};
  std::vector<png_bytep> rows(size_t(image.rows));
  for (int y = 0; y < image.rows; ++y) rows[size_t(y)] = const_cast<png_bytep>(image.ptr<uint8_t>(y));
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &sink, png_encode_on_error, png_encode_on_warning);
  if (!png) throw runtime_error("PNG encoder: out of memory starting libpng");
  png_infop info = png_create_info_struct(png);
  if (!info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, info ? &info : nullptr);
    throw runtime_error("PNG encoder: ", sink.error ? sink.error : "out of memory");
  }
  png_set_write_fn(png, &sink, png_encode_write, png_encode_flush);
  png_set_compression_level(png, compression);
  png_set_IHDR(png, info, png_uint_32(image.cols), png_uint_32(image.rows), depth,
               ch == 1 ? PNG_COLOR_TYPE_GRAY : ch == 3 ? PNG_COLOR_TYPE_RGB : PNG_COLOR_TYPE_RGB_ALPHA,
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  if (ch >= 3) png_set_bgr(png);  // the rows are BGR(A)
  if (depth == 16) png_set_swap(png);  // PNG stores 16-bit samples big-endian
  png_write_image(png, rows.data());
  png_write_end(png, info);
  png_destroy_write_struct(&png, &info);
  return out;
}

}  // namespace faceshard
