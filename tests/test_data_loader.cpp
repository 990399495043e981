// The data pipeline above the parsers: the distributed sampler, the image transforms, the
// synthetic face generator, the threaded loader (checked sample by sample against an
// independent decode + closed-form normalisation), bad-data handling, loader throughput,
// and the faceshard-pack / faceshard-synth binaries.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <jpeglib.h>

#include <opencv2/imgproc.hpp>

#include "tests/test_paths.h"
#include "app/config/config.h"
#include "app/eval/verification_metrics.h"
#include "data/dataset.h"
#include "data/image_encode.h"
#include "data/image_header.h"
#include "data/image_record.h"
#include "data/image_transform.h"
#include "data/insightface_rec.h"
#include "data/loader.h"
#include "data/recordio.h"
#include "data/sampler.h"
#include "data/synthetic_faces.h"
#include "data/verification_bin.h"
#include "base/error.h"
#include "tests/hostile_images.h"
#include "tests/test_errors.h"
#include "tests/test_files.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;
using testing::slurp;
using testing::spit;


using testing::error_of;

// ---------------------------------------------------------------------------------------
// Sampler

TEST(DataSampler, EverySampleOncePerEpochAcrossRanks) {
  const uint64_t n = 103;
  for (int world = 1; world <= 4; ++world) {
    for (uint64_t epoch = 0; epoch < 3; ++epoch) {
      std::multiset<uint64_t> all;
      for (int r = 0; r < world; ++r) {
        const DistributedSampler s(n, world, r, 42);
        const auto idx = s.indices(epoch);
        EXPECT_EQ(idx.size(), n / world);  // equal shares, remainder dropped
        all.insert(idx.begin(), idx.end());
      }
      EXPECT_EQ(all.size(), (n / world) * world);
      EXPECT_EQ(std::set<uint64_t>(all.begin(), all.end()).size(), all.size()) << "a sample on two ranks";
      EXPECT_LT(*all.rbegin(), n);
    }
  }
  // With one rank nothing is dropped: the epoch is a permutation of 0..n-1.
  auto one = DistributedSampler(n, 1, 0, 7).indices(0);
  std::sort(one.begin(), one.end());
  std::vector<uint64_t> iota(n);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(one, iota);
}

TEST(DataSampler, OrderDependsOnSeedAndEpochOnly) {
  const DistributedSampler a(1000, 2, 1, 5), b(1000, 2, 1, 5), c(1000, 2, 1, 6);
  EXPECT_EQ(a.indices(3), b.indices(3));
  EXPECT_NE(a.indices(3), a.indices(4));
  EXPECT_NE(a.indices(3), c.indices(3));
  // Resume: (epoch, position) continues the same sequence.
  const auto full = a.indices(2);
  const auto rest = a.indices(2, 123);
  EXPECT_EQ(rest, std::vector<uint64_t>(full.begin() + 123, full.end()));
  EXPECT_TRUE(a.indices(2, a.size()).empty());
  EXPECT_THROW(a.indices(2, a.size() + 1), Error);
  // Without shuffling, rank r of W takes r, r+W, r+2W, ... (torch's DistributedSampler).
  const auto plain = DistributedSampler(10, 3, 2, 0, false).indices(0);
  EXPECT_EQ(plain, (std::vector<uint64_t>{2, 5, 8}));
  EXPECT_THROW(DistributedSampler(10, 2, 2, 0), Error);
  EXPECT_THROW(DistributedSampler(1, 2, 0, 0), Error);
}

// ---------------------------------------------------------------------------------------
// Transforms

TEST(DataTransform, NormalisedRgbChwClosedForm) {
  cv::Mat bgr(2, 3, CV_8UC3);
  for (int y = 0; y < 2; ++y)
    for (int x = 0; x < 3; ++x) bgr.at<cv::Vec3b>(y, x) = cv::Vec3b(uint8_t(10 * x + y), uint8_t(100 + x), uint8_t(255 - 40 * y - x));
  std::vector<float> out(18), flipped(18);
  bgr_to_normalized_chw(bgr, false, out.data());
  bgr_to_normalized_chw(bgr, true, flipped.data());
  for (int c = 0; c < 3; ++c)
    for (int y = 0; y < 2; ++y)
      for (int x = 0; x < 3; ++x) {
        const int bgr_c = 2 - c;  // output channel 0 is red
        const double v = bgr.at<cv::Vec3b>(y, x)[bgr_c];
        EXPECT_NEAR(out[c * 6 + y * 3 + x], (v / 255.0 - 0.5) / 0.5, 1e-6);
        const double vf = bgr.at<cv::Vec3b>(y, 2 - x)[bgr_c];
        EXPECT_NEAR(flipped[c * 6 + y * 3 + x], (vf / 255.0 - 0.5) / 0.5, 1e-6);
      }
  // Packed RGB gives the same result as the BGR image it came from.
  cv::Mat rgb;
  cv::cvtColor(bgr, rgb, cv::COLOR_BGR2RGB);
  std::vector<float> out2(18);
  rgb_to_normalized_chw(rgb.ptr<uint8_t>(), 2, 3, false, out2.data());
  EXPECT_EQ(out, out2);
}

TEST(DataTransform, DecodeIsExactForPngAndRejectsGarbage) {
  cv::Mat img(17, 23, CV_8UC3);
  cv::randu(img, 0, 256);
  std::vector<uint8_t> png;
  png = testing::cv2_imencode(".png", img);
  ASSERT_FALSE(png.empty());
  const cv::Mat back = decode_image(png.data(), png.size(), "x.png");
  EXPECT_EQ(cv::norm(back, img, cv::NORM_INF), 0.0);
  std::vector<uint8_t> junk(500, 7);
  EXPECT_NE(error_of([&] { decode_image(junk.data(), junk.size(), "rec key 5"); }).find("rec key 5"),
            std::string::npos);
  const size_t whole = png.size();
  png.resize(whole / 3);  // truncated: the header is there, the pixels are not
  EXPECT_NE(error_of([&] { decode_image(png.data(), png.size(), "cut.png"); }).find("truncated"), std::string::npos);
  EXPECT_THROW(decode_image(png.data(), 0, "empty"), Error);
}

// ---------------------------------------------------------------------------------------
// Image headers and the strict decoders

