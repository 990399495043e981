// IJB-B / IJB-C 1:1 verification (insightface's eval_ijbc.py protocol): the meta files (ijb_meta.h),
// 5-point alignment to the ArcFace template (data/face_align.h), template features from image features
// (faceness-weighted, averaged per media, summed per template, L2-normalised), and the
// cosine score of every template pair.
#pragma once
#include <array>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <opencv2/core.hpp>

#include "app/eval/ijb_meta.h"
#include "data/face_align.h"  // the 5-point alignment (arcface_template, align_face)

namespace faceshard {

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
