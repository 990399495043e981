#include "app/eval/verification_metrics.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <numeric>

#include <opencv2/core.hpp>
#include <opencv2/imgproc.hpp>

#include "data/image_encode.h"
#include "base/error.h"

namespace faceshard {

namespace {

constexpr const char* kFile = "verification_metrics";

// np.arange(0, 4, 0.01): numpy fills start + i * step, so i * 0.01 reproduces its values
// bit for bit (accumulating 0.01 would not).
constexpr int kNumThresholds = 400;
double threshold_at(int i) { return static_cast<double>(i) * 0.01; }

std::string temp_name(const std::string& path, const std::string& suffix) {
  return path + ".tmp" + std::to_string(::getpid()) + suffix;
}

void make_parent_dirs(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (parent.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(parent, ec);
  if (ec) throw runtime_error(kFile, ": cannot create directory '", parent.string(), "': ", ec.message());
}

void rename_into_place(const std::string& tmp, const std::string& path) {
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    throw runtime_error(kFile, ": cannot rename '", tmp, "' to '", path, "'");
  }
}

void check_roc(const RocCurve& roc, const char* what) {
  if (roc.fpr.empty() || roc.fpr.size() != roc.tpr.size())
    throw usage_error(kFile, ": ", what, ": empty ROC or fpr/tpr sizes differ (", roc.fpr.size(), " vs ",
                      roc.tpr.size(), ")");
}

}  // namespace

KFoldResult kfold_verification(const at::Tensor& distances, const std::vector<bool>& issame, int folds) {
  if (!distances.defined() || distances.dim() != 1)
    throw usage_error(kFile, ": kfold_verification: distances must be a 1-D tensor");
  const int64_t n = distances.numel();
  if (n != static_cast<int64_t>(issame.size()))
    throw usage_error(kFile, ": kfold_verification: ", n, " distances but ", issame.size(), " labels");
  if (folds < 1 || folds > n)
    throw usage_error(kFile, ": kfold_verification: folds must be in [1, ", n, "], got ", folds);
  // Float distances widen exactly to double, which is what numpy does when it compares a
  // float32 array with the float64 thresholds.
  const at::Tensor d = distances.detach().to(at::kCPU, at::kDouble).contiguous();
  const double* dist = d.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(dist[i])) throw usage_error(kFile, ": kfold_verification: distance ", i, " is NaN");

  // sklearn KFold(shuffle=False): contiguous folds, the first n % folds one longer.
  std::vector<int64_t> begin(folds + 1, 0);
  for (int f = 0; f < folds; ++f) begin[f + 1] = begin[f] + n / folds + (f < n % folds ? 1 : 0);

  // correct[f][t]: pairs of fold f classified right at threshold t. Training accuracy of
  // fold f is then (total - own) / (n - n_f); the denominator is the same for every
  // threshold, so the first argmax over counts is the first argmax over accuracies.
  std::vector<int64_t> correct(static_cast<size_t>(folds) * kNumThresholds, 0);
  std::vector<int64_t> total(kNumThresholds, 0);
  for (int f = 0; f < folds; ++f) {
    int64_t* row = &correct[static_cast<size_t>(f) * kNumThresholds];
    for (int64_t i = begin[f]; i < begin[f + 1]; ++i) {
      const bool same = issame[i];
      for (int t = 0; t < kNumThresholds; ++t) row[t] += ((dist[i] < threshold_at(t)) == same) ? 1 : 0;
    }
    for (int t = 0; t < kNumThresholds; ++t) total[t] += row[t];
  }

