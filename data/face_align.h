// Five-point face alignment to insightface's ArcFace 112x112 template (the similarity
// transform of insightface's face_align.norm_crop), shared by faceshard-pack --landmarks and
// the IJB evaluation, and the checks that tell landmarks that cannot be a face from ones
// that can.
#pragma once
#include <array>
#include <string>
#include <vector>

#include <opencv2/core.hpp>

namespace faceshard {

// The ArcFace 112x112 template (insightface's arcface_dst: its 112x96 points with x + 8),
// in insightface's order: left eye, right eye, nose tip, left mouth corner, right mouth
// corner, "left" as seen in the image (the person's right eye).
const std::array<cv::Point2f, 5>& arcface_template();

// Least-squares similarity transform (Umeyama, as skimage's SimilarityTransform.estimate)
// mapping src onto dst: the 2x3 CV_64F matrix [sR | t].
cv::Mat estimate_similarity(const std::vector<cv::Point2f>& src, const std::vector<cv::Point2f>& dst);

// The face warped to 112x112 with the similarity that maps its landmarks (x0 y0 ... x4 y4,
// pixels, the template's order) onto the template: bilinear, constant 0 border, as
// cv2.warpAffine(img, M, (112, 112), borderValue=0) in norm_crop.
cv::Mat align_face(const cv::Mat& bgr, const std::array<float, 10>& landmarks);

// "" when the five points can be a face of a width x height image, else what is wrong
// with them: a value that is not finite, points that coincide or lie on one line, the eyes
// less than 2 px apart, a mirrored (or re-ordered) set (the template's orientation is
// eyes left to right above the mouth: the cross product of eye-to-eye and eyes-to-mouth
// is positive for any rotation of an upright face and negative for a mirror image), or
// every point outside the image. width/height <= 0: the image check is skipped.
std::string landmark_problem(const std::array<float, 10>& landmarks, int width = 0, int height = 0);

}  // namespace faceshard