// For valid files the header reader gives the size OpenCV decodes, and decode_image the
// very pixels cv::imdecode(IMREAD_COLOR) gives: JPEG (baseline, progressive, greyscale,
// restart markers), PNG (8/16-bit, grey, alpha) and BMP (24/32-bit, 8-bit palette).
TEST(DataImage, HeaderAndPixelsMatchOpenCvForValidFiles) {
  int checked = 0;
  for (const cv::Size sz : {cv::Size(1, 1), cv::Size(7, 13), cv::Size(112, 112), cv::Size(301, 200), cv::Size(640, 480)}) {
    cv::Mat bgr = testing::noise_image(sz.width, sz.height);
    cv::GaussianBlur(bgr, bgr, cv::Size(5, 5), 2);  // some structure for the JPEG encoder
    cv::Mat grey, bgra, bgr16, grey16;
    cv::cvtColor(bgr, grey, cv::COLOR_BGR2GRAY);
    cv::cvtColor(bgr, bgra, cv::COLOR_BGR2BGRA);
    bgr.convertTo(bgr16, CV_16U, 257.3);
    grey.convertTo(grey16, CV_16U, 250.1);
    const std::vector<std::pair<std::string, std::vector<uint8_t>>> files = {
        {"jpeg q50", testing::encode(".jpg", bgr, {testing::cv2::IMWRITE_JPEG_QUALITY, 50})},
        {"jpeg q95", testing::encode(".jpg", bgr, {testing::cv2::IMWRITE_JPEG_QUALITY, 95})},
        {"jpeg progressive", testing::encode(".jpg", bgr, {testing::cv2::IMWRITE_JPEG_PROGRESSIVE, 1})},
        {"jpeg optimized", testing::encode(".jpg", bgr, {testing::cv2::IMWRITE_JPEG_OPTIMIZE, 1})},
        {"jpeg restarts", testing::encode(".jpg", bgr, {testing::cv2::IMWRITE_JPEG_RST_INTERVAL, 3})},
        {"jpeg grey", testing::encode(".jpg", grey)},
        {"jpeg grey progressive", testing::encode(".jpg", grey, {testing::cv2::IMWRITE_JPEG_PROGRESSIVE, 1})},
        {"png", testing::encode(".png", bgr)},
        {"png grey", testing::encode(".png", grey)},
        {"png bgra", testing::encode(".png", bgra)},
        {"png 16-bit", testing::encode(".png", bgr16)},
        {"png 16-bit grey", testing::encode(".png", grey16)},
        {"bmp", testing::encode(".bmp", bgr)},
        {"bmp grey", testing::encode(".bmp", grey)},
        {"bmp bgra", testing::encode(".bmp", bgra)},
    };
    for (const auto& [name, bytes] : files) {
      SCOPED_TRACE(name + " " + std::to_string(sz.width) + "x" + std::to_string(sz.height));
      ASSERT_FALSE(bytes.empty());
      const cv::Mat want = testing::cv2_imdecode(bytes, testing::cv2::IMREAD_COLOR);
      const EncodedImageHeader h = read_image_header(bytes.data(), bytes.size(), name);
      EXPECT_EQ(h.decoded_width(), want.cols);
      EXPECT_EQ(h.decoded_height(), want.rows);
      EXPECT_EQ(h.progressive, name.find("progressive") != std::string::npos);
      const cv::Mat got = decode_image(bytes.data(), bytes.size(), name);
      ASSERT_EQ(got.size(), want.size());
      ASSERT_EQ(got.type(), CV_8UC3);
      EXPECT_EQ(cv::norm(got, want, cv::NORM_INF), 0.0);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 5 * 15);
  // EXIF orientations 1-8 (and invalid 0, 9: ignored), both byte orders, applied as
  // cv::imdecode applies them.
  const std::vector<uint8_t> jpeg = testing::encode(".jpg", testing::noise_image(70, 40));
  for (const bool le : {true, false})
    for (int o = 0; o <= 9; ++o) {
      SCOPED_TRACE("orientation " + std::to_string(o) + (le ? " II" : " MM"));
      const std::vector<uint8_t> b = testing::jpeg_with_orientation(jpeg, o, le);
      const cv::Mat want = testing::cv2_imdecode(b, testing::cv2::IMREAD_COLOR);
      const EncodedImageHeader h = read_image_header(b.data(), b.size(), "exif");
      EXPECT_EQ(h.orientation, o >= 1 && o <= 8 ? o : 1);
      EXPECT_EQ(h.decoded_width(), want.cols);
      const cv::Mat got = decode_image(b.data(), b.size(), "exif");
      ASSERT_EQ(got.size(), want.size());
      EXPECT_EQ(cv::norm(got, want, cv::NORM_INF), 0.0);
    }
}

// faceshard's own encoders (data/image_encode) write what OpenCV writes: for each JPEG
// variant the file cv2.imencode writes with the same settings decodes (in cv2) to the same
// pixels, the markers of the variant are there, and the pixels stay close to the source;
// PNG round-trips exactly through cv2.imdecode(IMREAD_UNCHANGED) at 8 and 16 bits.
TEST(DataImage, EncodersWriteWhatOpenCvWrites) {
  using testing::cv2::IMREAD_COLOR;
  using testing::cv2::IMREAD_UNCHANGED;
  auto has_marker = [](const std::vector<uint8_t>& j, uint8_t m) {
    for (size_t i = 0; i + 1 < j.size(); ++i)
      if (j[i] == 0xFF && j[i + 1] == m) return true;
    return false;
  };
  int checked = 0;
  for (const cv::Size sz : {cv::Size(1, 1), cv::Size(7, 13), cv::Size(112, 112), cv::Size(301, 200)}) {
    // Smooth content with a different pattern in each channel.
    cv::Mat bgr(sz, CV_8UC3);
    for (int y = 0; y < sz.height; ++y)
      for (int x = 0; x < sz.width; ++x)
        bgr.at<cv::Vec3b>(y, x) = cv::Vec3b(uint8_t(20 + 200 * x / sz.width), uint8_t(230 - 200 * y / sz.height),
                                            uint8_t(128 + 90 * std::sin(0.05 * (x + y))));
    cv::Mat grey, bgra, bgr16, grey16;
    cv::cvtColor(bgr, grey, cv::COLOR_BGR2GRAY);
    cv::cvtColor(bgr, bgra, cv::COLOR_BGR2BGRA);
    bgr.convertTo(bgr16, CV_16U, 257.3);
    grey.convertTo(grey16, CV_16U, 250.1);
    struct Variant {
      std::string name;
      cv::Mat image;
      JpegEncodeOptions ours;
      std::vector<int> cv2_params;
    };
    auto opt = [](int q, bool prog, bool optim, int rst) {
      JpegEncodeOptions o;
      o.quality = q, o.progressive = prog, o.optimize = optim, o.restart_interval = rst;
      return o;
    };
    using namespace testing::cv2;
    const std::vector<Variant> variants = {
        {"q95", bgr, opt(95, false, false, 0), {IMWRITE_JPEG_QUALITY, 95}},
        {"q50", bgr, opt(50, false, false, 0), {IMWRITE_JPEG_QUALITY, 50}},
        {"progressive", bgr, opt(95, true, false, 0), {IMWRITE_JPEG_QUALITY, 95, IMWRITE_JPEG_PROGRESSIVE, 1}},
        {"optimized", bgr, opt(95, false, true, 0), {IMWRITE_JPEG_QUALITY, 95, IMWRITE_JPEG_OPTIMIZE, 1}},
        {"restarts", bgr, opt(95, false, false, 3), {IMWRITE_JPEG_QUALITY, 95, IMWRITE_JPEG_RST_INTERVAL, 3}},
        {"grey", grey, opt(95, false, false, 0), {IMWRITE_JPEG_QUALITY, 95}},
        {"grey progressive", grey, opt(90, true, false, 0), {IMWRITE_JPEG_QUALITY, 90, IMWRITE_JPEG_PROGRESSIVE, 1}},
        {"bgra", bgra, opt(95, false, false, 0), {IMWRITE_JPEG_QUALITY, 95}},
    };
    for (const Variant& v : variants) {
      SCOPED_TRACE("jpeg " + v.name + " " + std::to_string(sz.width) + "x" + std::to_string(sz.height));
      const std::vector<uint8_t> ours = encode_jpeg(v.image, v.ours);
      const std::vector<uint8_t> theirs = testing::cv2_imencode(".jpg", v.image, v.cv2_params);
      const cv::Mat got = testing::cv2_imdecode(ours, IMREAD_UNCHANGED);
      const cv::Mat want = testing::cv2_imdecode(theirs, IMREAD_UNCHANGED);
      ASSERT_FALSE(got.empty());
      ASSERT_EQ(got.size(), sz);
      ASSERT_EQ(got.type(), want.type());
      EXPECT_EQ(got.channels(), v.image.channels() == 1 ? 1 : 3);
      EXPECT_LE(cv::norm(got, want, cv::NORM_INF), 1.0);
      const EncodedImageHeader h = read_image_header(ours.data(), ours.size(), v.name);
      EXPECT_EQ(h.progressive, v.ours.progressive);
      EXPECT_EQ(has_marker(ours, 0xC2), v.ours.progressive);  // SOF2: progressive frame
      EXPECT_EQ(has_marker(ours, 0xDD), v.ours.restart_interval > 0);  // DRI: restart interval
      // Close to the source (a channel swap or a wrong stride is far off): mean error in
      // grey levels at quality 95 / 50.
      cv::Mat src = v.image;
      if (src.channels() == 4) cv::cvtColor(src, src, cv::COLOR_BGRA2BGR);
      const double mean_err = cv::norm(got, src, cv::NORM_L1) / double(src.total() * src.channels());
      const double bound = v.ours.quality >= 90 ? 3.0 : 6.0;
      EXPECT_LT(mean_err, bound) << mean_err;
      if (src.channels() == 3) {  // ... and a channel swap would be far outside that bound
        cv::Mat swapped;
        cv::cvtColor(src, swapped, cv::COLOR_BGR2RGB);
        EXPECT_GT(cv::norm(got, swapped, cv::NORM_L1) / double(src.total() * 3), 4 * bound);
      }
      // Our decoder reads it as cv2 does.
      EXPECT_EQ(cv::norm(decode_image(ours.data(), ours.size(), v.name), testing::cv2_imdecode(ours, IMREAD_COLOR),
                         cv::NORM_INF), 0.0);
      ++checked;
    }
    for (const cv::Mat& m : {bgr, grey, bgra, bgr16, grey16}) {
      SCOPED_TRACE("png type " + std::to_string(m.type()) + " " + std::to_string(sz.width));
      for (int level : {0, 1, 9}) {
        const std::vector<uint8_t> png = encode_png(m, level);
        const cv::Mat back = testing::cv2_imdecode(png, IMREAD_UNCHANGED);
        ASSERT_EQ(back.type(), m.type());
        ASSERT_EQ(back.size(), m.size());
        EXPECT_EQ(cv::norm(back, m, cv::NORM_INF), 0.0);
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 4 * (8 + 5 * 3));
  // What the encoders refuse, in one line naming it.
  const cv::Mat img(4, 4, CV_8UC3, cv::Scalar(1, 2, 3));
  EXPECT_NE(error_of([&] { encode_jpeg(cv::Mat(), 90); }).find("empty"), std::string::npos);
  EXPECT_NE(error_of([&] { encode_jpeg(img, 0); }).find("quality 0"), std::string::npos);
  EXPECT_NE(error_of([&] { encode_jpeg(img, 101); }).find("quality 101"), std::string::npos);
  EXPECT_NE(error_of([&] { encode_jpeg(cv::Mat(4, 4, CV_32FC3), 90); }).find("8-bit"), std::string::npos);
  EXPECT_NE(error_of([&] { encode_jpeg(cv::Mat(4, 4, CV_8UC2), 90); }).find("channels"), std::string::npos);
  EXPECT_NE(error_of([&] { encode_png(cv::Mat(4, 4, CV_32FC1)); }).find("16-bit"), std::string::npos);
  EXPECT_NE(error_of([&] { encode_png(img, 10); }).find("compression 10"), std::string::npos);
}

// 32-bit BMP with colour masks (BI_BITFIELDS, as OpenCV 5 and Windows write BGRA) decodes
// when the masks are 8-bit BGR(A); any other placement is refused by name.
TEST(DataImage, BmpColourMasks) {
  cv::Mat bgra = testing::noise_image(9, 5, CV_8UC4, 3);
  std::vector<uint8_t> bmp = testing::encode(".bmp", bgra);
  ASSERT_GE(bmp.size(), 70u);
  ASSERT_EQ(bmp[30], 3) << "cv2 no longer writes BI_BITFIELDS: the case below needs another source";
  cv::Mat bgr;
  cv::cvtColor(bgra, bgr, cv::COLOR_BGRA2BGR);
  EXPECT_EQ(cv::norm(decode_image(bmp.data(), bmp.size(), "masks"), bgr, cv::NORM_INF), 0.0);
  const uint8_t rgb_masks[12] = {0xFF, 0, 0, 0, 0, 0xFF, 0, 0, 0, 0, 0xFF, 0};  // red 0xFF, green 0xFF00, blue 0xFF0000
  std::copy(rgb_masks, rgb_masks + 12, bmp.begin() + 54);
  EXPECT_NE(error_of([&] { decode_image(bmp.data(), bmp.size(), "masks"); }).find("masks other than 8-bit BGR(A)"),
            std::string::npos);
  std::vector<uint8_t> bmp24 = testing::encode(".bmp", bgr);
  bmp24[30] = 3;  // BI_BITFIELDS at 24 bits per pixel
  EXPECT_NE(error_of([&] { decode_image(bmp24.data(), bmp24.size(), "masks"); }).find("32-bit BGRA masks only"),
            std::string::npos);
}

// A small file that declares a huge image is refused from its header, before anything
// is allocated for it; OpenCV would decode (or try to decode) it at full size.
TEST(DataImage, DecompressionBombsAreRefusedFromTheHeader) {
  const std::vector<uint8_t> jpeg = testing::encode(".jpg", testing::noise_image(8, 8));
  const std::vector<uint8_t> png = testing::encode(".png", testing::noise_image(8, 8));
  const std::vector<uint8_t> bmp = testing::encode(".bmp", testing::noise_image(8, 8));
  const std::vector<std::pair<std::string, std::vector<uint8_t>>> bombs = {
      {"rec key 3", testing::jpeg_declaring(jpeg, 30000, 30000)},
      {"rec key 4", testing::png_declaring(png, 30000, 30000)},
      {"rec key 5", testing::bmp_declaring(bmp, 30000, 30000)},
      {"rec key 6", testing::jpeg_declaring(jpeg, 8193, 16)},    // one side over
      {"rec key 7", testing::png_declaring(png, 4097, 4096)},    // pixels over
      {"rec key 8", testing::png_declaring(png, 0x80000000u, 1)},  // not a PNG size
  };
  for (const auto& [where, bytes] : bombs) {
    SCOPED_TRACE(where);
    EXPECT_LT(bytes.size(), 2000u);
    ::testing::internal::CaptureStderr();
    const std::string msg = error_of([&] { decode_image(bytes.data(), bytes.size(), where); });
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
    EXPECT_EQ(msg.rfind(where + ": ", 0), 0u) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find("declares"), std::string::npos) << msg;
    EXPECT_EQ(error_of([&] { read_image_header(bytes.data(), bytes.size(), where); }), msg);
  }
  EXPECT_NE(error_of([&] { read_image_header(bombs[0].second.data(), bombs[0].second.size(), "x"); })
                .find("30000x30000 image, more than faceshard decodes (at most 8192 pixels a side and 16777216 pixels in all)"),
            std::string::npos);
  // At the limits: accepted by the header reader (the data then fails as truncated).
  const std::vector<uint8_t> edge = testing::png_declaring(png, 8192, 2048);
  EXPECT_EQ(read_image_header(edge.data(), edge.size(), "edge").width, 8192);
  EXPECT_NE(error_of([&] { decode_image(edge.data(), edge.size(), "edge"); }).find("edge: "), std::string::npos);
}

// A progressive JPEG written by libjpeg with one scan per AC coefficient and component:
// 191 scans, or 380 with successive approximation (first and refinement scans).
std::vector<uint8_t> jpeg_with_many_scans(const cv::Mat& bgr, bool refine) {
  jpeg_compress_struct c;
  jpeg_error_mgr e;
  c.err = jpeg_std_error(&e);
  jpeg_create_compress(&c);
  unsigned char* out = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &out, &size);
  c.image_width = JDIMENSION(bgr.cols);
  c.image_height = JDIMENSION(bgr.rows);
  c.input_components = 3;
  c.in_color_space = JCS_EXT_BGR;
  jpeg_set_defaults(&c);
  std::vector<jpeg_scan_info> scans = {{3, {0, 1, 2, 0}, 0, 0, 0, 0}};
  for (int al : refine ? std::vector<int>{1, 0} : std::vector<int>{0})
    for (int comp = 0; comp < 3; ++comp)
      for (int k = 1; k <= 63; ++k) scans.push_back({1, {comp, 0, 0, 0}, k, k, refine && al == 0 ? 1 : 0, al});
  c.scan_info = scans.data();
  c.num_scans = int(scans.size());
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(bgr.ptr<uint8_t>(int(c.next_scanline)));
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  std::vector<uint8_t> b(out, out + size);
  std::free(out);
  return b;
}

// A progressive JPEG of many tiny scans takes long to decode for its size: more than 256
// scans are refused while decoding; 191 decode as OpenCV decodes them.
TEST(DataImage, ProgressiveJpegScansAreLimited) {
  const cv::Mat bgr = testing::noise_image(64, 48);
  const std::vector<uint8_t> ok = jpeg_with_many_scans(bgr, false), many = jpeg_with_many_scans(bgr, true);
  const cv::Mat want = testing::cv2_imdecode(ok, testing::cv2::IMREAD_COLOR);
  ASSERT_EQ(want.size(), bgr.size());
  EXPECT_EQ(cv::norm(decode_image(ok.data(), ok.size(), "ok"), want, cv::NORM_INF), 0.0);
  EXPECT_FALSE(testing::cv2_imdecode(many, testing::cv2::IMREAD_COLOR).empty());  // valid, only slow
  EXPECT_EQ(error_of([&] { decode_image(many.data(), many.size(), "many"); }),
            "many: progressive JPEG has more than 256 scans");
}

// Truncated or corrupt data fails the decode with one line in faceshard's words; nothing
// from libjpeg, libpng or OpenCV reaches stderr. (OpenCV 4's cv::imdecode returned the
// truncated JPEG as an image, silently; the corrupt one only after printing libjpeg's warning.)
TEST(DataImage, CorruptAndTruncatedImagesFailWithoutLibraryText) {
  cv::Mat face = testing::noise_image(112, 112);
  cv::GaussianBlur(face, face, cv::Size(3, 3), 1);
  const std::vector<uint8_t> jpeg = testing::encode(".jpg", face, {testing::cv2::IMWRITE_JPEG_QUALITY, 90});
  const std::vector<uint8_t> progressive = testing::encode(".jpg", face, {testing::cv2::IMWRITE_JPEG_PROGRESSIVE, 1});
  const std::vector<uint8_t> png = testing::encode(".png", face);
  std::vector<uint8_t> stray = jpeg, flipped_png = png;
  for (size_t i = jpeg.size() / 2; i < jpeg.size() / 2 + 100; ++i) stray[i] ^= 0x55;
  for (size_t i = 100; i < 200; ++i) flipped_png[i] ^= 0x55;
  const std::vector<std::tuple<std::string, std::vector<uint8_t>, std::string>> cases = {
      {"jpeg third", testing::truncated(jpeg, jpeg.size() / 3), "truncated"},
      {"jpeg without its end", testing::truncated(jpeg, jpeg.size() - 2), "truncated"},
      {"progressive third", testing::truncated(progressive, progressive.size() / 3), "truncated"},
      {"jpeg header only", testing::truncated(jpeg, 200), "JPEG"},
      {"jpeg stray bytes", stray, "corrupt JPEG data"},
      {"png third", testing::truncated(png, png.size() / 3), "truncated"},
      {"png corrupt", flipped_png, "corrupt PNG data"},
      {"bmp cut", testing::truncated(testing::encode(".bmp", face), 3000), "past the end"},
      {"text", std::vector<uint8_t>{'h', 'e', 'l', 'l', 'o'}, "not a JPEG, PNG or BMP image"},
  };
  for (const auto& [where, bytes, expect] : cases) {
    SCOPED_TRACE(where);
    ::testing::internal::CaptureStderr();
    const std::string msg = error_of([&] { decode_image(bytes.data(), bytes.size(), where); });
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
    EXPECT_EQ(msg.rfind(where + ": ", 0), 0u) << msg;
    EXPECT_NE(msg.find(expect), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const char* lib : {"Corrupt JPEG data:", "Premature end", "libpng", "OpenCV", "Assertion"})
      EXPECT_EQ(msg.find(lib), std::string::npos) << msg;
  }
}

TEST(DataTransform, ExtraAugmentationsAreOffByDefault) {
  cv::Mat img(32, 32, CV_8UC3);
  cv::randu(img, 0, 256);
  std::mt19937_64 rng(1);
  cv::Mat same = img.clone();
  apply_extra_augment(same, ExtraAugment{}, rng);
  EXPECT_EQ(cv::norm(same, img, cv::NORM_INF), 0.0);
  ExtraAugment gray;
  gray.gray_prob = 1.0;
  apply_extra_augment(same, gray, rng);
  std::vector<cv::Mat> ch;
  cv::split(same, ch);
  EXPECT_EQ(cv::norm(ch[0], ch[1], cv::NORM_INF), 0.0);
  EXPECT_EQ(cv::norm(ch[1], ch[2], cv::NORM_INF), 0.0);
}

// ---------------------------------------------------------------------------------------
// Synthetic faces

double mean_abs(const cv::Mat& a, const cv::Mat& b) {
  cv::Mat d;
  cv::absdiff(a, b, d);
  const cv::Scalar m = cv::mean(d);
  return (m[0] + m[1] + m[2]) / 3;
}

// Raw pixels of a view at low resolution, as a unit vector (a crude "untrained model").
at::Tensor pixel_embedding(const cv::Mat& bgr) {
  cv::Mat s, f;
  cv::resize(bgr, s, cv::Size(14, 14), 0, 0, cv::INTER_AREA);
  s.convertTo(f, CV_32FC3, 1.0 / 255);
  at::Tensor t = torch::from_blob(f.data, {14 * 14 * 3}, torch::kFloat32).clone();
  t = t - t.mean();
  return t / t.norm();
}

TEST(DataSynth, FacesAreStructuredDeterministicAndSiblingsShareColours) {
  SynthFaceOptions o;
  o.family_size = 4;
  const SyntheticFaces faces(3, o);
  // Structured, not noise: neighbouring pixels of the canonical face are close.
  const cv::Mat f = faces.identity_image(0);
  EXPECT_LT(mean_abs(f.colRange(0, 111), f.colRange(1, 112)), 10.0);
  // Deterministic in (seed, identity, view).
  EXPECT_EQ(mean_abs(faces.view(4, 2), SyntheticFaces(3, o).view(4, 2)), 0.0);
  EXPECT_GT(mean_abs(faces.view(4, 2), SyntheticFaces(4, o).view(4, 2)), 1.0);
  EXPECT_GT(mean_abs(faces.view(4, 2), faces.view(4, 3)), 1.0);
  // Siblings (0..3) share their colours: the most frequent colour that is not the grey
  // background (the skin) is the same for siblings and differs between families, while
  // the faces themselves differ.
  auto skin = [&](uint64_t id) {
    const cv::Mat img = faces.identity_image(id);
    std::map<uint32_t, int> count;
    for (int y = 0; y < img.rows; ++y)
      for (int x = 0; x < img.cols; ++x) {
        const cv::Vec3b p = img.at<cv::Vec3b>(y, x);
        if (p == cv::Vec3b(128, 128, 128)) continue;
        count[uint32_t(p[0]) << 16 | uint32_t(p[1]) << 8 | p[2]]++;
      }
    return std::max_element(count.begin(), count.end(), [](auto& a, auto& b) { return a.second < b.second; })->first;
  };
  for (uint64_t i = 1; i < 4; ++i) {
    EXPECT_EQ(skin(i), skin(0)) << "sibling " << i;
    EXPECT_NE(skin(4 * i), skin(0)) << "family " << i;
    EXPECT_GT(mean_abs(faces.identity_image(0), faces.identity_image(i)), 2.0);
  }
}

// The written verification pairs are hard for raw pixels: a 10-fold threshold on pixel
// cosine distance stays near chance (the views have their own backgrounds and light, and
// the different pairs are siblings).
TEST(DataSynth, VerificationPairsAreNearChanceForRawPixels) {
  TempDir d;
  SynthDatasetSpec spec;
  spec.identities = 10;
  spec.images_per_identity = 1;
  spec.holdout_identities = 20;
  spec.pairs = 300;
  spec.seed = 5;
  write_synthetic_dataset(d.path, spec);
  const VerificationSet set = read_verification_bin(d / "synth.bin");
  ASSERT_EQ(set.num_pairs(), 300u);
  std::vector<at::Tensor> e1, e2;
  std::vector<bool> issame;
  for (size_t p = 0; p < set.num_pairs(); ++p) {
    e1.push_back(pixel_embedding(decode_image(set.images[2 * p].data(), set.images[2 * p].size(), "pair")));
    e2.push_back(pixel_embedding(decode_image(set.images[2 * p + 1].data(), set.images[2 * p + 1].size(), "pair")));
    issame.push_back(set.issame[p]);
  }
  const auto r = kfold_verification(pair_distances(torch::stack(e1), torch::stack(e2)), issame);
  std::printf("[synth] raw-pixel 10-fold accuracy on the pairs: %.3f +- %.3f\n", r.accuracy_mean, r.accuracy_std);
  EXPECT_LT(r.accuracy_mean, 0.7);
}

SynthDatasetSpec small_spec(uint64_t ids, uint64_t per_id, uint64_t pairs, int size = 112) {
  SynthDatasetSpec s;
  s.identities = ids;
  s.images_per_identity = per_id;
  s.holdout_identities = 4;
  s.pairs = pairs;
  s.seed = 1;
  s.face.image_size = size;
  return s;
}

TEST(DataSynth, WritesInsightFaceRecAndBin) {
  TempDir d;
  write_synthetic_dataset(d.path, small_spec(6, 5, 10));
  const RecordIODataset ds(d / "train.rec", d / "train.idx");
  EXPECT_EQ(ds.size(), 30u);
  EXPECT_EQ(ds.num_classes(), 6);
  RawSample s;
  for (uint64_t i = 0; i < ds.size(); ++i) {
    ds.read(i, s);
    EXPECT_EQ(s.label, int64_t(i / 5));
    const cv::Mat m = decode_image(s.bytes.data(), s.bytes.size(), ds.describe(i));
    EXPECT_EQ(m.rows, 112);
    EXPECT_EQ(m.cols, 112);
  }
  const VerificationSet v = read_verification_bin(d / "synth.bin");
  EXPECT_EQ(v.num_pairs(), 10u);
  EXPECT_EQ(std::count(v.issame.begin(), v.issame.end(), true), 5);
  for (const auto& img : v.images) EXPECT_EQ(decode_image(img.data(), img.size(), "bin").rows, 112);
  // Python reads the .bin as insightface does.
  const std::string cmd = std::string("\"") + FACESHARD_PYTHON +
                          "\" -c \"import pickle,sys; b,s=pickle.load(open(sys.argv[1],'rb')); "
                          "sys.exit(0 if len(b)==20 and len(s)==10 and all(x[:2]==b'\\xff\\xd8' for x in b) else 3)\" " +
                          d / "synth.bin";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  EXPECT_FALSE(fs::exists(d / "train.rec.tmp." + std::to_string(::getpid())));
}

// ---------------------------------------------------------------------------------------
// Loader

// The expected network input of one record, computed without the loader: decode with
// OpenCV, BGR->RGB, (x/255 - 0.5)/0.5, CHW.
torch::Tensor reference_input(const std::vector<uint8_t>& jpeg, bool flip) {
  cv::Mat bgr = testing::cv2_imdecode(jpeg.data(), jpeg.size(), testing::cv2::IMREAD_COLOR);
  cv::Mat rgb;
  cv::cvtColor(bgr, rgb, cv::COLOR_BGR2RGB);
  if (flip) cv::flip(rgb, rgb, 1);
  torch::Tensor t = torch::from_blob(rgb.data, {rgb.rows, rgb.cols, 3}, torch::kUInt8).clone();
  return ((t.permute({2, 0, 1}).to(torch::kFloat32) / 255.0 - 0.5) / 0.5).contiguous();
}

std::vector<Batch> run_epoch(DataLoader& loader, uint64_t epoch, uint64_t start = 0) {
  loader.start_epoch(epoch, start);
  std::vector<Batch> out;
  while (auto b = loader.next()) out.push_back(std::move(*b));
  return out;
}

TEST(DataLoader, BatchesMatchIndependentDecodeAndSamplerOrder) {
  TempDir d;
  write_synthetic_dataset(d.path, small_spec(8, 6, 0));
  auto ds = std::make_shared<RecordIODataset>(d / "train.rec", d / "train.idx");
  const DistributedSampler sampler(ds->size(), 1, 0, 3);
  LoaderOptions o;
  o.batch_size = 8;
  o.num_workers = 2;
  o.num_classes = 8;
  DataLoader loader(ds, sampler, o);
  ASSERT_EQ(loader.batches_per_epoch(), 6u);
  const auto batches = run_epoch(loader, 1);
  ASSERT_EQ(batches.size(), 6u);
  const auto order = sampler.indices(1);
  // Independent read path: the .idx, the raw record and the 24-byte header by hand.
  const IndexedRecordIO rec(d / "train.rec", d / "train.idx");
  int flips = 0, plain = 0;
  for (size_t b = 0; b < batches.size(); ++b) {
    ASSERT_EQ(batches[b].images.sizes(), (std::vector<int64_t>{8, 3, 112, 112}));
    ASSERT_EQ(batches[b].labels.dtype(), torch::kInt64);
    EXPECT_EQ(batches[b].index, b);
    for (int j = 0; j < 8; ++j) {
      const uint64_t key = order[b * 8 + j] + 1;  // image keys are 1..N
      std::vector<uint8_t> raw;
      rec.read(key, raw);
      float label;
      std::memcpy(&label, raw.data() + 4, 4);
      EXPECT_EQ(batches[b].labels[j].item<int64_t>(), int64_t(label));
      const std::vector<uint8_t> jpeg(raw.begin() + 24, raw.end());
      const torch::Tensor got = batches[b].images[j];
      const double d0 = (got - reference_input(jpeg, false)).abs().max().item<double>();
      const double d1 = (got - reference_input(jpeg, true)).abs().max().item<double>();
      EXPECT_LT(std::min(d0, d1), 1e-6) << "batch " << b << " sample " << j;
      (d1 < d0 ? flips : plain)++;
    }
  }
  EXPECT_GT(flips, 5);
  EXPECT_GT(plain, 5);
}

TEST(DataLoader, DeterministicAcrossWorkerCountsAndResumable) {
  TempDir d;
  write_synthetic_dataset(d.path, small_spec(5, 8, 0));
  auto ds = std::make_shared<RecordIODataset>(d / "train.rec", d / "train.idx");
  LoaderOptions o;
  o.batch_size = 6;
  o.seed = 9;
  o.num_workers = 1;
  DataLoader one(ds, DistributedSampler(ds->size(), 1, 0, 4), o);
  o.num_workers = 3;
  o.prefetch_batches = 2;
  DataLoader three(ds, DistributedSampler(ds->size(), 1, 0, 4), o);
  const auto a = run_epoch(one, 2), b = run_epoch(three, 2);
  ASSERT_EQ(a.size(), 6u);  // 40 / 6, last partial batch dropped
  ASSERT_EQ(b.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].images, b[i].images)) << i;
    EXPECT_TRUE(torch::equal(a[i].labels, b[i].labels)) << i;
  }
  const auto resumed = run_epoch(three, 2, 4);
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_TRUE(torch::equal(resumed[0].images, a[4].images));
  EXPECT_TRUE(torch::equal(resumed[1].labels, a[5].labels));
  const auto other = run_epoch(one, 3);
  EXPECT_FALSE(torch::equal(other[0].images, a[0].images));
  // Abandoning an epoch midway and starting another is fine.
  three.start_epoch(0);
  ASSERT_TRUE(three.next().has_value());
  EXPECT_EQ(run_epoch(three, 2).size(), 6u);
}

