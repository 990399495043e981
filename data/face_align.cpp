#include "data/face_align.h"

#include <cmath>

#include <opencv2/imgproc.hpp>

#include "base/error.h"

namespace faceshard {

const std::array<cv::Point2f, 5>& arcface_template() {
  static const std::array<cv::Point2f, 5> t = {cv::Point2f(30.2946f + 8.0f, 51.6963f), cv::Point2f(65.5318f + 8.0f, 51.5014f),
                                               cv::Point2f(48.0252f + 8.0f, 71.7366f), cv::Point2f(33.5493f + 8.0f, 92.3655f),
                                               cv::Point2f(62.7299f + 8.0f, 92.2041f)};
  return t;
}

cv::Mat estimate_similarity(const std::vector<cv::Point2f>& src, const std::vector<cv::Point2f>& dst) {
  if (src.size() != dst.size() || src.size() < 2) throw runtime_error("similarity transform: need >= 2 point pairs");
  const double n = double(src.size());
  double sm[2] = {0, 0}, dm[2] = {0, 0};
  for (size_t i = 0; i < src.size(); ++i) sm[0] += src[i].x, sm[1] += src[i].y, dm[0] += dst[i].x, dm[1] += dst[i].y;
  for (int k = 0; k < 2; ++k) sm[k] /= n, dm[k] /= n;
  cv::Matx22d A = cv::Matx22d::zeros();
  double src_var = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    const double s[2] = {src[i].x - sm[0], src[i].y - sm[1]}, d[2] = {dst[i].x - dm[0], dst[i].y - dm[1]};
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < 2; ++c) A(r, c) += d[r] * s[c] / n;
    src_var += (s[0] * s[0] + s[1] * s[1]) / n;
  }
  if (src_var <= 0) throw runtime_error("similarity transform: the source points coincide");
  cv::Matx22d u, vt;
  cv::Matx21d w;
  cv::SVD::compute(A, w, u, vt);
  const double sign = cv::determinant(A) < 0 ? -1.0 : 1.0;
  const cv::Matx22d D(1, 0, 0, sign);
  const cv::Matx22d R = u * D * vt;
  const double scale = (w(0) + sign * w(1)) / src_var;
  cv::Mat M(2, 3, CV_64F);
  for (int r = 0; r < 2; ++r) {
    M.at<double>(r, 0) = scale * R(r, 0);
    M.at<double>(r, 1) = scale * R(r, 1);
    M.at<double>(r, 2) = dm[r] - scale * (R(r, 0) * sm[0] + R(r, 1) * sm[1]);
  }
  return M;
}

cv::Mat align_face(const cv::Mat& bgr, const std::array<float, 10>& landmarks) {
  std::vector<cv::Point2f> src, dst(arcface_template().begin(), arcface_template().end());
  for (int k = 0; k < 5; ++k) src.emplace_back(landmarks[size_t(2 * k)], landmarks[size_t(2 * k + 1)]);
  cv::Mat out;
  cv::warpAffine(bgr, out, estimate_similarity(src, dst), cv::Size(112, 112), cv::INTER_LINEAR, cv::BORDER_CONSTANT,
                 cv::Scalar(0, 0, 0));
  return out;
}

std::string landmark_problem(const std::array<float, 10>& lm, int width, int height) {
  for (float v : lm)
    if (!std::isfinite(v)) return "a landmark coordinate is not a finite number";
  const double ex = double(lm[2]) - lm[0], ey = double(lm[3]) - lm[1];
  // Eyes' midpoint to the mouth corners' midpoint.
  const double mx = (double(lm[6]) + lm[8] - lm[0] - lm[2]) / 2, my = (double(lm[7]) + lm[9] - lm[1] - lm[3]) / 2;
  const double eye = std::hypot(ex, ey), mouth = std::hypot(mx, my);
  if (eye < 2.0)
    return detail::concat("degenerate landmarks: the eyes are ", eye, " px apart (at least 2 px for a face)");
  if (mouth < 1.0) return "degenerate landmarks: the mouth is at the eyes";
  // The sine of the angle from the eye line to the eyes-to-mouth line: about +1 for a face at
  // any rotation in the image plane, -1 for its mirror image, 0 when they lie on one line.
  const double sine = (ex * my - ey * mx) / (eye * mouth);
  if (sine < -0.2)
    return "the landmarks are mirrored or out of order (expected left eye, right eye, nose, left mouth corner, "
           "right mouth corner, left and right as seen in the image)";
  if (sine < 0.2) return "degenerate landmarks: the eyes and the mouth lie on one line";
  if (width > 0 && height > 0) {
    bool inside = false;
    for (int k = 0; k < 5; ++k)
      inside = inside || (lm[size_t(2 * k)] >= 0 && lm[size_t(2 * k)] <= float(width) && lm[size_t(2 * k + 1)] >= 0 &&
                          lm[size_t(2 * k + 1)] <= float(height));
    if (!inside) return detail::concat("every landmark lies outside the ", width, "x", height, " image");
  }
  return "";
}

}  // namespace faceshard