  KFoldResult r;
  double threshold_sum = 0;
  for (int f = 0; f < folds; ++f) {
    const int64_t* own = &correct[static_cast<size_t>(f) * kNumThresholds];
    int best = 0;
    int64_t best_count = -1;
    for (int t = 0; t < kNumThresholds; ++t) {
      // insightface's LFold with one split trains and tests on everything.
      const int64_t train = folds == 1 ? total[t] : total[t] - own[t];
      if (train > best_count) {
        best_count = train;
        best = t;
      }
    }
    const int64_t n_test = begin[f + 1] - begin[f];
    r.fold_accuracy.push_back(static_cast<double>(own[best]) / static_cast<double>(n_test));
    threshold_sum += threshold_at(best);
  }
  const double k = static_cast<double>(folds);
  r.accuracy_mean = std::accumulate(r.fold_accuracy.begin(), r.fold_accuracy.end(), 0.0) / k;
  double var = 0;
  for (double a : r.fold_accuracy) var += (a - r.accuracy_mean) * (a - r.accuracy_mean);
  r.accuracy_std = std::sqrt(var / k);  // population std, numpy's default (ddof=0)
  r.best_threshold = threshold_sum / k;
  return r;
}

at::Tensor pair_distances(const at::Tensor& emb1, const at::Tensor& emb2) {
  if (!emb1.defined() || !emb2.defined() || emb1.dim() != 2 || emb1.sizes() != emb2.sizes())
    throw usage_error(kFile, ": pair_distances: expected two [P, D] tensors of the same shape");
  const at::Tensor a = emb1.detach().to(at::kCPU, at::kDouble);
  const at::Tensor b = emb2.detach().to(at::kCPU, at::kDouble);
  // clamp_min keeps an all-zero row at zero, as sklearn.preprocessing.normalize does.
  const at::Tensor na = a / a.norm(2, {1}, true).clamp_min(1e-12);
  const at::Tensor nb = b / b.norm(2, {1}, true).clamp_min(1e-12);
  return (na - nb).pow(2).sum({1}).contiguous();
}

RocCurve roc_curve(const std::vector<double>& scores, const std::vector<int>& labels) {
  const size_t n = scores.size();
  if (n != labels.size())
    throw usage_error(kFile, ": roc_curve: ", n, " scores but ", labels.size(), " labels");
  size_t positives = 0;
  for (size_t i = 0; i < n; ++i) {
    if (labels[i] != 0 && labels[i] != 1)
      throw usage_error(kFile, ": roc_curve: label ", i, " is ", labels[i], ", expected 0 or 1");
    if (!std::isfinite(scores[i])) throw usage_error(kFile, ": roc_curve: score ", i, " is not finite");
    positives += static_cast<size_t>(labels[i]);
  }
  const size_t negatives = n - positives;
  if (positives == 0 || negatives == 0)
    throw usage_error(kFile, ": roc_curve: needs genuine and impostor pairs, got ", positives, " genuine and ",
                      negatives, " impostor");

  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return scores[a] > scores[b]; });

  // Sized exactly: IJB-C has 15.7M pairs, and growth by doubling could hold twice that.
  size_t points = 1;
  for (size_t i = 0; i < n; ++i) points += (i + 1 == n || scores[order[i + 1]] != scores[order[i]]) ? 1 : 0;
  RocCurve roc;
  roc.fpr.reserve(points);
  roc.tpr.reserve(points);
  roc.thresholds.reserve(points);
  roc.fpr.push_back(0.0);
  roc.tpr.push_back(0.0);
  roc.thresholds.push_back(std::numeric_limits<double>::infinity());
  size_t tps = 0;
  for (size_t i = 0; i < n; ++i) {
    tps += static_cast<size_t>(labels[order[i]]);
    // One point per distinct score: after the last pair with that score.
    if (i + 1 == n || scores[order[i + 1]] != scores[order[i]]) {
      const size_t fps = i + 1 - tps;
      roc.fpr.push_back(static_cast<double>(fps) / static_cast<double>(negatives));
      roc.tpr.push_back(static_cast<double>(tps) / static_cast<double>(positives));
      roc.thresholds.push_back(scores[order[i]]);
    }
  }
  return roc;
}