TEST(DataLoader, SyntheticDatasetSkipsDecoding) {
  auto ds = std::make_shared<SyntheticDataset>(64, 10, 112, 5);
  LoaderOptions o;
  o.batch_size = 16;
  o.flip = false;
  DataLoader loader(ds, DistributedSampler(64, 2, 1, 0), o);
  const auto batches = run_epoch(loader, 0);
  ASSERT_EQ(batches.size(), 2u);
  RawSample s;
  ds->read(0, s);
  const torch::Tensor px = torch::from_blob(s.bytes.data(), {112, 112, 3}, torch::kUInt8);
  const torch::Tensor want = (px.permute({2, 0, 1}).to(torch::kFloat32) / 255.0 - 0.5) / 0.5;
  EXPECT_LT((batches[0].images[3] - want).abs().max().item<double>(), 1e-6);
  const auto order = DistributedSampler(64, 2, 1, 0).indices(0);
  EXPECT_EQ(batches[1].labels[2].item<int64_t>(), int64_t(order[18] % 10));
}

// Raw 8x8 pixels that count reads, to see how far ahead of the consumer the workers get.
class CountingDataset : public Dataset {
 public:
  explicit CountingDataset(uint64_t n) : n_(n) {}
  uint64_t size() const override { return n_; }
  int64_t num_classes() const override { return 4; }
  void read(uint64_t index, RawSample& out) const override {
    ++reads;
    out.label = int64_t(index % 4);
    out.bytes.assign(8 * 8 * 3, uint8_t(index));
  }
  std::string describe(uint64_t index) const override { return detail::concat("counting sample ", index); }
  bool raw_pixels() const override { return true; }
  int raw_size() const override { return 8; }
  mutable std::atomic<uint64_t> reads{0};

