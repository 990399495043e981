#include "app/eval/evaluation.h"

#include <algorithm>
#include <map>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <optional>
#include <unordered_set>

#include <ATen/Parallel.h>
#include <opencv2/imgproc.hpp>

#include "data/image_transform.h"
#include "data/verification_bin.h"
#include "models/gate_conditioning.h"
#include "base/error.h"
#include "base/log.h"
#include "base/progress.h"

namespace faceshard {

namespace {

constexpr int64_t kImageFloats = 3 * 112 * 112;

// The embeddings just computed are float32 rounding's more than the model's
// (models/gate_conditioning.h): one warning per process, the first time it is seen.
void warn_if_gates_undecided(GateConditioning& c, const Backbone& model) {
  static std::atomic<bool> warned{false};
  settle_gate_conditioning(c);
  const std::string line = describe_gate_conditioning(c, model.options().name);
  if (!line.empty() && !warned.exchange(true)) log_warn(line);
}

std::string image_where(const std::string& path, int64_t i) {
  return detail::concat(path, ": pair ", i / 2, ", image ", i);
}

void decode_normalized(const ImageBytes& bytes, const std::string& where, float* dst) {
  cv::Mat bgr = decode_image(bytes.data(), bytes.size(), where);
  if (bgr.rows != 112 || bgr.cols != 112) cv::resize(bgr, bgr, cv::Size(112, 112), 0, 0, cv::INTER_LINEAR);
  bgr_to_normalized_chw(bgr, false, dst);
}

}  // namespace

int64_t VerificationData::num_images() const {
  return pixels.defined() ? pixels.size(0) : static_cast<int64_t>(images.size());
}

void VerificationData::fill(int64_t begin, int64_t n, float* dst) const {
  if (pixels.defined()) {
    const at::Tensor src = pixels.narrow(0, begin, n).contiguous();
    std::copy(src.data_ptr<float>(), src.data_ptr<float>() + n * kImageFloats, dst);
    return;
  }
  at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      decode_normalized(images[size_t(begin + i)], image_where(path, begin + i), dst + i * kImageFloats);
  });
}

VerificationData load_verification_data(const std::string& path) {
  VerificationSet set = read_verification_bin(path);
  VerificationData d;
  d.name = std::filesystem::path(path).stem().string();
  d.path = path;
  d.issame = std::move(set.issame);
  d.images = std::move(set.images);
  // Checked here, where the file is known: the metrics would otherwise fail on it later
  // with a message that names no file.
  const size_t genuine = static_cast<size_t>(std::count(d.issame.begin(), d.issame.end(), true));
  if (d.issame.empty()) throw runtime_error(path, ": the verification set has no pairs");
  if (genuine == 0 || genuine == d.issame.size())
    throw runtime_error(path, ": ", d.issame.size(), " pairs, all ", genuine ? "genuine" : "impostor",
                        "; the protocol needs genuine and impostor pairs");
  // Each distinct image is decoded once here (and dropped): a repeated reference shares
  // its buffer and its check. The first in file order names a bad one.
  std::vector<int64_t> distinct;
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < d.images.size(); ++i)
    if (seen.insert(&d.images[i].bytes()).second) distinct.push_back(int64_t(i));
  std::vector<std::string> errors(distinct.size());
  std::vector<std::pair<int, int>> sizes(distinct.size());
  at::parallel_for(0, int64_t(distinct.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const int64_t i = distinct[size_t(k)];
      try {
        const cv::Mat bgr = decode_image(d.images[size_t(i)].data(), d.images[size_t(i)].size(), image_where(path, i));
        sizes[size_t(k)] = {bgr.cols, bgr.rows};
      } catch (const Error& e) {
        errors[size_t(k)] = e.what();
      }
    }
  });
  for (const std::string& e : errors)
    if (!e.empty()) throw runtime_error(e);
  std::map<std::pair<int, int>, int64_t> other;
  for (const auto& wh : sizes)
    if (wh.first != 112 || wh.second != 112) other[wh]++, d.other_size_images++;
  if (d.other_size_images > 0) {
    const auto most = std::max_element(other.begin(), other.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
    d.other_size = std::to_string(most->first.first) + "x" + std::to_string(most->first.second);
    log_warn(path, ": ", d.other_size_images, " of its ", distinct.size(), " images are not 112x112 (",
             other.size() == 1 ? "all " : "most ", d.other_size, "): they are resized without aligning, which scores "
             "far below aligned faces; make aligned 112x112 faces with faceshard-pack pairs FOLDER OUT.bin --landmarks "
             "FILE (or --resize 112)");
  }
  return d;
}

