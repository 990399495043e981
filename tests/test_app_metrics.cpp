// Evaluation metrics and training logs checked against independent readers: insightface's
// 10-fold protocol and an sklearn-style ROC re-implemented in Python/numpy (no code shared
// with ours), TensorBoard event files parsed by a standard-library Python TFRecord/protobuf
// reader with its own CRC32C, metrics.jsonl parsed by Python's json module.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "tests/cv2_reference.h"
#include "tests/test_paths.h"
#include "app/io/metrics_log.h"
#include "app/train/device_readout.h"
#include "app/io/tensorboard_writer.h"
#include "app/eval/verification_metrics.h"
#include "base/error.h"
#include "tests/test_errors.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------
// Helpers

void spit(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  ASSERT_TRUE(f.good()) << path;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

struct PyResult {
  int status = -1;
  std::string out;
};

// Runs `script` (written to dir) with the project's Python; returns exit status and stdout+stderr.
PyResult run_python(const std::string& dir, const std::string& name, const std::string& script,
                    const std::vector<std::string>& args) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << script;
  std::string cmd = std::string("\"") + FACESHARD_PYTHON + "\" \"" + path + "\"";
  for (const auto& a : args) cmd += " \"" + a + "\"";
  cmd += " 2>&1";
  PyResult r;
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// Output lines "key v1 v2 ..." -> key -> tokens.
std::map<std::string, std::vector<std::string>> parse_keyed(const std::string& out) {
  std::map<std::string, std::vector<std::string>> m;
  std::istringstream is(out);
  std::string line;
  while (std::getline(is, line)) {
    std::istringstream ls(line);
    std::string key, tok;
    if (!(ls >> key)) continue;
    std::vector<std::string>& v = m[key];
    while (ls >> tok) v.push_back(tok);
  }
  return m;
}

std::vector<double> to_doubles(const std::vector<std::string>& toks) {
  std::vector<double> v;
  for (const auto& t : toks) v.push_back(std::strtod(t.c_str(), nullptr));
  return v;
}

std::string fmt(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

using testing::error_of;

// ---------------------------------------------------------------------------------------
// Verification: independent Python reference

// insightface eval/verification.py (calculate_roc / calculate_accuracy) with sklearn's
// KFold(shuffle=False) re-implemented, and sklearn.metrics.roc_curve's
// _binary_clf_curve + eval_ijbc.py's TAR@FAR selection, with numpy only.
const char* kVerificationRef = R"PY(
import sys
import numpy as np

def f(x):
    return repr(float(x))

def kfold_split(n, k):
    # sklearn KFold(n_splits=k, shuffle=False): the first n % k folds get one extra sample
    sizes = np.full(k, n // k, dtype=np.int64)
    sizes[: n % k] += 1
    idx = np.arange(n)
    cur = 0
    for s in sizes:
        test = idx[cur:cur + s]
        mask = np.ones(n, dtype=bool)
        mask[test] = False
        yield idx[mask], test
        cur += s

def calculate_accuracy(threshold, dist, actual_issame):
    predict_issame = np.less(dist, threshold)
    tp = np.sum(np.logical_and(predict_issame, actual_issame))
    fp = np.sum(np.logical_and(predict_issame, np.logical_not(actual_issame)))
    tn = np.sum(np.logical_and(np.logical_not(predict_issame), np.logical_not(actual_issame)))
    fn = np.sum(np.logical_and(np.logical_not(predict_issame), actual_issame))
    return float(tp + tn) / dist.size

def calculate_roc(thresholds, dist, actual_issame, nrof_folds):
    n = len(actual_issame)
    accuracy = np.zeros(nrof_folds)
    best = np.zeros(nrof_folds)
    if nrof_folds > 1:
        splits = kfold_split(n, nrof_folds)
    else:  # insightface's LFold
        splits = [(np.arange(n), np.arange(n))]
    for fold_idx, (train_set, test_set) in enumerate(splits):
        acc_train = np.zeros(len(thresholds))
        for ti, threshold in enumerate(thresholds):
            acc_train[ti] = calculate_accuracy(threshold, dist[train_set], actual_issame[train_set])
        bi = np.argmax(acc_train)
        best[fold_idx] = thresholds[bi]
        accuracy[fold_idx] = calculate_accuracy(thresholds[bi], dist[test_set], actual_issame[test_set])
    return accuracy, best

def roc_curve(y_true, y_score):
    desc = np.argsort(y_score, kind="mergesort")[::-1]
    y_score = y_score[desc]
    y_true = y_true[desc]
    distinct = np.where(np.diff(y_score))[0]
    thr_idx = np.r_[distinct, y_true.size - 1]
    tps = np.cumsum(y_true)[thr_idx]
    fps = 1 + thr_idx - tps
    tps = np.r_[0, tps]
    fps = np.r_[0, fps]
    thresholds = np.r_[np.inf, y_score[thr_idx]]
    return fps / fps[-1], tps / tps[-1], thresholds

mode, path = sys.argv[1], sys.argv[2]
rows = [line.split() for line in open(path) if line.strip()]
if mode == 'kfold_emb' or mode == 'kfold_dist':
    folds = int(rows[0][0])
    rows = rows[1:]
    issame = np.array([int(r[0]) == 1 for r in rows])
    if mode == 'kfold_emb':
        data = np.array([[float(x) for x in r[1:]] for r in rows])
        d = data.shape[1] // 2
        e1, e2 = data[:, :d], data[:, d:]
        e1 = e1 / np.linalg.norm(e1, axis=1, keepdims=True)
        e2 = e2 / np.linalg.norm(e2, axis=1, keepdims=True)
        dist = np.sum(np.square(np.subtract(e1, e2)), 1)
    else:
        dist = np.array([float(r[1]) for r in rows])
    thresholds = np.arange(0, 4, 0.01)
    acc, best = calculate_roc(thresholds, dist, issame, folds)
    print('dist', ' '.join(f(x) for x in dist))
    print('acc', ' '.join(f(x) for x in acc))
    print('best', ' '.join(f(x) for x in best))
    print('mean', f(np.mean(acc)))
    print('std', f(np.std(acc)))
elif mode == 'roc':
    labels = np.array([int(r[0]) for r in rows])
    scores = np.array([float(r[1]) for r in rows])
    fpr, tpr, thr = roc_curve(labels, scores)
    print('fpr', ' '.join(f(x) for x in fpr))
    print('tpr', ' '.join(f(x) for x in tpr))
    print('thr', ' '.join(f(x) for x in thr))
    ffpr, ftpr = np.flipud(fpr), np.flipud(tpr)
    tars, exact = [], []
    for t in [float(x) for x in sys.argv[3:]]:
        _, min_index = min(list(zip(abs(ffpr - t), range(len(ffpr)))))
        tars.append(ftpr[min_index])
        exact.append(np.max(tpr[fpr <= t]))
    print('tar', ' '.join(f(x) for x in tars))
    print('tar_exact', ' '.join(f(x) for x in exact))
else:
    sys.exit('unknown mode ' + mode)
)PY";

struct PairData {
  at::Tensor emb1, emb2;  // [P, D] double
  std::vector<bool> issame;
};

// Genuine pairs are the same random vector plus noise, impostors two random vectors:
// the distance distributions overlap, so accuracy lands well below 100%.
PairData make_pairs(int64_t p, int64_t d, uint64_t seed) {
  torch::manual_seed(seed);
  PairData r;
  r.emb1 = torch::randn({p, d}, torch::kDouble);
  const at::Tensor same = torch::rand({p}, torch::kDouble) < 0.5;
  const at::Tensor genuine = r.emb1 + 1.1 * torch::randn({p, d}, torch::kDouble);
  r.emb2 = torch::where(same.unsqueeze(1), genuine, torch::randn({p, d}, torch::kDouble));
  for (int64_t i = 0; i < p; ++i) r.issame.push_back(same[i].item<bool>());
  return r;
}

void check_kfold_against_python(const KFoldResult& got, const std::map<std::string, std::vector<std::string>>& ref,
                                int folds, const std::string& what) {
  const std::vector<double> acc = to_doubles(ref.at("acc")), best = to_doubles(ref.at("best"));
  ASSERT_EQ(acc.size(), static_cast<size_t>(folds)) << what;
  ASSERT_EQ(got.fold_accuracy.size(), acc.size()) << what;
  for (size_t f = 0; f < acc.size(); ++f) EXPECT_DOUBLE_EQ(got.fold_accuracy[f], acc[f]) << what << " fold " << f;
  double best_mean = 0;
  for (double b : best) best_mean += b / folds;
  EXPECT_NEAR(got.accuracy_mean, std::strtod(ref.at("mean")[0].c_str(), nullptr), 1e-12) << what;
  EXPECT_NEAR(got.accuracy_std, std::strtod(ref.at("std")[0].c_str(), nullptr), 1e-12) << what;
  EXPECT_NEAR(got.best_threshold, best_mean, 1e-12) << what;
}

std::map<std::string, std::vector<std::string>> python_kfold_emb(const std::string& dir, const PairData& d,
                                                                 int folds) {
  std::ostringstream in;
  in << folds << "\n";
  const at::Tensor a = d.emb1.contiguous(), b = d.emb2.contiguous();
  for (int64_t i = 0; i < a.size(0); ++i) {
    in << (d.issame[i] ? 1 : 0);
    for (int64_t k = 0; k < a.size(1); ++k) in << ' ' << fmt(a[i][k].item<double>());
    for (int64_t k = 0; k < b.size(1); ++k) in << ' ' << fmt(b[i][k].item<double>());
    in << "\n";
  }
  spit(dir + "/kfold_emb.txt", in.str());
  const PyResult r = run_python(dir, "verification_ref.py", kVerificationRef, {"kfold_emb", dir + "/kfold_emb.txt"});
  EXPECT_EQ(r.status, 0) << r.out;
  return parse_keyed(r.out);
}

TEST(VerificationMetrics, KFoldMatchesInsightfaceProtocolInNumpy) {
  const std::string dir = testing::temp_dir("verif");
  // 600 pairs: ten equal folds; 603: three folds one longer (sklearn's split sizes).
  for (const auto& [p, folds] : std::vector<std::pair<int64_t, int>>{{600, 10}, {603, 10}, {603, 7}, {250, 1}}) {
    const std::string what = "P=" + std::to_string(p) + " folds=" + std::to_string(folds);
    const PairData d = make_pairs(p, 16, 100 + p + folds);
    const auto ref = python_kfold_emb(dir, d, folds);
    ASSERT_TRUE(ref.count("dist") && ref.count("acc")) << what;

    const at::Tensor dist = pair_distances(d.emb1, d.emb2);
    ASSERT_EQ(dist.scalar_type(), at::kDouble);
    const std::vector<double> want_dist = to_doubles(ref.at("dist"));
    ASSERT_EQ(dist.numel(), static_cast<int64_t>(want_dist.size())) << what;
    for (int64_t i = 0; i < dist.numel(); ++i) EXPECT_NEAR(dist[i].item<double>(), want_dist[i], 1e-12) << i;

    const KFoldResult got = kfold_verification(dist, d.issame, folds);
    check_kfold_against_python(got, ref, folds, what);
    // The data is meant to be hard: a test where every fold scores 100% checks little.
    EXPECT_GT(got.accuracy_mean, 0.7) << what;
    EXPECT_LT(got.accuracy_mean, 0.97) << what;
    if (folds > 1) { EXPECT_GT(got.accuracy_std, 0) << what; }
  }
}

TEST(VerificationMetrics, KFoldTiesAndDistancesOnThresholdsMatchNumpy) {
  // Distances exactly on the threshold grid (k * 0.01) exercise "dist < threshold" (a
  // pair at the threshold is "different") and many equal training accuracies exercise
  // the first argmax.
  const std::string dir = testing::temp_dir("verif");
  torch::manual_seed(5);
  const int64_t p = 517;
  const int folds = 10;
  std::vector<bool> issame;
  std::vector<double> dist;
  std::ostringstream in;
  in << folds << "\n";
  for (int64_t i = 0; i < p; ++i) {
    const bool same = torch::randint(0, 2, {1}).item<int64_t>() == 1;
    const int64_t k = same ? torch::randint(0, 30, {1}).item<int64_t>() : torch::randint(20, 40, {1}).item<int64_t>();
    issame.push_back(same);
    dist.push_back(static_cast<double>(k) * 0.01);
    in << (same ? 1 : 0) << ' ' << fmt(dist.back()) << "\n";
  }
  spit(dir + "/kfold_dist.txt", in.str());
  const PyResult r = run_python(dir, "verification_ref.py", kVerificationRef, {"kfold_dist", dir + "/kfold_dist.txt"});
  ASSERT_EQ(r.status, 0) << r.out;
  const auto ref = parse_keyed(r.out);
  const KFoldResult got = kfold_verification(torch::tensor(dist, torch::kDouble), issame, folds);
  check_kfold_against_python(got, ref, folds, "grid distances");
  // Float distances are widened, not rounded differently: same answer from float input
  // (these grid values are compared by numpy in float64 after the same widening).
  const KFoldResult from_float = kfold_verification(torch::tensor(dist, torch::kDouble).to(torch::kFloat).to(torch::kDouble), issame, folds);
  const KFoldResult from_float2 = kfold_verification(torch::tensor(dist, torch::kDouble).to(torch::kFloat), issame, folds);
  EXPECT_EQ(from_float.fold_accuracy, from_float2.fold_accuracy);
}

TEST(VerificationMetrics, KFoldHandWorkedCase) {
  // 4 pairs, 2 folds: fold 0 = pairs {0,1}, fold 1 = pairs {2,3}.
  // distances 0.10 (same), 0.50 (diff), 0.20 (same), 0.30 (diff).
  // Fold 0 trains on pairs 2,3: threshold t in (0.20, 0.30] classifies both right; the
  // first such grid value is 0.21. On pairs 0,1: 0.10 < 0.21 same (right), 0.50 diff
  // (right) -> 1.0. Fold 1 trains on pairs 0,1: first perfect threshold is 0.11; on pairs
  // 2,3: 0.20 >= 0.11 -> "diff" (wrong), 0.30 diff (right) -> 0.5.
  // mean 0.75, population std 0.25, mean threshold (0.21 + 0.11) / 2 = 0.16.
  const KFoldResult r = kfold_verification(torch::tensor({0.10, 0.50, 0.20, 0.30}, torch::kDouble),
                                           {true, false, true, false}, 2);
  ASSERT_EQ(r.fold_accuracy.size(), 2u);
  EXPECT_DOUBLE_EQ(r.fold_accuracy[0], 1.0);
  EXPECT_DOUBLE_EQ(r.fold_accuracy[1], 0.5);
  EXPECT_DOUBLE_EQ(r.accuracy_mean, 0.75);
  EXPECT_DOUBLE_EQ(r.accuracy_std, 0.25);
  EXPECT_NEAR(r.best_threshold, 0.16, 1e-12);
}

TEST(VerificationMetrics, RocAndTarMatchSklearnStyleReference) {
  const std::string dir = testing::temp_dir("verif");
  const std::vector<double> targets = {1e-3, 1e-2, 0.05, 0.1, 0.2, 0.5};
  std::vector<std::string> args;
  for (double t : targets) args.push_back(fmt(t));
  for (int variant = 0; variant < 2; ++variant) {
    const PairData d = make_pairs(3000, 16, 42 + variant);
    const at::Tensor cosine = 1 - pair_distances(d.emb1, d.emb2) / 2;
    std::vector<double> scores;
    std::vector<int> labels;
    std::ostringstream in;
    for (int64_t i = 0; i < cosine.numel(); ++i) {
      double s = cosine[i].item<double>();
      // Variant 1 rounds the scores to two decimals: many ties, fewer ROC points.
      if (variant == 1) s = std::round(s * 100) / 100;
      scores.push_back(s);
      labels.push_back(d.issame[i] ? 1 : 0);
      in << labels.back() << ' ' << fmt(s) << "\n";
    }
    spit(dir + "/roc.txt", in.str());
    std::vector<std::string> a = {"roc", dir + "/roc.txt"};
    a.insert(a.end(), args.begin(), args.end());
    const PyResult r = run_python(dir, "verification_ref.py", kVerificationRef, a);
    ASSERT_EQ(r.status, 0) << r.out;
    const auto ref = parse_keyed(r.out);

    const RocCurve roc = roc_curve(scores, labels);
    const std::vector<double> fpr = to_doubles(ref.at("fpr")), tpr = to_doubles(ref.at("tpr")),
                              thr = to_doubles(ref.at("thr"));
    ASSERT_EQ(roc.fpr.size(), fpr.size()) << "variant " << variant;
    if (variant == 1) { EXPECT_LT(roc.fpr.size(), 300u); }
    EXPECT_EQ(roc.fpr, fpr);
    EXPECT_EQ(roc.tpr, tpr);
    EXPECT_EQ(roc.thresholds, thr);
    const std::vector<double> tar = to_doubles(ref.at("tar")), exact = to_doubles(ref.at("tar_exact"));
    ASSERT_EQ(tar.size(), targets.size());
    for (size_t k = 0; k < targets.size(); ++k) {
      EXPECT_EQ(tar_at_far(roc, targets[k]), tar[k]) << "variant " << variant << " far " << targets[k];
      EXPECT_EQ(tar_at_far_exact(roc, targets[k]), exact[k]) << "variant " << variant << " far " << targets[k];
    }
  }
}

TEST(VerificationMetrics, TarAtFarHandWorkedCases) {
  {
    // 4 genuine {0.9, 0.8, 0.6, 0.3}, 6 impostor {0.85, 0.5, 0.4, 0.2, 0.1, 0.0}.
    // Descending: 0.9G 0.85I 0.8G 0.6G 0.5I 0.4I 0.3G 0.2I 0.1I 0.0I. Points (fpr, tpr):
    //  0 inf (0,0)  1 0.9 (0,1/4)  2 0.85 (1/6,1/4)  3 0.8 (1/6,2/4)  4 0.6 (1/6,3/4)
    //  5 0.5 (2/6,3/4)  6 0.4 (3/6,3/4)  7 0.3 (3/6,1)  8 0.2 (4/6,1)  9 0.1 (5/6,1)
    // 10 0.0 (1,1)
    const RocCurve roc = roc_curve({0.9, 0.8, 0.6, 0.3, 0.85, 0.5, 0.4, 0.2, 0.1, 0.0}, {1, 1, 1, 1, 0, 0, 0, 0, 0, 0});
    ASSERT_EQ(roc.fpr.size(), 11u);
    EXPECT_TRUE(std::isinf(roc.thresholds[0]));
    EXPECT_EQ(roc.thresholds[1], 0.9);
    EXPECT_EQ(roc.thresholds[10], 0.0);
    EXPECT_DOUBLE_EQ(roc.fpr[4], 1.0 / 6);
    EXPECT_DOUBLE_EQ(roc.tpr[4], 0.75);
    // far 0: points 0 and 1 have fpr 0 -> the later one, tpr 1/4. Exact: 1/4.
    EXPECT_EQ(tar_at_far(roc, 0.0), 0.25);
    EXPECT_EQ(tar_at_far_exact(roc, 0.0), 0.25);
    // far 0.1: |0 - 0.1| = 0.1 > |1/6 - 0.1| = 0.067 -> fpr 1/6, last such point 4: 3/4.
    // Exact (fpr <= 0.1): 1/4.
    EXPECT_EQ(tar_at_far(roc, 0.1), 0.75);
    EXPECT_EQ(tar_at_far_exact(roc, 0.1), 0.25);
    // far 0.4: nearest fpr 2/6 (0.067 vs 0.1 for 3/6) -> 3/4; exact 3/4.
    EXPECT_EQ(tar_at_far(roc, 0.4), 0.75);
    EXPECT_EQ(tar_at_far_exact(roc, 0.4), 0.75);
    // far 0.45: nearest fpr 3/6 (0.05) -> last such point 7: 1.0; exact: 3/4.
    EXPECT_EQ(tar_at_far(roc, 0.45), 1.0);
    EXPECT_EQ(tar_at_far_exact(roc, 0.45), 0.75);
  }
  {
    // 4 genuine {0.9, 0.7, 0.6, 0.2}, 4 impostor {0.8, 0.5, 0.4, 0.1}: fprs are quarters,
    // so midpoints tie exactly. Points: 0 (0,0) 1 (0,.25) 2 (.25,.25) 3 (.25,.5)
    // 4 (.25,.75) 5 (.5,.75) 6 (.75,.75) 7 (.75,1) 8 (1,1).
    const RocCurve roc = roc_curve({0.9, 0.7, 0.6, 0.2, 0.8, 0.5, 0.4, 0.1}, {1, 1, 1, 1, 0, 0, 0, 0});
    ASSERT_EQ(roc.fpr.size(), 9u);
    // far 0.125: fpr 0 and 0.25 tie at 0.125 -> the later point (4): 0.75. Exact: 0.25.
    EXPECT_EQ(tar_at_far(roc, 0.125), 0.75);
    EXPECT_EQ(tar_at_far_exact(roc, 0.125), 0.25);
    // far 0.625: fpr 0.5 and 0.75 tie -> point 7: 1.0. Exact: 0.75.
    EXPECT_EQ(tar_at_far(roc, 0.625), 1.0);
    EXPECT_EQ(tar_at_far_exact(roc, 0.625), 0.75);
    // AUC = P(genuine > impostor) = (4 + 3 + 3 + 1) / 16.
    EXPECT_DOUBLE_EQ(roc_auc(roc), 11.0 / 16);
  }
}

TEST(VerificationMetrics, RejectsBadInput) {
  EXPECT_NE(error_of([] { kfold_verification(torch::zeros({5}, torch::kDouble), {true, false}, 2); })
                .find("verification_metrics"),
            std::string::npos);
  EXPECT_NE(error_of([] { kfold_verification(torch::zeros({3}, torch::kDouble), {true, false, true}, 10); })
                .find("folds"),
            std::string::npos);
  EXPECT_NE(error_of([] { roc_curve({0.1, 0.2}, {1, 1}); }).find("impostor"), std::string::npos);
  EXPECT_NE(error_of([] { roc_curve({0.1, 0.2}, {1, 2}); }).find("label"), std::string::npos);
  EXPECT_NE(error_of([] { roc_curve({0.1, std::nan("")}, {1, 0}); }).find("finite"), std::string::npos);
  EXPECT_NE(error_of([] { pair_distances(torch::zeros({3, 4}), torch::zeros({3, 5})); }).find("pair_distances"),
            std::string::npos);
  EXPECT_NE(error_of([] { tar_at_far(RocCurve{}, 0.1); }).find("empty"), std::string::npos);
}

TEST(VerificationMetrics, RocCsvReadsBack) {
  const std::string dir = testing::temp_dir("verif");
  const RocCurve roc = roc_curve({0.9, 0.8, 0.6, 0.3, 0.85, 0.5}, {1, 1, 1, 0, 0, 0});
  write_roc_csv(roc, dir + "/sub/roc.csv");
  // Python's csv module reads it back; the script prints the values it parsed.
  const PyResult r = run_python(dir, "csv_ref.py", R"PY(
import csv, sys
rows = list(csv.reader(open(sys.argv[1], newline='')))
assert rows[0] == ['fpr', 'tpr', 'cosine_threshold'], rows[0]
for r in rows[1:]:
    print('row', ' '.join(repr(float(x)) for x in r))
)PY",
                                {dir + "/sub/roc.csv"});
  ASSERT_EQ(r.status, 0) << r.out;
  std::istringstream is(r.out);
  std::string line;
  size_t i = 0;
  while (std::getline(is, line)) {
    std::istringstream ls(line);
    std::string tag, a, b, c;
    ls >> tag >> a >> b >> c;
    ASSERT_LT(i, roc.fpr.size());
    EXPECT_EQ(std::strtod(a.c_str(), nullptr), roc.fpr[i]);
    EXPECT_EQ(std::strtod(b.c_str(), nullptr), roc.tpr[i]);
    EXPECT_EQ(std::strtod(c.c_str(), nullptr), roc.thresholds[i]);
    ++i;
  }
  EXPECT_EQ(i, roc.fpr.size());
  // The temporary file was renamed away.
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir + "/sub")) files += e.is_regular_file() ? 1 : 0;
  EXPECT_EQ(files, 1u);
}