 private:
  uint64_t n_;
};

// Workers claim batch b only while b < (batches handed out) + prefetch_batches, and a batch
// being built counts as claimed: so however many workers there are, at most
// prefetch_batches batches are built (or being built) ahead of the consumer.
TEST(DataLoader, PrefetchQueueIsBoundedForASlowConsumer) {
  const int64_t B = 4;
  const int prefetch = 2;
  auto ds = std::make_shared<CountingDataset>(B * 10);
  LoaderOptions o;
  o.batch_size = B;
  o.num_workers = 4;  // more workers than prefetch slots
  o.prefetch_batches = prefetch;
  o.image_size = 8;
  o.flip = false;
  DataLoader loader(ds, DistributedSampler(uint64_t(B * 10), 1, 0, 0), o);
  auto settle = [&](uint64_t want) {
    // Wait until every worker is blocked with no batch in flight: from then on nothing is
    // read until the consumer takes a batch, so the count is final.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((ds->reads.load() < want || loader.idle_workers() < o.num_workers) &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(loader.idle_workers(), o.num_workers) << "the workers never settled";
    return ds->reads.load();
  };
  loader.start_epoch(0);
  EXPECT_EQ(settle(uint64_t(B * prefetch)), uint64_t(B * prefetch));
  for (uint64_t consumed = 1; consumed <= 10; ++consumed) {
    ASSERT_TRUE(loader.next().has_value());
    const uint64_t want = uint64_t(B) * std::min<uint64_t>(consumed + prefetch, 10);
    EXPECT_EQ(settle(want), want) << "after " << consumed << " batches";
  }
  EXPECT_FALSE(loader.next().has_value());
}

