// CurricularFace (Huang et al., CVPR 2020; HuangYG123/CurricularFace head/metrics.py): an
// ArcFace target cos(theta + m) (c - sin(pi - m) * m past theta + m > pi), and every
// non-target cosine above its row's cos(theta_y + m) becomes c * (t + c), t an EMA (0.01)
// of the mean target cosine of the global batch, updated before it is used (no gradient
// through t). The target cosines live on their owners' shards: one [N] all-reduce shares them.
#include <cmath>
#include <map>
#include <memory>
#include <string>

#include "partial_fc/classifier/margin_head.h"

namespace faceshard {
namespace {

class CurricularFaceHead : public MarginHead {
 public:
  explicit CurricularFaceHead(const std::map<std::string, double>& p);
  std::string name() const override { return "curricularface"; }
  double scale() const override { return s_; }
  bool needs_target_cosines() const override { return true; }
  HeadRows begin_forward(const HeadInputs& in) override;
  at::Tensor target(const at::Tensor& c, const HeadRows& rows) const override;
  at::Tensor target_grad(const at::Tensor& c, const HeadRows& rows) const override;
  bool modifies_negatives() const override { return true; }
  void negatives_forward(at::Tensor logits, at::Tensor codes, const HeadRows& rows) const override;
  void negatives_backward(at::Tensor grad, const at::Tensor& logits, const at::Tensor& codes,
                          const HeadRows& rows) const override;
  std::vector<std::pair<std::string, at::Tensor>> state() const override { return {{"t", t_}}; }
  void load_state(const std::string& key, const at::Tensor& value, const std::string& source) override;

 private:
  // t lives on the device of the target cosines. Until a forward or a load sets it, it holds
  // its initial 0, which is then made on that device (a fill, not a copy from the host); a
  // loaded t stays on the device it was loaded on (the trainer's: the job's device).
  void place(const at::Device& device);
  double m_, s_, cos_m_, sin_m_, threshold_, mm_;
  bool initial_ = true;
  at::Tensor t_;  // [1] fp32
};

CurricularFaceHead::CurricularFaceHead(const std::map<std::string, double>& p)
    : m_(p.at("m")),
      s_(p.at("s")),
      cos_m_(std::cos(m_)),
      sin_m_(std::sin(m_)),
      threshold_(std::cos(M_PI - m_)),
      mm_(std::sin(M_PI - m_) * m_) {
  place(at::kCPU);
}

void CurricularFaceHead::place(const at::Device& device) {
  if (t_.defined() && t_.device() == device) return;
  if (!t_.defined() || initial_) {
    t_ = at::zeros({1}, at::TensorOptions().device(device).dtype(at::kFloat));
    return;
  }
  t_ = t_.to(device);  // set on another device than the cosines' (loaded on the host): moved once
}

void CurricularFaceHead::load_state(const std::string& key, const at::Tensor& value, const std::string& source) {
  place(value.device());
  MarginHead::load_state(key, value, source);
  initial_ = false;
}

HeadRows CurricularFaceHead::begin_forward(const HeadInputs& in) {
  const at::Tensor c = in.target_cos.to(torch::kFloat).clamp(-1, 1);
  place(c.device());
  initial_ = false;
  HeadRows r;
  // The hard-negative threshold of each row uses cos(theta_y + m) before the target's
  // own fallback; t moves before it is used, as in the authors' forward.
  r.a = c * cos_m_ - (1 - c * c).sqrt() * sin_m_;
  t_.copy_(c.mean().reshape({1}) * 0.01 + t_ * 0.99);
  r.b = t_.clone();
  return r;
}

at::Tensor CurricularFaceHead::target(const at::Tensor& c, const HeadRows&) const {
  const at::Tensor cc = c.clamp(-1, 1);
  return torch::where(cc > threshold_, cc * cos_m_ - (1 - cc * cc).sqrt() * sin_m_, cc - mm_);
}

at::Tensor CurricularFaceHead::target_grad(const at::Tensor& c, const HeadRows&) const {
  const at::Tensor cc = c.clamp(-1, 1);
  return torch::where(cc > threshold_, cos_m_ + cc * sin_m_ / (1 - cc * cc).sqrt(), torch::ones_like(cc));
}

// Codes: 0 = unchanged, 1 = hard with c >= -t/2, 2 = hard with c < -t/2. The gradient of
// c * (t + c) is t + 2c = +-sqrt(t^2 + 4v) for the new value v: the sign is all backward needs.
void CurricularFaceHead::negatives_forward(at::Tensor logits, at::Tensor codes, const HeadRows& r) const {
  const at::Tensor c = (logits / s_).clamp(-1, 1);
  const at::Tensor hard = c > r.a.unsqueeze(1);
  codes.copy_(hard.to(torch::kUInt8) + (hard & (c < r.b * -0.5)).to(torch::kUInt8));
  logits.copy_(torch::where(hard, c * (r.b + c) * s_, logits));
}

void CurricularFaceHead::negatives_backward(at::Tensor grad, const at::Tensor& logits, const at::Tensor& codes,
                                            const HeadRows& r) const {
  const at::Tensor root = (r.b * r.b + logits * (4.0 / s_)).clamp_min(0).sqrt();
  grad.mul_(torch::where(codes == 0, torch::ones_like(root), torch::where(codes == 1, root, -root)));
}

}  // namespace

FACESHARD_MARGIN_HEADS(curricularface) {
  register_margin_head(
      {"curricularface",
       "CurricularFace (Huang et al., CVPR 2020): the ArcFace target; every non-target cosine above the row's cos(theta_y + m) "
       "becomes c (t + c), t an EMA of the mean target cosine",
       {{"m", 0.5, 0, kUnbounded, false, false, "the angular margin"}, {"s", 64.0, 0, kUnbounded, true, false, "the logits' scale"}}},
      [](const std::map<std::string, double>& p, const CombinedMargin&) { return std::make_unique<CurricularFaceHead>(p); });
}

}  // namespace faceshard