// A ROC is drawn where it is measured: from its first point of FPR > 0 (1 / negatives). With
// 100 impostor pairs, half the genuine pairs above every impostor, the curve's TPR of 0.5 at
// FPR 0 used to be drawn as a flat line from FPR 1e-6 to 1e-2, where no pair says anything.
TEST(VerificationMetrics, RocPngDrawsOnlyMeasuredPoints) {
  const std::string dir = testing::temp_dir("verif");
  std::vector<double> scores;
  std::vector<int> labels;
  for (int i = 0; i < 100; ++i) scores.push_back(i < 50 ? 0.99 - 0.0001 * i : 0.5 - 0.004 * i), labels.push_back(1);
  for (int i = 0; i < 100; ++i) scores.push_back(0.9 - 0.008 * i), labels.push_back(0);
  const RocCurve roc = roc_curve(scores, labels);
  ASSERT_EQ(roc.fpr[50], 0.0);  // half the genuine pairs before the first impostor
  ASSERT_EQ(roc.tpr[50], 0.5);
  write_roc_png({{"m", roc}}, dir + "/roc.png", "measured points", 640, 480);
  const cv::Mat img = testing::cv2_imread(dir + "/roc.png", testing::cv2::IMREAD_COLOR);
  ASSERT_FALSE(img.empty());
  // The plot spans x 80..615 for log10 FPR -6..0: FPR 1e-2 at x = 80 + 535 * 4/6 = 437.
  const int left = 80, right = 615, top = 50, bottom = 480 - 65;
  const int x_first = left + static_cast<int>(std::lround(535.0 * 4 / 6));
  int before = 0, after = 0;
  for (int y = top; y <= bottom; ++y)
    for (int x = left + 3; x < right; ++x) {
      const cv::Vec3b p = img.at<cv::Vec3b>(y, x);
      const bool coloured = std::max({p[0], p[1], p[2]}) - std::min({p[0], p[1], p[2]}) > 80;
      if (!coloured) continue;
      if (x < x_first - 3) ++before;
      else ++after;
    }
  EXPECT_EQ(before, 0) << "curve pixels left of FPR 1e-2, where nothing is measured";
  EXPECT_GT(after, 100) << "the measured part of the curve is missing";
}