// A .rec whose image records 1..n have labels i % classes; `bad` keys hold garbage.
// `labels` overrides the label of some keys.
void write_rec_with_bad(const std::string& dir, int n, int classes, const std::set<int>& bad, int size = 112,
                        const std::map<int, float>& labels = {}, const std::map<int, std::vector<uint8_t>>& images = {}) {
  fs::create_directories(dir);
  const SyntheticFaces faces(0, [&] {
    SynthFaceOptions f;
    f.image_size = size;
    return f;
  }());
  RecordIOWriter w(dir + "/train.rec", dir + "/train.idx");
  // No header record: every key of the .idx is an image (like a shuffled rec).
  for (int k = 0; k < n; ++k) {
    std::vector<uint8_t> img = faces.view_jpeg(uint64_t(k % classes), uint64_t(k));
    if (bad.count(k)) img = std::vector<uint8_t>(300, uint8_t(k));
    if (images.count(k)) img = images.at(k);
    const float label = labels.count(k) ? labels.at(k) : float(k % classes);
    w.write(uint64_t(k), pack_image_record(label, {}, 0, 0, img.data(), img.size()));
  }
  w.commit();
}

TEST(DataLoader, BadRecordsAreReplacedCountedAndLimited) {
  TempDir d;
  const std::set<int> bad = {3, 17, 30};
  write_rec_with_bad(d.path, 40, 4, bad);
  auto ds = open_dataset(d.path);
  ASSERT_EQ(ds->size(), 40u);
  LoaderOptions o;
  o.batch_size = 10;
  o.num_workers = 2;
  o.num_classes = 4;
  o.max_bad_fraction = 0.1;  // 4 of 40 allowed
  {
    DataLoader loader(ds, DistributedSampler(40, 1, 0, 1), o);
    const auto batches = run_epoch(loader, 0);
    EXPECT_EQ(batches.size(), 4u);
    EXPECT_EQ(loader.bad_samples(), 3u);  // every sample was visited once
    // Same labels as the sampler order, except at the bad positions (replaced).
    const auto order = DistributedSampler(40, 1, 0, 1).indices(0);
    for (int p = 0; p < 40; ++p) {
      if (!bad.count(int(order[p]))) {
        EXPECT_EQ(batches[p / 10].labels[p % 10].item<int64_t>(), int64_t(order[p] % 4));
      }
    }
  }
  o.max_bad_fraction = 0.05;  // 2 of 40: the third bad record stops the run
  DataLoader strict(ds, DistributedSampler(40, 1, 0, 1), o);
  const std::string msg = error_of([&] { run_epoch(strict, 0); });
  EXPECT_NE(msg.find("max_bad_fraction"), std::string::npos) << msg;
  EXPECT_NE(msg.find("train.rec: key"), std::string::npos) << msg;
}

