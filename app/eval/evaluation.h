// Batch inference for evaluation: decoding a verification set once, embedding images with
// the flip test (embedding of the image plus that of its mirror), and the insightface
// verification protocol on top. Shared by the trainer and the evaluation tools.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <opencv2/core.hpp>

#include <torch/torch.h>

#include "app/eval/verification_metrics.h"
#include "models/backbone.h"

namespace faceshard {

struct VerificationData {
  std::string name;      // file stem, e.g. "lfw"
  std::string path;      // the file, for errors ("" for sets built in memory)
  at::Tensor images;     // [2P, 3, 112, 112] float, normalised RGB (pair i = rows 2i, 2i+1)
  std::vector<bool> issame;
};

// Reads and decodes an insightface .bin (images resized to 112 when they are not). A set
// without pairs, or without both genuine and impostor pairs (the ROC needs both), is an
// error naming the file.
VerificationData load_verification_data(const std::string& path);

// Usage error naming the set's file when it has fewer pairs than `folds` (the protocol
// needs at least one pair per fold).
void check_verification_folds(const VerificationData& data, int64_t folds);

// Flip-test embeddings, L2-normalised: normalize(f(x) + f(mirror(x))), the sum taken in
// double as insightface does, returned as float; in eval mode and without gradients,
// `batch` images at a time. The model's train/eval mode is restored.
at::Tensor embed_with_flip(Backbone& model, const at::Tensor& images, int64_t batch, torch::Device device);

// A source of images by index for embed_images: an 8-bit BGR image of any size (resized
// to 112x112 when it is not). Called from several threads at once.
using ImageSource = std::function<cv::Mat(int64_t index)>;

// Embeds images 0..n-1 of `load`, `batch` at a time (the batch decoded in parallel):
// f(x), or f(x) + f(mirror(x)) with flip; rows L2-normalised when normalize. [n, E] float.
// With progress, logs the count and rate about every 30 seconds (long IJB/extract runs).
at::Tensor embed_images(Backbone& model, int64_t n, const ImageSource& load, int64_t batch, torch::Device device,
                        bool flip, bool normalize, bool progress = false);

struct VerificationResult {
  KFoldResult kfold;
  double tar_at_far_1e3 = 0, tar_at_far_1e4 = 0;
  RocCurve roc;
  // insightface's XNorm: the mean L2 norm of the unflipped and the flipped embeddings,
  // each row counted separately (2 x images rows).
  double xnorm = 0;
};

// insightface's protocol with `folds` folds (check_verification_folds first).
VerificationResult evaluate_verification(Backbone& model, const VerificationData& data, int64_t batch,
                                         torch::Device device, int64_t folds = 10);

}  // namespace faceshard