TEST(VerificationMetrics, RocPngHasRequestedSizeAndCurves) {
  const std::string dir = testing::temp_dir("verif");
  const PairData d = make_pairs(4000, 16, 9);
  const at::Tensor cosine = 1 - pair_distances(d.emb1, d.emb2) / 2;
  std::vector<double> scores(cosine.data_ptr<double>(), cosine.data_ptr<double>() + cosine.numel());
  std::vector<int> labels(d.issame.begin(), d.issame.end());
  const RocCurve a = roc_curve(scores, labels);
  for (auto& s : scores) s = s * 0.5 + 0.1 * std::sin(s * 1000);  // a worse model
  const RocCurve b = roc_curve(scores, labels);
  const std::vector<std::pair<std::string, RocCurve>> curves = {{"model A (noise 1.1)", a}, {"model B", b}};

  write_roc_png(curves, dir + "/roc.png", "ROC test", 640, 480);
  cv::Mat img = testing::cv2_imread(dir + "/roc.png", testing::cv2::IMREAD_UNCHANGED);
  ASSERT_FALSE(img.empty());
  EXPECT_EQ(img.channels(), 3);
  EXPECT_EQ(img.cols, 640);
  EXPECT_EQ(img.rows, 480);
  // The curves are coloured: count clearly non-grey pixels.
  int coloured = 0;
  for (int y = 0; y < img.rows; ++y)
    for (int x = 0; x < img.cols; ++x) {
      const cv::Vec3b p = img.at<cv::Vec3b>(y, x);
      const int mx = std::max({p[0], p[1], p[2]}), mn = std::min({p[0], p[1], p[2]});
      coloured += (mx - mn > 80) ? 1 : 0;
    }
  EXPECT_GT(coloured, 500);

  write_roc_png(curves, dir + "/default.png", "ROC default size");
  cv::Mat def = testing::cv2_imread(dir + "/default.png", testing::cv2::IMREAD_COLOR);
  ASSERT_FALSE(def.empty());
  EXPECT_EQ(def.cols, 800);
  EXPECT_EQ(def.rows, 600);
  // The files are valid PNG by the format spec, checked with Python's standard library
  // only (OpenCV wrote them and must not be the one to read them back): signature, every
  // chunk CRC, IHDR first and IEND last, and the zlib stream of the IDAT chunks inflating
  // to exactly one filter byte plus one row of pixels per row.
  const PyResult png = run_python(dir, "png_ref.py", R"PY(
import struct, sys, zlib
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
for path in sys.argv[1:]:
    b = open(path, 'rb').read()
    assert b[:8] == b'\x89PNG\r\n\x1a\n', (path, b[:8])
    p, chunks = 8, []
    while p < len(b):
        length, kind = struct.unpack('>I4s', b[p:p + 8])
        data = b[p + 8:p + 8 + length]
        crc, = struct.unpack('>I', b[p + 8 + length:p + 12 + length])
        assert len(data) == length, (path, kind, 'truncated')
        assert zlib.crc32(kind + data) & 0xffffffff == crc, (path, kind, 'bad CRC')
        chunks.append((kind, data))
        p += 12 + length
    assert p == len(b), (path, 'trailing bytes')
    assert chunks[0][0] == b'IHDR' and chunks[-1] == (b'IEND', b''), [k for k, _ in chunks]
    w, h, depth, colour, comp, filt, interlace = struct.unpack('>IIBBBBB', chunks[0][1])
    assert depth == 8 and comp == 0 and filt == 0 and interlace == 0, (depth, comp, filt, interlace)
    c = CHANNELS[colour]
    raw = zlib.decompress(b''.join(d for k, d in chunks if k == b'IDAT'))
    assert len(raw) == h * (1 + w * c), (path, len(raw), h * (1 + w * c))
    assert all(raw[y * (1 + w * c)] <= 4 for y in range(h)), (path, 'bad filter type')
    print('png', w, h, c)
)PY",
                                  {dir + "/roc.png", dir + "/default.png"});
  ASSERT_EQ(png.status, 0) << png.out;
  EXPECT_EQ(png.out, "png 640 480 3\npng 800 600 3\n");
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.path().extension() == ".png" ? 1 : 0;
  EXPECT_EQ(files, 2u);  // no temporary left behind
  if (const char* keep = std::getenv("FACESHARD_KEEP_ROC_PNG")) fs::copy_file(dir + "/roc.png", keep, fs::copy_options::overwrite_existing);
  EXPECT_NE(error_of([&] { write_roc_png(curves, dir + "/x.png", "t", 10, 10); }).find("verification_metrics"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------
// TensorBoard

// TFRecord + protobuf decoding from the published format with the standard library only,
// CRC32C computed bit by bit (not table-driven, unlike ours).
const char* kTensorBoardReader = R"PY(
import struct, sys

def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF

def masked(crc):
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF

def varint(buf, p):
    shift = v = 0
    while True:
        b = buf[p]; p += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, p

def fields(buf):
    p = 0
    while p < len(buf):
        key, p = varint(buf, p)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, p = varint(buf, p)
        elif wt == 1:
            v = buf[p:p + 8]; p += 8
        elif wt == 2:
            n, p = varint(buf, p); v = buf[p:p + n]; p += n
        elif wt == 5:
            v = buf[p:p + 4]; p += 4
        else:
            raise ValueError('wire type %d' % wt)
        yield num, wt, v
    if p != len(buf):
        raise ValueError('message overruns its record')

data = open(sys.argv[1], 'rb').read()
p = 0
first = True
while p < len(data):
    header = data[p:p + 8]
    (length,) = struct.unpack('<Q', header)
    (len_crc,) = struct.unpack('<I', data[p + 8:p + 12])
    if masked(crc32c(header)) != len_crc:
        sys.exit('bad length crc at offset %d' % p)
    body = data[p + 12:p + 12 + length]
    if len(body) != length:
        sys.exit('truncated record at offset %d' % p)
    (data_crc,) = struct.unpack('<I', data[p + 12 + length:p + 16 + length])
    if masked(crc32c(body)) != data_crc:
        sys.exit('bad data crc at offset %d' % p)
    p += 16 + length
    wall = step = None
    version = None
    scalars = []
    for num, wt, v in fields(body):
        if num == 1 and wt == 1:
            (wall,) = struct.unpack('<d', v)
        elif num == 2 and wt == 0:
            step = v - (1 << 64) if v >= (1 << 63) else v
        elif num == 3 and wt == 2:
            version = v.decode('utf-8')
        elif num == 5 and wt == 2:
            for snum, swt, sv in fields(v):
                if snum != 1 or swt != 2:
                    sys.exit('unexpected Summary field %d' % snum)
                tag = value = None
                for vnum, vwt, vv in fields(sv):
                    if vnum == 1 and vwt == 2:
                        tag = vv.decode('utf-8')
                    elif vnum == 2 and vwt == 5:
                        (value,) = struct.unpack('<f', vv)
                scalars.append((tag, value))
        else:
            sys.exit('unexpected Event field %d' % num)
    if first:
        if version != 'brain.Event:2':
            sys.exit('first event is not the file version: %r' % version)
        print('version', version, repr(wall))
        first = False
        continue
    for tag, value in scalars:
        print('scalar', tag.encode('utf-8').hex(), step, repr(float(value)), repr(wall))
try:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
except Exception:
    print('tensorboard-package unavailable')
else:
    for ev in EventFileLoader(sys.argv[1]).Load():
        for v in ev.summary.value:
            val = v.simple_value if v.HasField('simple_value') else float(v.tensor.float_val[0])
            print('tb', v.tag.encode('utf-8').hex(), ev.step, repr(float(val)))
)PY";

std::string hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(d[c >> 4]);
    out.push_back(d[c & 15]);
  }
  return out;
}