// Images that decode with a warning (truncated, corrupt) or declare more than the limits
// (decompression bombs) are bad records: replaced, counted against max_bad_fraction; the
// one past the limit stops the run naming the record and why (and no warning line).
TEST(DataLoader, TruncatedCorruptAndBombImagesAreBadRecords) {
  const SyntheticFaces faces(0);
  const std::vector<uint8_t> face = faces.view_jpeg(1, 1);
  std::vector<uint8_t> corrupt = face;
  for (size_t i = face.size() / 2; i < face.size() / 2 + 64; ++i) corrupt[i] ^= 0x55;
  const std::vector<uint8_t> png = testing::encode(".png", testing::noise_image(112, 112));
  const std::map<int, std::vector<uint8_t>> images = {
      {4, testing::truncated(face, face.size() / 3)},
      {9, corrupt},
      {13, testing::jpeg_declaring(face, 30000, 30000)},
      {21, testing::png_declaring(png, 30000, 30000)},
      {33, testing::truncated(png, png.size() / 2)},
  };
  TempDir d;
  write_rec_with_bad(d.path, 40, 4, {}, 112, {}, images);
  auto ds = open_dataset(d.path);
  LoaderOptions o;
  o.batch_size = 10;
  o.num_workers = 2;
  o.num_classes = 4;
  o.max_bad_fraction = 0.15;  // 6 of 40
  {
    DataLoader loader(ds, DistributedSampler(40, 1, 0, 1), o);
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(run_epoch(loader, 0).size(), 4u);
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(loader.bad_samples(), 5u);
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 5) << err;  // one warning per record
    EXPECT_NE(err.find("train.rec: key 13 "), std::string::npos) << err;
    EXPECT_NE(err.find("30000x30000"), std::string::npos) << err;
    for (const char* lib : {"Corrupt JPEG data:", "Premature end", "libpng", "OpenCV"})
      EXPECT_EQ(err.find(lib), std::string::npos) << err;
  }
  o.max_bad_fraction = 0.0;
  DataLoader strict(ds, DistributedSampler(40, 1, 0, 1), o);
  ::testing::internal::CaptureStderr();
  const std::string msg = error_of([&] { run_epoch(strict, 0); });
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_NE(msg.find("max_bad_fraction"), std::string::npos) << msg;
  EXPECT_NE(msg.find("train.rec: key "), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// A label that is not a class index is a mislabelled data set, not a bad image: it stops
// the run even when bad samples are tolerated, naming the file, the key and the label.
TEST(DataLoader, NonClassLabelsStopTheRunInsteadOfBeingReplaced) {
  for (const float label : {-1.f, 2.5f, std::nanf("")}) {
    TempDir d;
    write_rec_with_bad(d.path, 12, 3, {}, 112, {{7, label}});
    auto ds = open_dataset(d.path);
    LoaderOptions o;
    o.batch_size = 4;
    o.num_classes = 3;
    o.max_bad_fraction = 1.0;  // every decode failure would be replaced
    DataLoader loader(ds, DistributedSampler(12, 1, 0, 0), o);
    const std::string msg = error_of([&] { run_epoch(loader, 0); });
    EXPECT_NE(msg.find("train.rec: key 7 "), std::string::npos) << msg;
    EXPECT_NE(msg.find("label " + detail::concat(label) + " is not a class index"), std::string::npos) << msg;
    EXPECT_EQ(loader.bad_samples(), 0u);
    // Other readers of the data set still get a faceshard::Error.
    RawSample s;
    EXPECT_THROW(ds->read(7, s), Error);
  }
}

// Each rank reads 1/world of the data set per epoch; the bad-sample limit is a fraction
// of that share, not of the whole set.
TEST(DataLoader, BadSampleLimitIsPerRankShare) {
  const auto order = DistributedSampler(40, 2, 0, 5).indices(0);  // rank 0's 20 samples
  const std::set<int> bad = {int(order[0]), int(order[5]), int(order[11])};
  TempDir d;
  write_rec_with_bad(d.path, 40, 4, bad);
  auto ds = open_dataset(d.path);
  LoaderOptions o;
  o.batch_size = 10;
  o.num_classes = 4;
  o.max_bad_fraction = 0.1;  // 2 of rank 0's 20 (but 4 of the 40 in the data set)
  DataLoader strict(ds, DistributedSampler(40, 2, 0, 5), o);
  const std::string msg = error_of([&] { run_epoch(strict, 0); });
  EXPECT_NE(msg.find("of this rank's 20 samples"), std::string::npos) << msg;
  EXPECT_NE(msg.find("max_bad_fraction"), std::string::npos) << msg;
  o.max_bad_fraction = 0.15;  // 3 of 20: accepted, in this epoch and the next
  DataLoader ok(ds, DistributedSampler(40, 2, 0, 5), o);
  EXPECT_EQ(run_epoch(ok, 0).size(), 2u);
  EXPECT_EQ(ok.bad_samples(), 3u);
  EXPECT_EQ(run_epoch(ok, 1).size(), 2u);
}

TEST(DataLoader, ClearErrorsForLabelsSizesAndMissingIndex) {
  TempDir d;
  write_rec_with_bad(d / "a", 12, 6, {});
  auto ds = open_dataset(d / "a");
  LoaderOptions o;
  o.batch_size = 4;
  o.num_classes = 3;  // labels go up to 5
  DataLoader loader(ds, DistributedSampler(12, 1, 0, 0), o);
  std::string msg = error_of([&] { run_epoch(loader, 0); });
  EXPECT_NE(msg.find("out of range [0, 3)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("key"), std::string::npos) << msg;

  write_rec_with_bad(d / "b", 8, 2, {}, 64);
  o.num_classes = 2;
  DataLoader small(open_dataset(d / "b"), DistributedSampler(8, 1, 0, 0), o);
  msg = error_of([&] { run_epoch(small, 0); });
  EXPECT_NE(msg.find("64x64, expected 112x112"), std::string::npos) << msg;

  fs::remove(d / "a/train.idx");
  msg = error_of([&] { open_dataset(d / "a"); });
  EXPECT_NE(msg.find("train.idx"), std::string::npos) << msg;

  // A data set that declares more classes than the config is refused up front.
  write_synthetic_dataset(d / "c", small_spec(5, 2, 0));
  o.num_classes = 4;
  msg = error_of([&] { DataLoader l(open_dataset(d / "c"), DistributedSampler(10, 1, 0, 0), o); });
  EXPECT_NE(msg.find("5 classes"), std::string::npos) << msg;
}

// The data.* keys the loader depends on: worker count 1..256 (the loader needs a thread),
// and the optional extra augmentations, off unless asked for, each a probability.
TEST(DataConfig, WorkersAndAugmentProbabilities) {
  const std::string base = "data: {rec: synthetic, num_classes: 10}\n";
  const Config def = load_config_text(base, "d.yaml");
  EXPECT_EQ(def.data.augment_gray_prob, 0.0);
  EXPECT_EQ(def.data.augment_blur_prob, 0.0);
  EXPECT_EQ(def.data.augment_downscale_prob, 0.0);
  const Config on = load_config_text(base, "d.yaml",
                                     {"data.augment.gray_prob=0.2", "data.augment.blur_prob=1",
                                      "data.augment.downscale_prob=0.05", "data.num_workers=256"});
  EXPECT_EQ(on.data.augment_gray_prob, 0.2);
  EXPECT_EQ(on.data.augment_blur_prob, 1.0);
  EXPECT_EQ(on.data.augment_downscale_prob, 0.05);
  EXPECT_EQ(on.data.num_workers, 256);
  EXPECT_NE(config_to_yaml(on).find("downscale_prob: 0.05"), std::string::npos) << config_to_yaml(on);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"data.num_workers=0", "key 'data.num_workers': must be >= 1"},
      {"data.num_workers=257", "key 'data.num_workers': must be <= 256"},
      {"data.augment.gray_prob=1.5", "key 'data.augment.gray_prob': must be <= 1"},
      {"data.augment.blur_prob=-0.1", "key 'data.augment.blur_prob': must be >= 0"},
      {"data.augment.downscale_prob=x", "key 'data.augment.downscale_prob': expected a number"},
      {"data.augment.sharpen_prob=0.1", "unknown key 'data.augment.sharpen_prob'"},
  };
  for (const auto& [set, want] : bad) {
    const std::string msg = error_of([&] { load_config_text(base, "d.yaml", {set}); });
    EXPECT_NE(msg.find(want), std::string::npos) << set << ": " << msg;
  }
}

TEST(DataLoader, ImageFolderDataset) {
  TempDir d;
  const SyntheticFaces faces(2);
  for (const char* who : {"bob", "alice"}) {
    fs::create_directories(d / who);
    for (int i = 0; i < 3; ++i) spit(d / (std::string(who) + "/" + std::to_string(i) + ".jpg"), faces.view_jpeg(who[0], i));
  }
  fs::create_directories(d / "empty");
  spit(d / "alice/notes.txt", {1, 2, 3});
  // An empty identity folder is a problem (as faceshard-pack says); skip_bad leaves it out.
  EXPECT_NE(testing::error_of([&] { ImageFolderDataset refused(d.path); }).find("empty identity folder"), std::string::npos);
  ImageFolderOptions skip;
  skip.skip_bad = true;
  skip.report = false;
  const ImageFolderDataset ds(d.path, skip);
  EXPECT_EQ(ds.size(), 6u);
  EXPECT_EQ(ds.class_names(), (std::vector<std::string>{"alice", "bob"}));
  EXPECT_EQ(ds.label(0), 0);
  EXPECT_EQ(ds.label(5), 1);
  RawSample s;
  ds.read(4, s);
  EXPECT_EQ(s.bytes, slurp(d / "bob/1.jpg"));
  LoaderOptions o;
  o.batch_size = 3;
  DataLoader loader(open_dataset(d.path, 1000, 1000000, default_record_index_options(), skip),
                    DistributedSampler(6, 1, 0, 0), o);
  EXPECT_EQ(run_epoch(loader, 0).size(), 2u);
}

// The GPU path (pinned batches, side-stream copy); skips cleanly without a GPU.
TEST(DataLoader, CudaCopyMatchesCpuBatches) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  TempDir d;
  write_synthetic_dataset(d.path, small_spec(4, 8, 0));
  auto ds = open_dataset(d.path);
  LoaderOptions o;
  o.batch_size = 8;
  DataLoader cpu(ds, DistributedSampler(32, 1, 0, 0), o);
  o.device = torch::Device(torch::kCUDA, 0);
  DataLoader gpu(ds, DistributedSampler(32, 1, 0, 0), o);
  const auto a = run_epoch(cpu, 1), b = run_epoch(gpu, 1);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(b[i].images.is_cuda());
    EXPECT_TRUE(torch::equal(a[i].images, b[i].images.cpu()));
    EXPECT_TRUE(torch::equal(a[i].labels, b[i].labels.cpu()));
  }
}