int64_t negatives_needed(double far) {
  if (!(far > 0)) throw runtime_error(kFile, ": FAR must be > 0, got ", far);
  // 1/1e-4 is 10000 up to rounding: not 10001.
  return static_cast<int64_t>(std::ceil(1.0 / far - 1e-6));
}

std::string far_label(double far) {
  const double e = std::round(std::log10(far));
  char buf[32];
  if (std::fabs(std::pow(10.0, e) - far) <= 1e-12 * far) std::snprintf(buf, sizeof buf, "1e%d", static_cast<int>(e));
  else std::snprintf(buf, sizeof buf, "%g", far);
  return buf;
}

std::string tar_at_far_json(double tar, double far, int64_t negatives) {
  if (negatives < negatives_needed(far) || !std::isfinite(tar)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", tar);
  return buf;
}

std::string tar_at_far_text(double tar, double far, int64_t negatives, int decimals, bool percent) {
  const int64_t needed = negatives_needed(far);
  if (negatives < needed)
    return "not enough pairs (" + std::to_string(negatives) + " negatives, " + std::to_string(needed) + " needed)";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, percent ? tar * 100 : tar);
  return buf;
}

double tar_at_far(const RocCurve& roc, double far) {
  check_roc(roc, "tar_at_far");
  // eval_ijbc.py flips the arrays and takes min over (|fpr - far|, index): the smallest
  // flipped index is the largest original one, hence "<=" here.
  size_t best = 0;
  double best_diff = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < roc.fpr.size(); ++i) {
    const double diff = std::abs(roc.fpr[i] - far);
    if (diff <= best_diff) {
      best_diff = diff;
      best = i;
    }
  }
  return roc.tpr[best];
}

double tar_at_far_exact(const RocCurve& roc, double far) {
  check_roc(roc, "tar_at_far_exact");
  double best = 0;
  for (size_t i = 0; i < roc.fpr.size(); ++i)
    if (roc.fpr[i] <= far) best = std::max(best, roc.tpr[i]);
  return best;
}

double roc_auc(const RocCurve& roc) {
  check_roc(roc, "roc_auc");
  double area = 0;
  for (size_t i = 1; i < roc.fpr.size(); ++i)
    area += (roc.fpr[i] - roc.fpr[i - 1]) * (roc.tpr[i] + roc.tpr[i - 1]) / 2;
  return area;
}

void write_roc_csv(const RocCurve& roc, const std::string& path) {
  check_roc(roc, "write_roc_csv");
  if (roc.thresholds.size() != roc.fpr.size())
    throw usage_error(kFile, ": write_roc_csv: ", roc.thresholds.size(), " thresholds for ", roc.fpr.size(),
                      " points");
  make_parent_dirs(path);
  const std::string tmp = temp_name(path, "");
  {
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    if (!f) throw runtime_error(kFile, ": cannot open '", tmp, "' for writing");
    bool ok = std::fputs("fpr,tpr,cosine_threshold\n", f) >= 0;
    for (size_t i = 0; ok && i < roc.fpr.size(); ++i)
      ok = std::fprintf(f, "%.17g,%.17g,%.17g\n", roc.fpr[i], roc.tpr[i], roc.thresholds[i]) > 0;
    ok = (std::fclose(f) == 0) && ok;
    if (!ok) {
      std::remove(tmp.c_str());
      throw runtime_error(kFile, ": write failed for '", tmp, "'");
    }
  }
  rename_into_place(tmp, path);
}

namespace {

// matplotlib's tab10 colours (BGR), so the plots look like the Python tools' plots.
const cv::Scalar kPalette[] = {{180, 119, 31}, {14, 127, 255},  {44, 160, 44},  {40, 39, 214},
                               {189, 103, 148}, {75, 86, 140},  {194, 119, 227}, {127, 127, 127},
                               {34, 189, 188},  {207, 190, 23}};
constexpr double kMinLogFpr = -6.0;  // x axis from 1e-6 to 1

void put_text_centered(cv::Mat& img, const std::string& text, cv::Point center, double scale, int thickness) {
  int baseline = 0;
  const cv::Size sz = cv::getTextSize(text, cv::FONT_HERSHEY_SIMPLEX, scale, thickness, &baseline);
  cv::putText(img, text, cv::Point(center.x - sz.width / 2, center.y + sz.height / 2), cv::FONT_HERSHEY_SIMPLEX,
              scale, cv::Scalar(0, 0, 0), thickness, cv::LINE_AA);
}

}  // namespace