TEST(TensorBoardEvents, Crc32cKnownAnswer) {
  // The CRC-32C check value from the catalogue of CRC algorithms (RFC 3720 B.4 family).
  const std::string s = "123456789";
  EXPECT_EQ(crc32c(s.data(), s.size()), 0xE3069283u);
  // RFC 3720 B.4: 32 bytes of zeros -> 0x8A9136AA.
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
}

TEST(TensorBoardEvents, EventsReadBackByIndependentParser) {
  const std::string dir = testing::temp_dir("tb");
  struct Scalar {
    std::string tag;
    double value;
    int64_t step;
  };
  const std::vector<Scalar> written = {
      {"loss", 1.5, 0},
      {"learning_rate", 0.1, 10},
      {"val/lfw/accuracy", 0.987654321, 2000},
      {"time_for_end", 12345.678, int64_t{1} << 40},
      {"neg", -0.25, -3},
      {"\xc3\xa9t\xc3\xa9 \"q\"", 3.0e-20, 7},  // UTF-8 tag, tiny value
  };
  std::string path;
  const double before = static_cast<double>(std::time(nullptr)) - 1;
  {
    TensorBoardWriter w(dir + "/tensorboard");
    path = w.path();
    for (const auto& s : written) w.add_scalar(s.tag, s.value, s.step);
    w.flush();
  }
  const std::string name = fs::path(path).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_NE(name.find("." + std::to_string(::getpid())), std::string::npos) << name;
  EXPECT_EQ(fs::path(path).parent_path(), fs::path(dir + "/tensorboard"));

  const PyResult r = run_python(dir, "tb_reader.py", kTensorBoardReader, {path});
  ASSERT_EQ(r.status, 0) << r.out;
  std::istringstream is(r.out);
  std::string line;
  size_t n = 0, tb = 0;
  bool version = false;
  while (std::getline(is, line)) {
    std::istringstream ls(line);
    std::string kind;
    ls >> kind;
    if (kind == "version") {
      version = true;
    } else if (kind == "scalar" || kind == "tb") {
      std::string tag, value, wall;
      int64_t step = 0;
      ls >> tag >> step >> value >> wall;
      const size_t i = kind == "scalar" ? n++ : tb++;
      ASSERT_LT(i, written.size()) << r.out;
      EXPECT_EQ(tag, hex(written[i].tag)) << line;
      EXPECT_EQ(step, written[i].step) << line;
      EXPECT_EQ(std::strtod(value.c_str(), nullptr), static_cast<double>(static_cast<float>(written[i].value))) << line;
      if (kind == "scalar") {
        const double w = std::strtod(wall.c_str(), nullptr);
        EXPECT_GE(w, before);
        EXPECT_LE(w, static_cast<double>(std::time(nullptr)) + 1);
      }
    }
  }
  EXPECT_TRUE(version) << r.out;
  EXPECT_EQ(n, written.size()) << r.out;
  if (r.out.find("tensorboard-package unavailable") == std::string::npos) { EXPECT_EQ(tb, written.size()) << r.out; }

  // The reader is not a rubber stamp: one flipped bit in a record must be caught.
  std::string bytes = slurp(path);
  ASSERT_GT(bytes.size(), 60u);
  bytes[bytes.size() - 10] ^= 0x01;
  spit(dir + "/corrupt", bytes);
  const PyResult bad = run_python(dir, "tb_reader.py", kTensorBoardReader, {dir + "/corrupt"});
  EXPECT_NE(bad.status, 0) << bad.out;
  EXPECT_NE(bad.out.find("crc"), std::string::npos) << bad.out;
}

