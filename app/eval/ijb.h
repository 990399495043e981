// IJB-B / IJB-C 1:1 verification (insightface's eval_ijbc.py protocol): the meta files,
// 5-point alignment to the ArcFace template, template features from image features
// (faceness-weighted, averaged per media, summed per template, L2-normalised), and the
// cosine score of every template pair.
#pragma once
#include <array>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <opencv2/core.hpp>

namespace faceshard {

struct IjbMeta {
  std::string target;                           // "IJBC" or "IJBB"
  std::vector<std::string> images;              // file names under <root>/loose_crop
  std::vector<size_t> image_lines;              // line of each image in <t>_name_5pts_score.txt
  std::vector<std::array<float, 10>> landmarks; // x1 y1 ... x5 y5 per image
  std::vector<double> faceness;                 // detector score per image
  std::vector<int64_t> templates, medias;       // per image
  std::vector<int64_t> pair_t1, pair_t2;        // template pairs
  std::vector<int> pair_label;                  // 1 genuine, 0 impostor
};

// Reads <root>/meta/<t>_name_5pts_score.txt, <t>_face_tid_mid.txt and
// <t>_template_pair_label.txt (t = ijbc | ijbb). The first two files list the same images
// in the same order; every template of a pair must have images. Usage errors name file,
// line (as an editor counts it, blank lines included) and what is wrong.
IjbMeta read_ijb_meta(const std::string& root, const std::string& target);

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
