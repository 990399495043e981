// Face-verification metrics shared by the trainer and the evaluation tools (one
// implementation): insightface's 10-fold pair-verification accuracy, the exact ROC over
// similarity scores with TAR@FAR, and the ROC written as CSV and as a PNG plot.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace faceshard {

struct KFoldResult {
  double accuracy_mean = 0, accuracy_std = 0;
  double best_threshold = 0;  // mean of the per-fold chosen thresholds
  std::vector<double> fold_accuracy;
};

// insightface's protocol (eval/verification.py calculate_roc): `distances` are squared
// Euclidean distances between L2-normalised embeddings (a pair is "same" when
// distance < threshold); thresholds np.arange(0, 4, 0.01); sklearn KFold(folds,
// shuffle=False) contiguous folds (the first P % folds folds one longer); per fold the
// threshold with the best accuracy on the other folds (first argmax) is applied to the
// held-out fold. Mean and population std over the folds. folds == 1 trains and tests on
// all pairs (insightface's LFold). Float distances are compared in double, as numpy does.
KFoldResult kfold_verification(const at::Tensor& distances, const std::vector<bool>& issame, int folds = 10);

// Normalises the rows of emb1 and emb2 ([P, D]) and returns their squared L2 distances
// as a [P] double tensor (0 = same direction, 4 = opposite).
at::Tensor pair_distances(const at::Tensor& emb1, const at::Tensor& emb2);

struct RocCurve {
  std::vector<double> fpr, tpr, thresholds;
};

// Exact ROC over scores (higher = more similar), as sklearn.metrics.roc_curve with
// drop_intermediate=False: one point per distinct score in descending order (predict
// "genuine" when score >= threshold), preceded by (0, 0) at threshold +inf.
// labels: 1 genuine, 0 impostor; both classes must be present.
RocCurve roc_curve(const std::vector<double>& scores, const std::vector<int>& labels);

// TAR at a target FAR as insightface's IJB script (eval_ijbc.py) reports it: the TPR of
// the ROC point whose FPR is closest to `far` (min |fpr - far|; ties -> the later point,
// i.e. the larger TPR). It may sit above the target FAR; the tools print this one so
// that numbers compare with published tables.
double tar_at_far(const RocCurve& roc, double far);
// The conservative reading: the largest TPR among points with FPR <= far.
double tar_at_far_exact(const RocCurve& roc, double far);
// Area under the ROC (trapezoids over the exact curve).
double roc_auc(const RocCurve& roc);

// The impostor (different-identity) pairs TAR at `far` needs: 1/far. With fewer, the ROC's
// smallest FPR step (1/negatives) is larger than `far`, and the TPR read off the curve is
// the TAR of another FAR (with 200 negatives, FAR 1e-4 reads the point at FPR 0).
int64_t negatives_needed(double far);
// "1e-4" for 1e-4 (a power of ten), "%g" otherwise.
std::string far_label(double far);
// The value of TAR@FAR for a printed line: tar with `decimals` decimals (times 100 with
// percent), or "not enough pairs (N negatives, M needed)" below negatives_needed(far).
std::string tar_at_far_text(double tar, double far, int64_t negatives, int decimals = 4, bool percent = false);
// The value of TAR@FAR for JSON: a fraction, or null below negatives_needed(far) (the set
// does not measure it: the same condition the printed line says in words).
std::string tar_at_far_json(double tar, double far, int64_t negatives);

// CSV with header "fpr,tpr,cosine_threshold" (the first threshold is "inf"); written to a
// temporary file and renamed so that a reader never sees half a file.
void write_roc_csv(const RocCurve& roc, const std::string& path);

// ROC plot: log-scale FPR on x (1e-6 .. 1; FPR 0 is drawn at the left edge), TPR on y,
// gridlines, one coloured line per curve and a legend. Written through a temporary file.
void write_roc_png(const std::vector<std::pair<std::string, RocCurve>>& curves, const std::string& path,
                   const std::string& title);
void write_roc_png(const std::vector<std::pair<std::string, RocCurve>>& curves, const std::string& path,
                   const std::string& title, int width, int height);

}  // namespace faceshard