TEST(TensorBoardEvents, TwoWritersInOneSecondGetTwoFiles) {
  const std::string dir = testing::temp_dir("tb");
  TensorBoardWriter a(dir);
  TensorBoardWriter b(dir);
  EXPECT_NE(a.path(), b.path());
  a.add_scalar("x", 1, 1);
  b.add_scalar("x", 2, 1);
  a.flush();
  b.flush();
  EXPECT_GT(fs::file_size(a.path()), 0u);
  EXPECT_GT(fs::file_size(b.path()), 0u);
}

// ---------------------------------------------------------------------------------------
// metrics.jsonl

// Prints, per field of each line: line number, key (UTF-8 hex), Python type, repr(value).
const char* kJsonReader = R"PY(
import json, sys
for i, line in enumerate(open(sys.argv[1], encoding='utf-8')):
    assert line.endswith('\n'), 'line %d not terminated' % i
    obj = json.loads(line)
    assert isinstance(obj, dict)
    for k, v in obj.items():
        print(i, k.encode('utf-8').hex(), type(v).__name__, repr(v))
)PY";

struct JsonField {
  int line;
  std::string key_hex, type, value;
};

std::vector<JsonField> read_jsonl(const std::string& dir, const std::string& path) {
  const PyResult r = run_python(dir, "json_reader.py", kJsonReader, {path});
  EXPECT_EQ(r.status, 0) << r.out;
  std::vector<JsonField> out;
  std::istringstream is(r.out);
  JsonField f;
  while (is >> f.line >> f.key_hex >> f.type >> f.value) out.push_back(f);
  return out;
}