// ---------------------------------------------------------------------------------------
// The binaries

struct Ran {
  int code = -1;
  std::string output;
};
Ran run_bin(const std::string& name, const std::string& args) {
  const std::string bin = std::string(FACESHARD_BIN_DIR) + "/" + name;
  const std::string out = (fs::temp_directory_path() / ("fs_data_out_" + std::to_string(::getpid()))).string();
  const std::string cmd = "\"" + bin + "\" " + args + " > \"" + out + "\" 2>&1";
  const int st = std::system(cmd.c_str());
  Ran r;
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  const auto b = slurp(out);
  r.output.assign(b.begin(), b.end());
  fs::remove(out);
  return r;
}
// The tools are built with faceshard_tests (a dependency in tests/CMakeLists.txt), so a
// missing binary is a failure, not a reason to skip.
bool have_bin(const std::string& name) { return fs::exists(std::string(FACESHARD_BIN_DIR) + "/" + name); }

TEST(DataTools, PackRoundTripIsByteIdentical) {
  ASSERT_TRUE(have_bin("faceshard-pack")) << "faceshard-pack missing from " << FACESHARD_BIN_DIR;
  TempDir d;
  const SyntheticFaces faces(8);
  std::vector<std::pair<std::string, int64_t>> files;  // sorted order, class
  const char* ids[] = {"id_a", "id_b", "id_c"};
  for (int c = 0; c < 3; ++c) {
    fs::create_directories(d / (std::string("in/") + ids[c]));
    for (int i = 0; i < 2 + c; ++i) {
      const std::string p = d / (std::string("in/") + ids[c] + "/img" + std::to_string(i) + ".jpg");
      spit(p, faces.view_jpeg(c, i));
      files.push_back({p, c});
    }
  }
  // An "image" whose bytes hold the magic word at 4-byte aligned payload offsets (the
  // 24-byte header keeps file offsets aligned): the record is split and re-joined.
  {
    std::vector<uint8_t> b(64, 0x55);
    const uint8_t magic[4] = {0x0a, 0x23, 0xd7, 0xce};
    for (size_t at : {0, 8, 12, 60}) std::memcpy(b.data() + at, magic, 4);
    const std::string p = d / "in/id_b/zz_magic.jpg";
    spit(p, b);
    files.insert(files.begin() + 5, {p, 1});
  }
  fs::create_directories(d / "out");
  // The magic-word "image" is no image: the default check refuses it, naming it...
  Ran r = run_bin("faceshard-pack", "pack " + d / "in" + " " + d / "out/train");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("zz_magic.jpg: not a JPEG, PNG or BMP image"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(d / "out/train.rec"));
  // ... and --no-check stores whatever bytes it is given.
  r = run_bin("faceshard-pack", "pack " + d / "in" + " " + d / "out/train --no-check");
  ASSERT_EQ(r.code, 0) << r.output;
  const RecordIODataset ds(d / "out/train.rec", d / "out/train.idx");
  ASSERT_EQ(ds.size(), files.size());
  EXPECT_EQ(ds.num_classes(), 3);
  RawSample s;
  for (uint64_t i = 0; i < ds.size(); ++i) {
    ds.read(i, s);
    EXPECT_EQ(s.bytes, slurp(files[i].first)) << files[i].first;
    EXPECT_EQ(s.label, files[i].second) << files[i].first;
  }
  // The split really happened: the raw file holds more record headers than records.
  uint64_t magics = 0;
  const auto raw = slurp(d / "out/train.rec");
  for (size_t i = 0; i + 4 <= raw.size(); i += 4) magics += (raw[i] == 0x0a && raw[i + 1] == 0x23 && raw[i + 2] == 0xd7 && raw[i + 3] == 0xce);
  EXPECT_EQ(magics, 1 + files.size() + 3 + 4);  // header, images, identities, 4 extra parts

  r = run_bin("faceshard-pack", "verify " + d / "out/train.rec");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("OK"), std::string::npos);
  r = run_bin("faceshard-pack", "list " + d / "out/train.rec --limit 3");
  EXPECT_EQ(r.code, 0) << r.output;
  r = run_bin("faceshard-pack", "unpack " + d / "out/train.rec " + d / "unpacked");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(slurp(d / "unpacked/1/6.jpg"), slurp(files[5].first));
  // A lost .idx is rebuilt identically by scanning the .rec.
  const auto idx = slurp(d / "out/train.idx");
  fs::remove(d / "out/train.idx");
  r = run_bin("faceshard-pack", "index " + d / "out/train.rec");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(slurp(d / "out/train.idx"), idx);

  // Errors: one line, exit 1 for corrupt data, 2 for usage.
  auto bytes = raw;
  bytes[bytes.size() / 2] ^= 0xff;
  bytes.resize(bytes.size() - 5);
  spit(d / "out/train.rec", bytes);
  r = run_bin("faceshard-pack", "verify " + d / "out/train.rec");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("faceshard-pack: error: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train.rec"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  EXPECT_EQ(run_bin("faceshard-pack", "frobnicate").code, 2);
  EXPECT_EQ(run_bin("faceshard-pack", "verify " + d / "nope.rec").code, 2);
}

