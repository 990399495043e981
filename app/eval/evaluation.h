// Batch inference for evaluation: verification sets decoded a batch at a time, embedding
// images with the flip test (embedding of the image plus that of its mirror), and the insightface
// verification protocol on top. Shared by the trainer and the evaluation tools.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include <opencv2/core.hpp>

#include <torch/torch.h>

#include "app/eval/verification_metrics.h"
#include "data/verification_bin.h"
#include "models/backbone.h"

namespace faceshard {

// A verification set as evaluation uses it: the encoded images of the .bin (bounded by
// the file's size, see data/verification_bin.h), decoded a batch at a time when they are
// fed to the model, so that memory follows the batch and not the number of pairs.
struct VerificationData {
  std::string name;                // file stem, e.g. "lfw"
  std::string path;                // the file, for errors ("" for sets built in memory)
  std::vector<ImageBytes> images;  // 2P encoded images (pair i = 2i, 2i+1); repeats share a buffer
  // Instead of `images`: 2P images already normalised, [2P, 3, 112, 112] float (tests).
  at::Tensor pixels;
  std::vector<bool> issame;
  // Distinct images that are not 112x112 (resized, not aligned, as they are read) and the
  // commonest of their sizes ("250x250"); load_verification_data warns about them once.
  int64_t other_size_images = 0;
  std::string other_size;

  int64_t num_images() const;
  // Writes images [begin, begin + n) to dst as normalised RGB floats, 3 x 112 x 112 each
  // (decoded in parallel, resized to 112 x 112 when they are not). Throws faceshard::Error
  // naming the file, the pair and the image when one does not decode.
  void fill(int64_t begin, int64_t n, float* dst) const;
};

// Reads an insightface .bin and checks that each distinct image decodes (once per shared
// buffer, nothing kept but the encoded bytes): a bad image fails here, naming the file, the
// pair and the image, before any model runs. A set without pairs, or without both genuine
// and impostor pairs (the ROC needs both), is an error naming the file. Images of another
// size than 112x112 are counted, and one warning names the file, the size and how to make
// aligned faces (faceshard-pack pairs --landmarks).
VerificationData load_verification_data(const std::string& path);

// Usage error naming the set's file when it has fewer pairs than `folds` (the protocol
// needs at least one pair per fold).
void check_verification_folds(const VerificationData& data, int64_t folds);

// Flip-test embeddings of the set's images, L2-normalised: normalize(f(x) + f(mirror(x))),
// the sum taken in double as insightface does, returned as float; in eval mode and without
// gradients, `batch` images at a time (decoded per batch). The model's mode is restored.
at::Tensor embed_with_flip(Backbone& model, const VerificationData& data, int64_t batch, torch::Device device);

// A source of images by index for embed_images: an 8-bit BGR image of any size (resized
// to 112x112 when it is not). Called from several threads at once.
using ImageSource = std::function<cv::Mat(int64_t index)>;

// Embeds images 0..n-1 of `load`, `batch` at a time (the batch decoded in parallel):
// f(x), or f(x) + f(mirror(x)) with flip; rows L2-normalised when normalize. [n, E] float.
// With progress, shows the count, rate and time left (base/progress.h).
at::Tensor embed_images(Backbone& model, int64_t n, const ImageSource& load, int64_t batch, torch::Device device,
                        bool flip, bool normalize, bool progress = false);

struct VerificationResult {
  KFoldResult kfold;
  double tar_at_far_1e3 = 0, tar_at_far_1e4 = 0;
  RocCurve roc;
  // insightface's XNorm: the mean L2 norm of the unflipped and the flipped embeddings,
  // each row counted separately (2 x images rows).
  double xnorm = 0;
  // The mean cosine similarity of the different-identity pairs: near 1 when the embeddings
  // have collapsed (every face maps to about the same point).
  double negative_cosine = 0;
};

// insightface's protocol with `folds` folds (check_verification_folds first).
VerificationResult evaluate_verification(Backbone& model, const VerificationData& data, int64_t batch,
                                         torch::Device device, int64_t folds = 10, bool progress = false);

}  // namespace faceshard
