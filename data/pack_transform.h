// What faceshard-pack does to photos that are not 112x112 aligned crops before it packs
// them: a resize of crops of another size (--resize N --fit pad|center|stretch), or the
// alignment of a face to insightface's 112x112 template from five landmarks listed in a
// text file (--landmarks FILE, data/face_align.h). The result is stored as JPEG.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <opencv2/core.hpp>

#include "data/pack_source.h"

namespace faceshard {

// How a crop of another shape becomes size x size.
//   pad:     scaled so that its longer side is `size` (aspect ratio kept), centred on a black
//            square: a square crop is only scaled; a 96x112 crop (insightface's older 112x96
//            alignment) gains 8 black columns on each side and is the ArcFace 112x112 layout.
//   center:  scaled so that its shorter side is `size` (aspect ratio kept), the middle
//            size x size cut out: what overflows the longer side is lost.
//   stretch: each side scaled to `size` on its own (the aspect ratio changes).
enum class FitMode { pad, center, stretch };
FitMode parse_fit_mode(const std::string& text);  // usage error naming --fit
const char* fit_mode_name(FitMode mode);

// bgr (any size) as size x size. Shrinking uses area averaging (cv::INTER_AREA), enlarging
// bilinear interpolation (cv::INTER_LINEAR); a side's new length is rounded to the nearest
// pixel (at least 1); the pad/crop offset is (size - length) / 2 rounded down.
cv::Mat fit_to_square(const cv::Mat& bgr, int size, FitMode mode);

// A landmark list: one image a line, "PATH x1 y1 x2 y2 x3 y3 x4 y4 x5 y5": the path (it may
// hold spaces: the last ten fields are the numbers), then the five points in pixels of the
// image as it is displayed (EXIF orientation applied, as cv2.imread reads it), in
// insightface's order (left eye, right eye, nose, left mouth corner, right mouth corner;
// left as seen in the image). Blank lines and lines starting with '#' are skipped.
// A relative PATH is taken from `base` (the source folder, or the .lst's folder).
struct LandmarkList {
  std::map<std::string, std::array<float, 10>> by_path;  // key: landmark_key(path)
  std::vector<PackProblem> problems;                      // "FILE:LINE", what is wrong
  // Images whose line is one of the problems (their first field, for a line that did not
  // parse): their missing landmarks are that problem, not another one.
  std::set<std::string> reported;
};
// Usage error when the file cannot be read; problems of its lines are collected, one each:
// fewer or more than ten numbers, a field that is not a number, a path given twice, a
// path that names no file, a file that is not one of the source's images (`images`: the
// keys of the source's image paths).
LandmarkList read_landmark_list(const std::string& file, const std::string& base,
                                const std::vector<std::string>& images);
// The key a path is found by: absolute and lexically normalised.
std::string landmark_key(const std::string& path);

// The work of pack on one image: none, resize (fit_to_square) or align (align_face).
struct PackTransform {
  enum class Kind { none, resize, align } kind = Kind::none;
  int size = 112;
  FitMode fit = FitMode::pad;
  int jpeg_quality = 95;  // insightface's face2rec default
  const LandmarkList* landmarks = nullptr;
};

// Decodes `bytes` (any size within the decoder's limits) and checks what the transform
// needs (the image's landmarks, and that they can be a face of this image): "" when fine,
// else what is wrong (one line). On success `out` holds the transformed BGR image. An image
// whose landmark line is already a problem gives "-" (left out, not reported again).
std::string transform_image(const std::vector<uint8_t>& bytes, const std::string& path, const PackTransform& t,
                            cv::Mat& out);

}  // namespace faceshard