TEST(AppMetricsLog, LinesParseWithPythonJson) {
  const std::string dir = testing::temp_dir("metrics");
  const std::string path = dir + "/out/metrics.jsonl";
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const std::vector<std::vector<std::pair<std::string, double>>> lines = {
      {{"step", 10}, {"epoch", 0}, {"loss", 1.5}, {"lr", 0.1}, {"samples_per_sec", 1234.5678}},
      {{"step", 20}, {"epoch", 1}, {"loss", nan}, {"loss_scale", inf}, {"val/lfw/accuracy", 0.99833333333333329}},
      {{"step", 1e12}, {"weird \"key\"\\\n\t\x01 \xc3\xa9", -3.25e-300}, {"big", 1e300}, {"third", 1.0 / 3}},
  };
  {
    MetricsLog log(path, false);
    for (const auto& l : lines) {
      log.write(l);
      // Flushed after each line: a reader sees it before the log is closed.
      std::string text = slurp(path);
      EXPECT_EQ(text.back(), '\n');
    }
  }
  const std::vector<JsonField> got = read_jsonl(dir, path);
  size_t k = 0;
  for (size_t li = 0; li < lines.size(); ++li)
    for (const auto& [key, value] : lines[li]) {
      ASSERT_LT(k, got.size());
      const JsonField& f = got[k++];
      EXPECT_EQ(f.line, static_cast<int>(li));
      EXPECT_EQ(f.key_hex, hex(key));
      if (!std::isfinite(value)) {
        EXPECT_EQ(f.type, "NoneType") << key;
      } else {
        if (key == "step" || key == "epoch") { EXPECT_EQ(f.type, "int") << key << " " << f.value; }
        EXPECT_EQ(std::strtod(f.value.c_str(), nullptr), value) << key << " " << f.value;
      }
    }
  EXPECT_EQ(k, got.size());

  // append=true continues the file; append=false starts it again.
  { MetricsLog(path, true).write({{"step", 30}}); }
  EXPECT_EQ(read_jsonl(dir, path).back().line, 3);
  { MetricsLog(path, false).write({{"step", 40}}); }
  const auto fresh = read_jsonl(dir, path);
  ASSERT_EQ(fresh.size(), 1u);
  EXPECT_EQ(fresh[0].value, "40");
}

