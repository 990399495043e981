// SphereFace (Liu et al., CVPR 2017): the multiplicative angular margin of A-Softmax on
// normalised features, psi(theta) = (-1)^k cos(m theta) - 2k for theta in [k pi / m,
// (k + 1) pi / m], which keeps the target logit falling monotonically in theta for any m >= 1;
// logits s * f(theta_y) for the target and s * cos(theta) for the others. As the authors
// train it, the target is annealed from cos towards psi:
//   f = (lambda cos(theta) + psi(theta)) / (1 + lambda),
//   lambda = max(lambda_min, base (1 + gamma iteration)^(-power)),
// iteration counting the forwards, advanced before it is used (the first forward uses 1).
// Source: the authors' Caffe layer, wy1iu/sphereface tools/caffe-sphereface/src/caffe/layers/
// margin_inner_product_layer.cpp (Forward_cpu: iter_ += 1, then lambda_ as above), and their
// train/code/sphereface_model.prototxt (base 1000, gamma 0.12, power 1, lambda_min 5,
// iteration 0), the defaults here. The large lambda of the first forwards keeps the target near
// cos while the features are still random; psi's weight grows to 1 / (1 + lambda_min).
// base 0 or lambda_min 0 turns the blend off: the target is psi alone.
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "partial_fc/classifier/margin_head.h"

namespace faceshard {
namespace {

class SphereFaceHead : public MarginHead {
 public:
  explicit SphereFaceHead(const std::map<std::string, double>& p)
      : m_(p.at("m")),
        s_(p.at("s")),
        base_(p.at("base")),
        gamma_(p.at("gamma")),
        power_(p.at("power")),
        lambda_min_(p.at("lambda_min")),
        anneal_(base_ > 0 && lambda_min_ > 0) {
    place(at::kCPU);
  }
  std::string name() const override { return "sphereface"; }
  double scale() const override { return s_; }
  HeadRows begin_forward(const HeadInputs& in) override;
  at::Tensor target(const at::Tensor& c, const HeadRows& rows) const override;
  at::Tensor target_grad(const at::Tensor& c, const HeadRows& rows) const override;
  // The forwards counted so far: a resumed run continues the schedule where it stopped.
  std::vector<std::pair<std::string, at::Tensor>> state() const override { return {{"iteration", iteration_}}; }
  void load_state(const std::string& key, const at::Tensor& value, const std::string& source) override;

 private:
  // k = floor(m theta / pi), at most ceil(m) - 1 (theta = pi).
  at::Tensor interval(const at::Tensor& theta) const {
    return (theta * (m_ / M_PI)).floor().clamp_max(std::ceil(m_) - 1);
  }
  static at::Tensor sign(const at::Tensor& k) { return 1 - 2 * k.remainder(2); }  // (-1)^k
  // The count lives on the device of the logits (no copy from the host, no host read: lambda
  // is computed there). Until a forward or a load sets it, it is a fill of 0 on that device;
  // a loaded count stays on the device it was loaded on.
  void place(const at::Device& device);
  double m_, s_, base_, gamma_, power_, lambda_min_;
  bool anneal_;
  bool initial_ = true;
  at::Tensor iteration_;  // [1] float64: exact for any count a run reaches
};

void SphereFaceHead::place(const at::Device& device) {
  if (iteration_.defined() && iteration_.device() == device) return;
  if (!iteration_.defined() || initial_) {
    iteration_ = at::zeros({1}, at::TensorOptions().device(device).dtype(at::kDouble));
    return;
  }
  iteration_ = iteration_.to(device);
}

void SphereFaceHead::load_state(const std::string& key, const at::Tensor& value, const std::string& source) {
  place(value.device());
  MarginHead::load_state(key, value, source);
  initial_ = false;
}

HeadRows SphereFaceHead::begin_forward(const HeadInputs& in) {
  place(in.options.device());
  initial_ = false;
  iteration_.add_(1);
  HeadRows r;
  if (anneal_)  // lambda [1] fp32, on the device
    r.a = (iteration_ * gamma_ + 1).pow(-power_).mul(base_).clamp_min(lambda_min_).to(at::kFloat);
  return r;
}

at::Tensor SphereFaceHead::target(const at::Tensor& c, const HeadRows& r) const {
  const at::Tensor cc = c.clamp(-1, 1), theta = cc.acos(), k = interval(theta);
  const at::Tensor psi = sign(k) * (theta * m_).cos() - 2 * k;
  if (!r.a.defined()) return psi;
  return (r.a * cc + psi) / (r.a + 1);
}

// d psi / dc = (-1)^k m sin(m theta) / sin(theta) (k is piecewise constant); the blend's
// d f / dc = (lambda + d psi / dc) / (1 + lambda).
at::Tensor SphereFaceHead::target_grad(const at::Tensor& c, const HeadRows& r) const {
  const at::Tensor cc = c.clamp(-1, 1), theta = cc.acos();
  const at::Tensor dpsi = sign(interval(theta)) * m_ * (theta * m_).sin() / (1 - cc * cc).sqrt();
  if (!r.a.defined()) return dpsi;
  return (dpsi + r.a) / (r.a + 1);
}

}  // namespace

FACESHARD_MARGIN_HEADS(sphereface) {
  register_margin_head(
      {"sphereface",
       "SphereFace (Liu et al., CVPR 2017): the target logit s (lambda cos(theta) + psi(theta)) / (1 + lambda), psi = "
       "(-1)^k cos(m theta) - 2k for theta in [k pi / m, (k + 1) pi / m], a multiplicative angular margin annealed in "
       "with lambda = max(lambda_min, base (1 + gamma iteration)^-power)",
       {{"m", 4.0, 1, kUnbounded, false, false, "the multiplicative angular margin"},
        {"s", 64.0, 0, kUnbounded, true, false, "the logits' scale"},
        {"base", 1000.0, 0, kUnbounded, false, false, "lambda's start (0: no annealing, the target is psi)"},
        {"gamma", 0.12, 0, kUnbounded, false, false, "how fast lambda falls with the forward count"},
        {"power", 1.0, 0, kUnbounded, false, false, "the exponent of lambda's decay"},
        {"lambda_min", 5.0, 0, kUnbounded, false, false, "lambda's floor (0: no annealing, the target is psi)"}}},
      [](const std::map<std::string, double>& p, const CombinedMargin&) { return std::make_unique<SphereFaceHead>(p); });
}

}  // namespace faceshard
