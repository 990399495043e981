// AdaFace (Kim et al., CVPR 2022; mk-minchul/AdaFace head.py): the margin of each row
// follows its feature norm, standardised by running statistics of the norms (EMA with
// t_alpha over the global batch): angular margin -m * z on the target's angle (clipped to
// [eps, pi - eps]) and additive margin m + m * z on its cosine, z = clip(h * (a - mean) /
// (std + eps), -1, 1), a the detached norm clipped to [0.001, 100]; every cosine is clamped
// to [-1 + eps, 1 - eps], eps = 1e-3. The gradient is the authors' autograd's.
#include <cmath>
#include <map>
#include <memory>
#include <string>

#include "partial_fc/classifier/margin_head.h"
#include "base/error.h"

namespace faceshard {
namespace {

class AdaFaceHead : public MarginHead {
 public:
  explicit AdaFaceHead(const std::map<std::string, double>& p);
  std::string name() const override { return "adaface"; }
  double scale() const override { return s_; }
  bool needs_norms() const override { return true; }
  HeadRows begin_forward(const HeadInputs& in) override;
  at::Tensor target(const at::Tensor& c, const HeadRows& rows) const override;
  at::Tensor target_grad(const at::Tensor& c, const HeadRows& rows) const override;
  bool modifies_negatives() const override { return true; }
  void negatives_forward(at::Tensor logits, at::Tensor codes, const HeadRows& rows) const override;
  void negatives_backward(at::Tensor grad, const at::Tensor& logits, const at::Tensor& codes,
                          const HeadRows& rows) const override;
  std::vector<std::pair<std::string, at::Tensor>> state() const override;
  void load_state(const std::string& key, const at::Tensor& value, const std::string& source) override;

 private:
  static constexpr double kEps = 1e-3, kMean0 = 20.0, kStd0 = 100.0;
  // The statistics live on the device of the norms they standardise. Until a forward or a
  // load sets them they hold the initial values, which are then made on that device (a
  // fill, not a copy from the host: the first step on a GPU neither copies nor waits). A
  // loaded state stays on the device it was loaded on (the trainer's: the job's device).
  void place(const at::Device& device);
  double m_, h_, s_, t_alpha_;
  bool initial_ = true;
  at::Tensor batch_mean_, batch_std_;  // [1] fp32
};

AdaFaceHead::AdaFaceHead(const std::map<std::string, double>& p)
    : m_(p.at("m")), h_(p.at("h")), s_(p.at("s")), t_alpha_(p.at("t_alpha")) {
  place(at::kCPU);
}

void AdaFaceHead::place(const at::Device& device) {
  if (batch_mean_.defined() && batch_mean_.device() == device) return;
  if (!batch_mean_.defined() || initial_) {
    const auto o = at::TensorOptions().device(device).dtype(at::kFloat);
    batch_mean_ = at::full({1}, kMean0, o);
    batch_std_ = at::full({1}, kStd0, o);
    return;
  }
  // Values set on another device than the norms' (loaded on the host, run on a GPU): moved
  // once, at the first forward after the load.
  batch_mean_ = batch_mean_.to(device);
  batch_std_ = batch_std_.to(device);
}

void AdaFaceHead::load_state(const std::string& key, const at::Tensor& value, const std::string& source) {
  place(value.device());
  MarginHead::load_state(key, value, source);
  initial_ = false;
}

HeadRows AdaFaceHead::begin_forward(const HeadInputs& in) {
  const at::Tensor safe = in.norms.to(torch::kFloat).clamp(0.001, 100);
  place(safe.device());
  initial_ = false;
  // The statistics of this batch join the running ones before they standardise it.
  batch_mean_.copy_(safe.mean().reshape({1}) * t_alpha_ + batch_mean_ * (1 - t_alpha_));
  batch_std_.copy_(safe.std().reshape({1}) * t_alpha_ + batch_std_ * (1 - t_alpha_));
  const at::Tensor z = ((safe - batch_mean_) / (batch_std_ + kEps) * h_).clamp(-1, 1);
  HeadRows r;
  r.a = z * (-m_);     // angular margin
  r.b = z * m_ + m_;   // additive margin
  return r;
}

at::Tensor AdaFaceHead::target(const at::Tensor& c, const HeadRows& r) const {
  const at::Tensor theta = c.clamp(-1 + kEps, 1 - kEps).acos();
  return (theta + r.a).clamp(kEps, M_PI - kEps).cos() - r.b;
}

at::Tensor AdaFaceHead::target_grad(const at::Tensor& c, const HeadRows& r) const {
  const at::Tensor cc = c.clamp(-1 + kEps, 1 - kEps), theta = cc.acos(), tm = theta + r.a;
  // d cos(theta_m)/dc = sin(theta_m) / sin(theta); zero where a clamp or clip holds.
  const at::Tensor live = (c >= -1 + kEps) & (c <= 1 - kEps) & (tm >= kEps) & (tm <= M_PI - kEps);
  return torch::where(live, tm.sin() / (1 - cc * cc).sqrt(), torch::zeros_like(c));
}

void AdaFaceHead::negatives_forward(at::Tensor logits, at::Tensor codes, const HeadRows&) const {
  const double hi = s_ * (1 - kEps);
  codes.copy_((logits > hi) | (logits < -hi));
  logits.clamp_(-hi, hi);
}

void AdaFaceHead::negatives_backward(at::Tensor grad, const at::Tensor&, const at::Tensor& codes,
                                     const HeadRows&) const {
  grad.masked_fill_(codes != 0, 0.0);
}

std::vector<std::pair<std::string, at::Tensor>> AdaFaceHead::state() const {
  return {{"batch_mean", batch_mean_}, {"batch_std", batch_std_}};
}

}  // namespace

FACESHARD_MARGIN_HEADS(adaface) {
  register_margin_head(
      {"adaface",
       "AdaFace (Kim et al., CVPR 2022): angular margin -m z and additive margin m + m z on the target, z from the row's "
       "feature norm standardised by running statistics of the norms",
       {{"m", 0.4, 0, kUnbounded, false, false, "the margin"},
        {"h", 0.333, 0, kUnbounded, false, false, "how far the norm's z-score scales the margin (z = clip(h (a - mean) / (std + eps), -1, 1))"},
        {"s", 64.0, 0, kUnbounded, true, false, "the logits' scale"},
        {"t_alpha", 0.01, 0, 1, false, false, "the EMA rate of the norm's running mean and std"}}},
      [](const std::map<std::string, double>& p, const CombinedMargin&) { return std::make_unique<AdaFaceHead>(p); });
}

}  // namespace faceshard
