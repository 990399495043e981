#include "partial_fc/classifier/elasticface_head.h"

#include "partial_fc/runtime/error.h"

namespace faceshard {

at::Tensor elasticface_draws(int64_t n, double m, double sigma, uint64_t seed, int64_t forward) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 6364136223846793005ULL + 1442695040888963407ULL +
                                                     static_cast<uint64_t>(forward));
  return at::normal(0.0, 1.0, {n}, gen) * sigma + m;
}

ElasticFaceHead::ElasticFaceHead(const std::map<std::string, double>& p, bool arc)
    : m_(p.at("m")), sigma_(p.at("sigma")), s_(p.at("s")), plus_(p.at("plus") != 0), arc_(arc) {
  if (!(sigma_ >= 0)) throw option_error("sigma", "must be >= 0, got ", sigma_);
}

HeadRows ElasticFaceHead::begin_forward(const HeadInputs& in) {
  at::Tensor margin = elasticface_draws(in.rows, m_, sigma_, in.seed, in.forward).to(in.options.device());
  if (plus_) {
    const at::Tensor order = std::get<1>(in.target_cos.sort(std::optional<bool>(true), 0, /*descending=*/true));
    margin = std::get<0>(margin.sort(std::optional<bool>(true), 0, false)).index_select(0, order);
  }
  HeadRows r;
  r.a = margin;
  return r;
}

at::Tensor ElasticFaceHead::target(const at::Tensor& c, const HeadRows& r) const {
  const at::Tensor cc = c.clamp(-1, 1);
  return arc_ ? (cc.acos() + r.a).cos() : cc - r.a;
}

at::Tensor ElasticFaceHead::target_grad(const at::Tensor& c, const HeadRows& r) const {
  if (!arc_) return torch::ones_like(c);
  const at::Tensor cc = c.clamp(-1, 1);
  return (cc.acos() + r.a).sin() / (1 - cc * cc).sqrt();
}

}  // namespace faceshard
