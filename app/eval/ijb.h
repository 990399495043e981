// IJB-B / IJB-C 1:1 verification (insightface's eval_ijbc.py protocol): the meta files (ijb_meta.h),
// 5-point alignment to the ArcFace template, template features from image features
// (faceness-weighted, averaged per media, summed per template, L2-normalised), and the
// cosine score of every template pair.
#pragma once
#include <array>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <opencv2/core.hpp>

#include "app/eval/ijb_meta.h"

namespace faceshard {

// The ArcFace 112x112 template (insightface's 112x96 points with x + 8).
const std::array<cv::Point2f, 5>& arcface_template();

// Least-squares similarity transform (Umeyama, as skimage's SimilarityTransform.estimate)
// mapping src onto dst: the 2x3 CV_64F matrix [sR | t].
cv::Mat estimate_similarity(const std::vector<cv::Point2f>& src, const std::vector<cv::Point2f>& dst);

// The face warped to 112x112 with the similarity that maps its landmarks onto the
// template (bilinear, constant 0 border, as cv2.warpAffine with borderValue 0).
cv::Mat align_face(const cv::Mat& bgr, const std::array<float, 10>& landmarks);

// Template features: image features [N, E] times the faceness score, averaged over the
// images of each media of a template, summed over the template's media, L2-normalised.
// Returns [T, E] (double) for the sorted unique template ids in `unique_templates`.
at::Tensor ijb_template_features(const at::Tensor& image_features, const IjbMeta& meta,
                                 std::vector<int64_t>* unique_templates, bool use_faceness = true);

// Cosine score per template pair (template features are unit vectors), computed a
// chunk of pairs at a time so that memory stays O(templates + pairs).
std::vector<double> ijb_pair_scores(const at::Tensor& template_features, const std::vector<int64_t>& unique_templates,
                                    const IjbMeta& meta);

// Usage error naming the first image of the meta files that is not a file under
// crops_dir (<root>/loose_crop): a stat per image, so that a missing crop stops the run
// before hours of embedding rather than in the middle of it.
void check_ijb_images(const IjbMeta& meta, const std::string& crops_dir);

}  // namespace faceshard