namespace {
// The embeddings of the images and of their mirrors, [N, E] each, in double: insightface's
// verification.py stores each pass in a float64 array and sums them there, so distances
// near a threshold round as they do there. The images are decoded a batch at a time into
// one reused buffer.
std::pair<at::Tensor, at::Tensor> flip_pass_embeddings(Backbone& model, const VerificationData& data, int64_t batch,
                                                       torch::Device device, bool progress = false) {
  std::optional<Progress> bar;
  if (progress) bar.emplace("embedding " + data.name, static_cast<uint64_t>(data.num_images()), "images");
  torch::NoGradGuard ng;
  const bool was_training = model.is_training();
  model.eval();
  const int64_t n = data.num_images();
  std::vector<at::Tensor> plain, mirrored;
  at::Tensor images = torch::empty({std::min(batch, std::max<int64_t>(n, 1)), 3, 112, 112});
  GateConditioning gates;
  GateConditioningScope gate_scope(gates);
  for (int64_t s = 0; s < n; s += batch) {
    const int64_t b = std::min(batch, n - s);
    data.fill(s, b, images.data_ptr<float>());
    at::Tensor x = images.narrow(0, 0, b).to(device);
    plain.push_back(model.forward(x).to(torch::kFloat).cpu().to(torch::kDouble));
    mirrored.push_back(model.forward(x.flip({3})).to(torch::kFloat).cpu().to(torch::kDouble));
    if (bar) bar->update(static_cast<uint64_t>(s + b));
  }
  model.train(was_training);
  warn_if_gates_undecided(gates, model);
  if (plain.empty()) {
    const at::Tensor none = torch::zeros({0, model.embedding_size()}, torch::kDouble);
    return {none, none};
  }
  return {torch::cat(plain), torch::cat(mirrored)};
}
}  // namespace

at::Tensor embed_images(Backbone& model, int64_t n, const ImageSource& load, int64_t batch, torch::Device device,
                        bool flip, bool normalize, bool progress) {
  std::optional<Progress> bar;
  if (progress) bar.emplace("embedding", static_cast<uint64_t>(n), "images");
  torch::NoGradGuard ng;
  const bool was_training = model.is_training();
  model.eval();
  at::Tensor out = torch::empty({n, model.embedding_size()});
  at::Tensor images = torch::empty({std::min(batch, std::max<int64_t>(n, 1)), 3, 112, 112});
  GateConditioning gates;
  GateConditioningScope gate_scope(gates);
  for (int64_t s = 0; s < n; s += batch) {
    const int64_t b = std::min(batch, n - s);
    float* dst = images.data_ptr<float>();
    at::parallel_for(0, b, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        cv::Mat bgr = load(s + i);
        if (bgr.rows != 112 || bgr.cols != 112) cv::resize(bgr, bgr, cv::Size(112, 112), 0, 0, cv::INTER_LINEAR);
        bgr_to_normalized_chw(bgr, false, dst + i * 3 * 112 * 112);
      }
    });
    at::Tensor x = images.narrow(0, 0, b).to(device);
    at::Tensor e = model.forward(x);
    if (flip) e = e + model.forward(x.flip({3}));
    out.narrow(0, s, b).copy_(e.to(torch::kFloat).cpu());
    if (bar) bar->update(static_cast<uint64_t>(s + b));
  }
  model.train(was_training);
  warn_if_gates_undecided(gates, model);
  if (normalize) out = torch::nn::functional::normalize(out, torch::nn::functional::NormalizeFuncOptions().dim(1));
  return out;
}

at::Tensor embed_with_flip(Backbone& model, const VerificationData& data, int64_t batch, torch::Device device) {
  const auto passes = flip_pass_embeddings(model, data, batch, device);
  // F::normalize's formula (x / max(|x|, 1e-12)), written out: its options temporary trips a
  // false -Wmaybe-uninitialized in g++ 12 here.
  const at::Tensor sum = passes.first + passes.second;
  return (sum / sum.norm(2, {1}, /*keepdim=*/true).clamp_min(1e-12)).to(torch::kFloat);
}

void check_verification_folds(const VerificationData& data, int64_t folds) {
  const int64_t pairs = static_cast<int64_t>(data.issame.size());
  const std::string what = data.path.empty() ? "verification set '" + data.name + "'" : data.path;
  if (folds < 1) throw usage_error(what, ": folds must be at least 1, got ", folds);
  if (pairs < folds)
    throw usage_error(what, ": ", pairs, " pairs, fewer than the ", folds,
                      " folds of the protocol (faceshard-verify --folds K takes K <= ", pairs, ")");
}

VerificationResult evaluate_verification(Backbone& model, const VerificationData& data, int64_t batch,
                                         torch::Device device, int64_t folds, bool progress) {
  check_verification_folds(data, folds);
  const auto passes = flip_pass_embeddings(model, data, batch, device, progress);
  VerificationResult r;
  // As verification.py: the mean L2 norm over the rows of both passes taken separately
  // (not the norm of their sum, which is about twice as large).
  r.xnorm = torch::cat({passes.first, passes.second}).norm(2, 1).mean().item<double>();
  const at::Tensor raw = passes.first + passes.second;
  at::Tensor e1 = raw.slice(0, 0, raw.size(0), 2), e2 = raw.slice(0, 1, raw.size(0), 2);
  at::Tensor dist = pair_distances(e1, e2);
  r.kfold = kfold_verification(dist, data.issame, static_cast<int>(folds));
  // Scores for the ROC: cosine similarity (higher = same), 1 - d/2 for unit vectors.
  at::Tensor score = (1 - dist / 2).to(torch::kDouble).contiguous();
  std::vector<double> scores(score.data_ptr<double>(), score.data_ptr<double>() + score.numel());
  std::vector<int> labels(data.issame.begin(), data.issame.end());
  r.roc = roc_curve(scores, labels);
  r.tar_at_far_1e3 = tar_at_far(r.roc, 1e-3);
  r.tar_at_far_1e4 = tar_at_far(r.roc, 1e-4);
  double sum = 0;
  int64_t negatives = 0;
  for (size_t i = 0; i < scores.size(); ++i)
    if (!labels[i]) sum += scores[i], negatives++;
  r.negative_cosine = negatives ? sum / static_cast<double>(negatives) : 0;
  return r;
}

}  // namespace faceshard
