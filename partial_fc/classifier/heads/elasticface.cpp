#include "partial_fc/classifier/heads/elasticface.h"

#include <memory>

#include "partial_fc/runtime/error.h"

namespace faceshard {

at::Tensor elasticface_draws(int64_t n, double m, double sigma, uint64_t seed, int64_t forward) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 6364136223846793005ULL + 1442695040888963407ULL +
                                                     static_cast<uint64_t>(forward));
  return at::normal(0.0, 1.0, {n}, gen) * sigma + m;
}

ElasticFaceHead::ElasticFaceHead(const std::map<std::string, double>& p, bool arc)
    : m_(p.at("m")), sigma_(p.at("sigma")), s_(p.at("s")), plus_(p.at("plus") != 0), arc_(arc) {}

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

FACESHARD_MARGIN_HEADS(elasticface) {
  for (const bool arc : {true, false})
    register_margin_head(
        {arc ? "elasticface_arc" : "elasticface_cos",
         std::string("ElasticFace (Boutros et al., CVPRW 2022): ") +
             (arc ? "cos(theta + m_i)" : "cos(theta) - m_i") + " with each row's margin m_i drawn from N(m, sigma) every step",
         {{"m", arc ? 0.5 : 0.35, 0, kUnbounded, false, false, "the margins' mean"},
          {"sigma", arc ? 0.0125 : 0.05, 0, kUnbounded, false, false, "the margins' standard deviation"},
          {"s", 64.0, 0, kUnbounded, true, false, "the logits' scale"},
          {"plus", 0.0, 0, 1, false, true, "ElasticFace+: the sorted draws handed out by the target cosines' order"}}},
        [arc](const std::map<std::string, double>& p, const CombinedMargin&) {
          return std::make_unique<ElasticFaceHead>(p, arc);
        });
}

}  // namespace faceshard