TEST(AppMetricsLog, JsonEscapeRoundTripsEveryByte) {
  // Every control character and the two specials, through Python's json.loads.
  std::string s;
  for (int c = 1; c < 0x80; ++c) s.push_back(static_cast<char>(c));
  s += "\xe2\x82\xac";  // a multi-byte UTF-8 character passes through
  const std::string dir = testing::temp_dir("metrics");
  spit(dir + "/s.json", "\"" + json_escape(s) + "\"");
  const PyResult r = run_python(dir, "esc.py", R"PY(
import json, sys
print(json.load(open(sys.argv[1], encoding='utf-8')).encode('utf-8').hex())
)PY",
                                {dir + "/s.json"});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out, hex(s) + "\n");
  EXPECT_EQ(json_number(0.1), "0.1");
  EXPECT_EQ(json_number(std::nan("")), "null");
}

// The readout hands back exactly the values posted, in order (an int64 counter and a
// float loss alike), reads an undefined value as 0, refuses a value that is not a scalar,
// and a callback that throws leaves the later posts for the next delivery.
TEST(DeviceReadout, DeliversWhatWasPostedInOrder) {
  DeviceReadout r;
  std::vector<std::vector<double>> got;
  auto keep = [&](const std::vector<double>& v) { got.push_back(v); };
  const at::Tensor loss = torch::tensor(2.75f), count = torch::tensor(int64_t{1} << 40);
  r.post({loss, count, at::Tensor()}, keep);
  r.post({torch::tensor(-1.5, torch::kDouble).reshape({1, 1})}, keep);
  EXPECT_EQ(r.pending(), 2u);
  EXPECT_EQ(r.deliver(false), 2);  // CPU values are ready at once
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], (std::vector<double>{2.75, std::ldexp(1.0, 40), 0.0}));
  EXPECT_EQ(got[1], (std::vector<double>{-1.5}));
  EXPECT_THROW(r.post({torch::zeros({2})}, keep), std::exception);
  r.post({loss}, [](const std::vector<double>&) { throw std::runtime_error("the loss became NaN"); });
  r.post({loss}, keep);
  EXPECT_THROW(r.deliver(true), std::runtime_error);
  EXPECT_EQ(r.pending(), 1u);
  EXPECT_EQ(r.deliver(true), 1);
  EXPECT_EQ(got.size(), 3u);
  EXPECT_EQ(r.pending(), 0u);
}

}  // namespace
}  // namespace faceshard
