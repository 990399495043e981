#include "partial_fc/classifier/margin_head.h"

#include <cmath>

#include "partial_fc/classifier/adaface_head.h"
#include "partial_fc/classifier/curricularface_head.h"
#include "partial_fc/classifier/elasticface_head.h"
#include "partial_fc/classifier/magface_head.h"
#include "partial_fc/runtime/error.h"

namespace faceshard {

double MarginHead::row_loss_cap() const { return INFINITY; }

at::Tensor MarginHead::target_grad_norm(const at::Tensor& c, const HeadRows&) const { return torch::zeros_like(c); }

void MarginHead::negatives_forward(at::Tensor, at::Tensor, const HeadRows&) const {}
void MarginHead::negatives_backward(at::Tensor, const at::Tensor&, const at::Tensor&, const HeadRows&) const {}

void MarginHead::load_state(const std::string& key, const at::Tensor& value, const std::string& source) {
  for (auto& kv : state()) {
    if (kv.first != key) continue;
    if (value.numel() != kv.second.numel() || !value.is_floating_point())
      throw usage_error(source, ": key 'head/", key, "' of the ", name(), " head has ", value.numel(),
                        " values, expected ", kv.second.numel(), " floating-point values");
    torch::NoGradGuard ng;
    kv.second.copy_(value.reshape(kv.second.sizes()));
    return;
  }
  throw usage_error(source, ": key 'head/", key, "' is not state of the ", name(), " head");
}

namespace {
using Params = std::map<std::string, double>;

const std::vector<std::pair<std::string, Params>>& defaults() {
  static const std::vector<std::pair<std::string, Params>> d = {
      {"combined", {}},
      {"arcface", {{"m", 0.5}, {"s", 64.0}}},
      {"cosface", {{"m", 0.4}, {"s", 64.0}}},
      {"adaface", {{"m", 0.4}, {"h", 0.333}, {"s", 64.0}, {"t_alpha", 0.01}}},
      {"curricularface", {{"m", 0.5}, {"s", 64.0}}},
      {"magface",
       {{"l_a", 10.0}, {"u_a", 110.0}, {"l_m", 0.45}, {"u_m", 0.8}, {"lambda_g", 35.0}, {"s", 64.0}, {"easy_margin", 1.0}}},
      {"elasticface_arc", {{"m", 0.5}, {"sigma", 0.0125}, {"s", 64.0}, {"plus", 0.0}}},
      {"elasticface_cos", {{"m", 0.35}, {"sigma", 0.05}, {"s", 64.0}, {"plus", 0.0}}},
  };
  return d;
}

// The spec's parameters over the head's defaults; an unknown name is an error.
Params resolve(const HeadSpec& spec, const Params& base) {
  Params p = base;
  for (const auto& kv : spec.params) {
    if (!p.count(kv.first)) throw option_error(kv.first, "is not a parameter of the ", spec.name, " head");
    if (!std::isfinite(kv.second)) throw option_error(kv.first, "must be finite, got ", kv.second);
    p[kv.first] = kv.second;
  }
  if (p.count("s") && !(p.at("s") > 0)) throw option_error("s", "must be positive, got ", p.at("s"));
  return p;
}
}  // namespace

const std::vector<std::pair<std::string, std::map<std::string, double>>>& margin_head_defaults() { return defaults(); }

std::unique_ptr<MarginHead> make_margin_head(const HeadSpec& spec, const CombinedMargin& margin) {
  for (const auto& [name, base] : defaults()) {
    if (name != spec.name) continue;
    const Params p = resolve(spec, base);
    if (name == "combined") return std::make_unique<CombinedHead>(margin);
    if (name == "arcface" || name == "cosface") {
      CombinedMargin m = margin;
      m.m1 = 1.0;
      m.m2 = name == "arcface" ? p.at("m") : 0.0;
      m.m3 = name == "cosface" ? p.at("m") : 0.0;
      m.scale = p.at("s");
      return std::make_unique<CombinedHead>(m, name);
    }
    if (name == "adaface") return std::make_unique<AdaFaceHead>(p);
    if (name == "curricularface") return std::make_unique<CurricularFaceHead>(p);
    if (name == "magface") return std::make_unique<MagFaceHead>(p);
    return std::make_unique<ElasticFaceHead>(p, name == "elasticface_arc");
  }
  std::string known;
  for (const auto& kv : defaults()) known += (known.empty() ? "" : " | ") + kv.first;
  throw option_error("head", "'", spec.name, "' is not a head (", known, ")");
}

}  // namespace faceshard