void write_roc_png(const std::vector<std::pair<std::string, RocCurve>>& curves, const std::string& path,
                   const std::string& title) {
  write_roc_png(curves, path, title, 800, 600);
}

void write_roc_png(const std::vector<std::pair<std::string, RocCurve>>& curves, const std::string& path,
                   const std::string& title, int width, int height) {
  if (width < 320 || height < 240 || width > 8000 || height > 8000)
    throw usage_error(kFile, ": write_roc_png: image size ", width, "x", height, " outside 320x240 .. 8000x8000");
  for (const auto& c : curves) check_roc(c.second, "write_roc_png");

  cv::Mat img(height, width, CV_8UC3, cv::Scalar(255, 255, 255));
  const int left = 80, right = 25, top = 50, bottom = 65;
  const int x0 = left, x1 = width - right, y0 = top, y1 = height - bottom;
  auto px = [&](double fpr) {
    const double lx = std::log10(std::clamp(fpr, 1e-6, 1.0));
    return x0 + static_cast<int>(std::lround((lx - kMinLogFpr) / -kMinLogFpr * (x1 - x0)));
  };
  auto py = [&](double tpr) { return y1 - static_cast<int>(std::lround(std::clamp(tpr, 0.0, 1.0) * (y1 - y0))); };

  // Grid: a light line per decade and a fainter one for 2..9 x decade; TPR every 0.1.
  const cv::Scalar major(200, 200, 200), minor(235, 235, 235);
  for (int e = -6; e < 0; ++e)
    for (int m = 2; m <= 9; ++m) {
      const int x = px(m * std::pow(10.0, e));
      cv::line(img, {x, y0}, {x, y1}, minor, 1);
    }
  for (int e = -6; e <= 0; ++e) {
    const int x = px(std::pow(10.0, e));
    cv::line(img, {x, y0}, {x, y1}, major, 1);
    put_text_centered(img, e == 0 ? "1" : "1e" + std::to_string(e), {x, y1 + 16}, 0.45, 1);
  }
  for (int k = 0; k <= 10; ++k) {
    const int y = py(k / 10.0);
    cv::line(img, {x0, y}, {x1, y}, k % 2 == 0 ? major : minor, 1);
    if (k % 2 == 0) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "%.1f", k / 10.0);
      put_text_centered(img, buf, {x0 - 22, y}, 0.45, 1);
    }
  }
  cv::rectangle(img, {x0, y0}, {x1, y1}, cv::Scalar(0, 0, 0), 1);
  put_text_centered(img, "False Positive Rate (log scale)", {(x0 + x1) / 2, height - 22}, 0.55, 1);
  put_text_centered(img, title, {width / 2, top / 2}, 0.65, 2);
  {
    // putText cannot draw vertically: draw the label on its own strip and rotate it.
    const std::string label = "True Positive Rate";
    int baseline = 0;
    const cv::Size sz = cv::getTextSize(label, cv::FONT_HERSHEY_SIMPLEX, 0.55, 1, &baseline);
    cv::Mat strip(sz.height + baseline + 4, sz.width + 4, CV_8UC3, cv::Scalar(255, 255, 255));
    cv::putText(strip, label, {2, sz.height + 2}, cv::FONT_HERSHEY_SIMPLEX, 0.55, cv::Scalar(0, 0, 0), 1, cv::LINE_AA);
    cv::rotate(strip, strip, cv::ROTATE_90_COUNTERCLOCKWISE);
    const int sx = 8, sy = (y0 + y1) / 2 - strip.rows / 2;
    if (sy >= 0 && sy + strip.rows <= height && sx + strip.cols < x0 - 40)
      strip.copyTo(img(cv::Rect(sx, sy, strip.cols, strip.rows)));
  }

  for (size_t c = 0; c < curves.size(); ++c) {
    const RocCurve& roc = curves[c].second;
    const cv::Scalar colour = kPalette[c % (sizeof kPalette / sizeof kPalette[0])];
    // Points at FPR 0 have no place on a log axis, and nothing is measured between 0 and
    // the smallest FPR the negatives allow (1 / negatives): the curve starts at its first
    // point of FPR > 0 (a line from the left edge to it would draw TPRs no pair measured).
    // Consecutive points that land on the same pixel are merged: IJB-C ROCs have millions
    // of points.
    size_t first = 0;
    while (first < roc.fpr.size() && roc.fpr[first] <= 0) ++first;
    if (first == roc.fpr.size()) continue;
    std::vector<cv::Point> pts;
    for (size_t i = first; i < roc.fpr.size(); ++i) {
      const cv::Point p(px(roc.fpr[i]), py(roc.tpr[i]));
      if (pts.empty() || pts.back() != p) pts.push_back(p);
    }
    if (pts.size() == 1) cv::circle(img, pts[0], 2, colour, cv::FILLED, cv::LINE_AA);
    cv::polylines(img, pts, false, colour, 2, cv::LINE_AA);
  }

  if (!curves.empty()) {
    // Legend in the lower right corner of the plot, where ROC curves rarely go.
    const double scale = 0.5;
    int text_w = 0, text_h = 0, baseline = 0;
    for (const auto& c : curves) {
      const cv::Size sz = cv::getTextSize(c.first, cv::FONT_HERSHEY_SIMPLEX, scale, 1, &baseline);
      text_w = std::max(text_w, sz.width);
      text_h = std::max(text_h, sz.height);
    }
    const int row = text_h + 10, pad = 8, swatch = 28;
    const int box_w = std::min(pad + swatch + 8 + text_w + pad, x1 - x0 - 10);
    const int box_h = std::min(pad + row * static_cast<int>(curves.size()) + pad / 2, y1 - y0 - 10);
    const cv::Point tl(x1 - 10 - box_w, y1 - 10 - box_h);
    cv::rectangle(img, tl, {tl.x + box_w, tl.y + box_h}, cv::Scalar(255, 255, 255), cv::FILLED);
    cv::rectangle(img, tl, {tl.x + box_w, tl.y + box_h}, cv::Scalar(150, 150, 150), 1);
    for (size_t c = 0; c < curves.size(); ++c) {
      const int cy = tl.y + pad + row * static_cast<int>(c) + row / 2;
      if (cy > tl.y + box_h) break;
      const cv::Scalar colour = kPalette[c % (sizeof kPalette / sizeof kPalette[0])];
      cv::line(img, {tl.x + pad, cy}, {tl.x + pad + swatch, cy}, colour, 2, cv::LINE_AA);
      cv::putText(img, curves[c].first, {tl.x + pad + swatch + 8, cy + text_h / 2}, cv::FONT_HERSHEY_SIMPLEX, scale,
                  cv::Scalar(0, 0, 0), 1, cv::LINE_AA);
    }
  }

  make_parent_dirs(path);
  const std::vector<uint8_t> png = encode_png(img);
  const std::string tmp = temp_name(path, ".png");
  bool ok = false;
  if (std::FILE* f = std::fopen(tmp.c_str(), "wb")) {
    ok = std::fwrite(png.data(), 1, png.size(), f) == png.size();
    ok = std::fclose(f) == 0 && ok;
  }
  if (!ok) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    throw runtime_error(kFile, ": cannot write PNG '", tmp, "'");
  }
  rename_into_place(tmp, path);
}

}  // namespace faceshard
