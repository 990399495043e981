#include "partial_fc/classifier/heads/elasticface.h"

#include <cmath>
#include <memory>

#include "partial_fc/classifier/sr_hash.h"
#include "partial_fc/classifier/tensor_hash.h"
#include "base/error.h"

namespace faceshard {
namespace {

using tensor_hash::mix32;

// Keeps ElasticFace's stream apart from the stochastic rounding's, which hashes the same seed.
constexpr uint32_t kDomain = 0x45fa3e11U;

}  // namespace

at::Tensor elasticface_draws(int64_t n, double m, double sigma, uint64_t seed, int64_t forward,
                             const at::Device& device) {
  TORCH_CHECK(n >= 0 && n < (int64_t(1) << 31), "elasticface_draws: ", n, " rows");
  at::NoGradGuard ng;
  // The key of this forward, on the host (plain integers): the same on every device.
  const auto f = static_cast<uint64_t>(forward);
  uint32_t key = sr_detail::mix32(static_cast<uint32_t>(seed) ^ kDomain);
  key = sr_detail::mix32(key ^ static_cast<uint32_t>(seed >> 32));
  key = sr_detail::mix32(key ^ static_cast<uint32_t>(f));
  key = sr_detail::mix32(key ^ static_cast<uint32_t>(f >> 32));
  // Row i's two uniforms from the counters 2i and 2i + 1, each -> mix32(mix32(c) ^ key): a
  // bijection of the counters for a given key (the 2n uniforms of a forward are distinct),
  // and row i's margin does not depend on how many rows are drawn. Made on `device` from an
  // arange: nothing is copied from the host.
  const at::Tensor counters = at::arange(2 * n, at::TensorOptions().device(device).dtype(at::kLong));
  const at::Tensor bits = mix32(at::bitwise_xor(mix32(counters), static_cast<int64_t>(key)));
  const at::Tensor u = bits.to(at::kDouble).add_(0.5).mul_(std::ldexp(1.0, -32)).view({n, 2});  // in (0, 1)
  const at::Tensor z = u.select(1, 0).log().mul_(-2.0).sqrt_().mul_(u.select(1, 1).mul(2 * M_PI).cos_());
  return z.mul_(sigma).add_(m).to(at::kFloat);
}

ElasticFaceHead::ElasticFaceHead(const std::map<std::string, double>& p, bool arc)
    : m_(p.at("m")), sigma_(p.at("sigma")), s_(p.at("s")), plus_(p.at("plus") != 0), arc_(arc) {}

HeadRows ElasticFaceHead::begin_forward(const HeadInputs& in) {
  at::Tensor margin = elasticface_draws(in.rows, m_, sigma_, in.seed, in.forward, in.options.device());
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
