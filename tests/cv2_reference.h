// OpenCV's own image codecs as the tests' reference, from Python's cv2 (the opencv-python
// wheel in the project's Python, tests/test_paths.h): the test fixtures in every format and
// variant (JPEG baseline/progressive/optimised/restart markers, PNG 8/16-bit grey/alpha,
// BMP), and the pixels cv::imdecode gives, against which faceshard's own decoders
// (data/image_codec) and encoders (data/image_encode) are checked. faceshard itself links
// no OpenCV codec module. One Python process per test process serves every call over a
// pipe (started at the first call).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <opencv2/core.hpp>

namespace faceshard::testing {

// cv2's flag values (opencv2/imgcodecs.hpp).
namespace cv2 {
constexpr int IMREAD_UNCHANGED = -1, IMREAD_GRAYSCALE = 0, IMREAD_COLOR = 1;
constexpr int IMWRITE_JPEG_QUALITY = 1, IMWRITE_JPEG_PROGRESSIVE = 2, IMWRITE_JPEG_OPTIMIZE = 3,
              IMWRITE_JPEG_RST_INTERVAL = 4, IMWRITE_PNG_COMPRESSION = 16;
}  // namespace cv2

// cv2.imencode(ext, m, params): the encoded bytes. Throws std::runtime_error when cv2 fails.
std::vector<uint8_t> cv2_imencode(const std::string& ext, const cv::Mat& m, const std::vector<int>& params = {});
// cv2.imdecode(bytes, flags) / cv2.imread(path, flags): an empty Mat where cv2 returns None.
cv::Mat cv2_imdecode(const std::vector<uint8_t>& bytes, int flags);
cv::Mat cv2_imdecode(const uint8_t* data, size_t size, int flags);
cv::Mat cv2_imread(const std::string& path, int flags);

}  // namespace faceshard::testing