// Identity records must give sorted, disjoint image ranges; verify names the record that
// breaks the order.
TEST(DataTools, PackVerifyChecksIdentityRangesAreSortedAndDisjoint) {
  ASSERT_TRUE(have_bin("faceshard-pack")) << "faceshard-pack missing from " << FACESHARD_BIN_DIR;
  TempDir d;
  const SyntheticFaces faces(1);
  // Header (images [1, 5), identities [5, 8)), 4 images, then the identity records.
  auto write = [&](const std::string& name, const std::vector<std::pair<float, float>>& ranges) {
    RecordIOWriter w(d / (name + ".rec"), d / (name + ".idx"));
    w.write(0, pack_image_record(0.f, {5.f, 8.f}, 0, 0, nullptr, 0));
    for (int k = 1; k < 5; ++k) {
      const std::vector<uint8_t> img = faces.view_jpeg(uint64_t(k / 3), uint64_t(k));
      w.write(uint64_t(k), pack_image_record(float(k / 3), {}, 0, 0, img.data(), img.size()));
    }
    for (size_t c = 0; c < ranges.size(); ++c) {
      w.write(5 + c, pack_image_record(0.f, {ranges[c].first, ranges[c].second}, 0, 0, nullptr, 0));
    }
    w.commit();
  };
  write("good", {{1, 3}, {3, 3}, {3, 5}});  // an empty range in between is fine
  Ran r = run_bin("faceshard-pack", "verify " + d / "good.rec");
  EXPECT_EQ(r.code, 0) << r.output;
  write("overlap", {{1, 3}, {2, 5}, {5, 5}});
  r = run_bin("faceshard-pack", "verify " + d / "overlap.rec");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("overlap.rec: key 6: identity range [2, 5) starts before the end (3) of the range of key 5"),
            std::string::npos)
      << r.output;
  write("unsorted", {{3, 5}, {1, 3}, {5, 5}});
  r = run_bin("faceshard-pack", "verify " + d / "unsorted.rec");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("unsorted.rec: key 6: identity range [1, 3)"), std::string::npos) << r.output;
}

TEST(DataTools, SynthWritesAVerifiableDataSet) {
  ASSERT_TRUE(have_bin("faceshard-synth") && have_bin("faceshard-pack")) << "tools missing from " << FACESHARD_BIN_DIR;
  TempDir d;
  Ran r = run_bin("faceshard-synth", "--output " + d / "s --identities 12 --images 6 --holdout 4 --pairs 20 --seed 3");
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_bin("faceshard-pack", "verify " + d / "s/train.rec --decode");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("72 images, 12 identities"), std::string::npos) << r.output;
  EXPECT_EQ(read_verification_bin(d / "s/synth.bin").num_pairs(), 20u);
  EXPECT_EQ(run_bin("faceshard-synth", "--output " + d / "t --identities abc").code, 2);
  EXPECT_EQ(run_bin("faceshard-synth", "--help").code, 0);
  EXPECT_FALSE(fs::exists(d / "t/train.rec"));
}

TEST(DataTools, BenchDataModeReadsEveryImageForEachWorkerCount) {
  ASSERT_TRUE(have_bin("faceshard-bench")) << "faceshard-bench missing from " << FACESHARD_BIN_DIR;
  TempDir d;
  write_synthetic_dataset(d / "s", small_spec(5, 8, 0));  // 40 images
  Ran r = run_bin("faceshard-bench", "--mode data --data " + d / "s --batch 8 --workers 1,2,1 --epochs 2 --json " +
                                         d / "bench.json");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = slurp(d / "bench.json");
  const std::string json(j.begin(), j.end());
  // Worker counts 1 and 2 (the repeated 1 is measured once), each 2 epochs x 5 batches x 8.
  EXPECT_NE(json.find("\"cores\":"), std::string::npos) << json;
  EXPECT_NE(json.find("\"images\":40,"), std::string::npos) << json;
  EXPECT_NE(json.find("{\"workers\":1,"), std::string::npos) << json;
  EXPECT_NE(json.find("{\"workers\":2,"), std::string::npos) << json;
  size_t count = 0;
  for (size_t p = json.find("\"images\":80,"); p != std::string::npos; p = json.find("\"images\":80,", p + 1)) ++count;
  EXPECT_EQ(count, 3u) << json;  // and the baseline over the same images
  EXPECT_NE(json.find(",\"baseline\":{\"what\":\"decode+normalise only\",\"threads\":1,\"images_per_s\":"),
            std::string::npos)
      << json;
  EXPECT_NE(r.output.find("decode+normalise only"), std::string::npos) << r.output;
  EXPECT_EQ(run_bin("faceshard-bench", "--mode data --data " + d / "s --workers 0").code, 2);
  EXPECT_EQ(run_bin("faceshard-bench", "--mode data --data " + d / "s --batch 41").code, 2);
  EXPECT_EQ(run_bin("faceshard-bench", "--mode nothing").code, 2);
}

}  // namespace
}  // namespace faceshard
