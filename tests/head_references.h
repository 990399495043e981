// Every margin head written from its definition (the authors' code) with plain ops in
// float64 on the CPU, over one process holding the whole batch and the columns it uses;
// autograd gives the reference gradients. Nothing here calls the heads under test. Shared by
// the heads' distributed equivalence (test_margin_heads.cpp) and the GPU's sampled classifier
// (test_cuda.cpp). Every head of the catalogue must have one
// (MarginHeads.EveryRegisteredHeadHasAFloat64Reference): a reference is a function and the
// line that registers it, below. Its parameters are the head's published defaults, written
// here from the authors' code (published_head_defaults), with the test's own settings over
// them: never the catalogue's defaults, so that a default that drifts there fails the tests.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "partial_fc/classifier/margin.h"

namespace faceshard::testing {

struct RefInput {
  at::Tensor cos;     // [N, n] cosines of the normalised embeddings and the columns used
  at::Tensor norms;   // [N, 1] the raw embeddings' norms (differentiable)
  at::Tensor onehot;  // [N, n] the target column of each row
  at::Tensor y;       // [N, 1] the target column's index
  std::map<std::string, double> p;  // the head's parameters (defaults and the test's settings)
  uint64_t seed = 0;
  int64_t forward = 0;
};
struct RefOutput {
  at::Tensor logits, extra;  // logits [N, n] (scaled); an extra loss term or undefined
};
struct RefState {  // what a head carries from one forward to the next
  double batch_mean = 20, batch_std = 100;  // AdaFace's initial norm statistics
  double t = 0;                             // CurricularFace's
  double iteration = 0;                     // SphereFace's forward count
};
using RefFn = std::function<RefOutput(const RefInput&, RefState&)>;

inline std::map<std::string, RefFn>& head_references() {
  static std::map<std::string, RefFn> r;
  return r;
}
struct Reference {
  Reference(const std::string& head, RefFn fn) { head_references()[head] = std::move(fn); }
};

// Each head's defaults as its authors publish them, written here and not read from the head
// catalogue under test:
//   combined        arcface_torch's configs: margin_list (1.0, 0.5, 0.0), s 64
//   arcface         insightface / arcface_torch ArcFace: m 0.5, s 64
//   cosface         arcface_torch CosFace: m 0.4, s 64
//   adaface         mk-minchul/AdaFace head.py and its training config: m 0.4, h 0.333, s 64, t_alpha 0.01
//   curricularface  HuangYG123/CurricularFace head/metrics.py: m 0.5, s 64
//   magface         IrvingMeng/MagFace MagLinear/MagLoss: l_a 10, u_a 110, l_m 0.45, u_m 0.8, lambda_g 35,
//                   s 64, easy margin on
//   elasticface_arc fdbtrs/ElasticFace utils/losses.py ElasticArcFace: m 0.5, std 0.0125, s 64 (plus off)
//   elasticface_cos fdbtrs/ElasticFace config/config_ElasticCosFace.py: m 0.35, std 0.05, s 64 (plus off)
//   sphereface      wy1iu/sphereface (A-Softmax): m 4; on normalised features with the scale s 64 that
//                   every head here shares (the authors scale by the feature's norm instead); the
//                   annealing of train/code/sphereface_model.prototxt's MarginInnerProduct layer:
//                   base 1000, gamma 0.12, power 1, lambda_min 5
inline const std::map<std::string, std::map<std::string, double>>& published_head_defaults() {
  static const std::map<std::string, std::map<std::string, double>> d = {
      {"combined", {{"m1", 1.0}, {"m2", 0.5}, {"m3", 0.0}, {"s", 64.0}}},
      {"arcface", {{"m", 0.5}, {"s", 64.0}}},
      {"cosface", {{"m", 0.4}, {"s", 64.0}}},
      {"adaface", {{"m", 0.4}, {"h", 0.333}, {"s", 64.0}, {"t_alpha", 0.01}}},
      {"curricularface", {{"m", 0.5}, {"s", 64.0}}},
      {"magface",
       {{"l_a", 10.0}, {"u_a", 110.0}, {"l_m", 0.45}, {"u_m", 0.8}, {"lambda_g", 35.0}, {"s", 64.0}, {"easy_margin", 1.0}}},
      {"elasticface_arc", {{"m", 0.5}, {"sigma", 0.0125}, {"s", 64.0}, {"plus", 0.0}}},
      {"elasticface_cos", {{"m", 0.35}, {"sigma", 0.05}, {"s", 64.0}, {"plus", 0.0}}},
      {"sphereface", {{"m", 4.0}, {"s", 64.0}, {"base", 1000.0}, {"gamma", 0.12}, {"power", 1.0}, {"lambda_min", 5.0}}},
  };
  return d;
}
// The reference's parameters: the published defaults with the test's settings over them (a
// head without published defaults here gets the settings alone: its reference then fails,
// naming the parameter it misses).
inline std::map<std::string, double> reference_params(const std::string& head, const std::map<std::string, double>& set) {
  const auto it = published_head_defaults().find(head);
  std::map<std::string, double> p = it == published_head_defaults().end() ? std::map<std::string, double>{} : it->second;
  for (const auto& [k, v] : set) p[k] = v;
  return p;
}

// The combined margin in exact mode (margin.h): s (cos(m1 theta + m2) - m3), continued with
// slope 1 in c beyond theta_max = (pi - m2) / m1.
inline RefOutput combined_margin(const RefInput& in, double m1, double m2, double m3, double s) {
  const double eps = 1e-7, tmax = (M_PI - m2) / m1;
  const at::Tensor c = in.cos.clamp(-1 + eps, 1 - eps), theta = c.acos();
  at::Tensor t = (theta * m1 + m2).cos() - m3;
  if (tmax < M_PI) t = torch::where(theta <= tmax, t, c - std::cos(tmax) - 1 - m3);
  return {torch::where(in.onehot > 0, t, in.cos) * s, {}};
}

inline const Reference kCombined("combined", [](const RefInput& in, RefState&) -> RefOutput {
  return combined_margin(in, in.p.at("m1"), in.p.at("m2"), in.p.at("m3"), in.p.at("s"));
});
inline const Reference kArcFace("arcface", [](const RefInput& in, RefState&) -> RefOutput {
  return combined_margin(in, 1, in.p.at("m"), 0, in.p.at("s"));
});
inline const Reference kCosFace("cosface", [](const RefInput& in, RefState&) -> RefOutput {
  return combined_margin(in, 1, 0, in.p.at("m"), in.p.at("s"));
});

inline const Reference kAdaFace("adaface", [](const RefInput& in, RefState& st) -> RefOutput {
  const double m = in.p.at("m"), h = in.p.at("h"), ta = in.p.at("t_alpha"), eps = 1e-3;
  const at::Tensor cos = in.cos.clamp(-1 + eps, 1 - eps);
  const at::Tensor safe = in.norms.clamp(0.001, 100).detach();
  st.batch_mean = safe.mean().item<double>() * ta + (1 - ta) * st.batch_mean;
  st.batch_std = safe.std().item<double>() * ta + (1 - ta) * st.batch_std;
  const at::Tensor z = ((safe - st.batch_mean) / (st.batch_std + eps) * h).clamp(-1, 1);
  const at::Tensor theta_m = (cos.acos() + in.onehot * (z * -m)).clamp(eps, M_PI - eps);
  return {(theta_m.cos() - in.onehot * (z * m + m)) * in.p.at("s"), {}};
});

inline const Reference kCurricularFace("curricularface", [](const RefInput& in, RefState& st) -> RefOutput {
  const double m = in.p.at("m");
  const at::Tensor cos = in.cos.clamp(-1, 1);
  const at::Tensor tl = cos.gather(1, in.y);
  const at::Tensor ctm = tl * std::cos(m) - (1 - tl * tl).sqrt() * std::sin(m);
  const at::Tensor final_t = torch::where(tl > std::cos(M_PI - m), ctm, tl - std::sin(M_PI - m) * m);
  st.t = tl.mean().item<double>() * 0.01 + 0.99 * st.t;
  const at::Tensor mod = torch::where(cos > ctm, cos * (cos + st.t), cos);
  return {mod.scatter(1, in.y, final_t) * in.p.at("s"), {}};
});

inline const Reference kMagFace("magface", [](const RefInput& in, RefState&) -> RefOutput {
  const double la = in.p.at("l_a"), ua = in.p.at("u_a"), lm = in.p.at("l_m"), um = in.p.at("u_m");
  const at::Tensor a = in.norms.clamp(la, ua);
  const at::Tensor mg = (um - lm) / (ua - la) * (a - la) + lm;
  const at::Tensor cos = in.cos.clamp(-1, 1);
  const at::Tensor ctm = cos * mg.cos() - (1 - cos * cos).sqrt() * mg.sin();
  const at::Tensor target = in.p.at("easy_margin") != 0 ? torch::where(cos > 0, ctm, cos) : ctm;
  return {(in.onehot * target + (1 - in.onehot) * cos) * in.p.at("s"),
          (a / (ua * ua) + 1 / a).mean() * in.p.at("lambda_g")};
});

// ElasticFace's draws written here from their definition (elasticface.h): m + sigma z with z
// = sqrt(-2 ln u1) cos(2 pi u2), u = (b + 0.5) / 2^32 and b = mix32(mix32(counter) ^ key) for
// the counters 2i and 2i + 1 of row i, the key the hash chain of (seed, forward); scalar
// float64 on the host, rounded to the fp32 the head keeps. Nothing of faceshard's is called: the constants are the definition's.
inline uint32_t ref_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}
inline at::Tensor reference_elastic_draws(int64_t n, double m, double sigma, uint64_t seed, int64_t forward) {
  const auto f = static_cast<uint64_t>(forward);
  uint32_t key = ref_mix32(static_cast<uint32_t>(seed) ^ 0x45fa3e11U);
  key = ref_mix32(key ^ static_cast<uint32_t>(seed >> 32));
  key = ref_mix32(key ^ static_cast<uint32_t>(f));
  key = ref_mix32(key ^ static_cast<uint32_t>(f >> 32));
  at::Tensor out = torch::empty({n}, torch::kDouble);
  double* v = out.data_ptr<double>();
  auto uniform = [&](int64_t i) {
    return (static_cast<double>(ref_mix32(ref_mix32(static_cast<uint32_t>(i)) ^ key)) + 0.5) / 4294967296.0;
  };
  for (int64_t i = 0; i < n; ++i) {
    const double z = std::sqrt(-2.0 * std::log(uniform(2 * i))) * std::cos(2.0 * M_PI * uniform(2 * i + 1));
    v[i] = static_cast<double>(static_cast<float>(m + sigma * z));
  }
  return out;
}

// ElasticFace's margins are this forward's draws, handed out as the authors' plus variant
// does when it is on.
inline at::Tensor elastic_margins(const RefInput& in, double m, double sigma) {
  at::Tensor mg = reference_elastic_draws(in.cos.size(0), m, sigma, in.seed, in.forward);
  if (in.p.at("plus") != 0) {
    const at::Tensor order = std::get<1>(in.cos.gather(1, in.y).squeeze(1).detach().sort(0, true));
    mg = std::get<0>(mg.sort()).index_select(0, order);
  }
  return mg.unsqueeze(1);
}
inline const Reference kElasticArc("elasticface_arc", [](const RefInput& in, RefState&) -> RefOutput {
  const at::Tensor cos = in.cos.clamp(-1, 1), mg = elastic_margins(in, in.p.at("m"), in.p.at("sigma"));
  return {(cos.acos() + in.onehot * mg).cos() * in.p.at("s"), {}};
});
inline const Reference kElasticCos("elasticface_cos", [](const RefInput& in, RefState&) -> RefOutput {
  const at::Tensor mg = elastic_margins(in, in.p.at("m"), in.p.at("sigma"));
  return {(in.cos - in.onehot * mg) * in.p.at("s"), {}};
});

// The authors' Caffe layer (wy1iu/sphereface margin_inner_product_layer.cpp, Forward_cpu):
// iteration += 1 first, lambda = max(lambda_min, base (1 + gamma iteration)^-power), and the
// target (lambda cos + psi) / (1 + lambda); base 0 or lambda_min 0 leaves psi alone.
inline const Reference kSphereFace("sphereface", [](const RefInput& in, RefState& st) -> RefOutput {
  const double m = in.p.at("m"), base = in.p.at("base"), lambda_min = in.p.at("lambda_min");
  st.iteration += 1;
  const double lambda =
      base > 0 && lambda_min > 0
          ? std::max(lambda_min, base * std::pow(1 + in.p.at("gamma") * st.iteration, -in.p.at("power")))
          : 0.0;
  const at::Tensor theta = in.cos.clamp(-1, 1).acos();
  const at::Tensor k = (theta.detach() * m / M_PI).floor().clamp_max(std::ceil(m) - 1);
  const at::Tensor psi = (1 - 2 * k.remainder(2)) * (theta * m).cos() - 2 * k;
  const at::Tensor f = (in.cos * lambda + psi) / (1 + lambda);
  return {torch::where(in.onehot > 0, f, in.cos) * in.p.at("s"), {}};
});

struct HeadReference {
  std::string head;
  std::map<std::string, double> params;  // reference_params(head, the test's settings)
  RefState state;
  uint64_t seed = 0;
  int64_t forward = 0;

  at::Tensor loss(const at::Tensor& raw, const at::Tensor& weight, const at::Tensor& labels, const at::Tensor& cols) {
    namespace F = torch::nn::functional;
    const at::Tensor Wsel = cols.defined() ? weight.index_select(0, cols) : weight;
    const at::Tensor y = cols.defined() ? torch::searchsorted(cols, labels) : labels;
    RefInput in;
    in.norms = raw.norm(2, {1}, true);
    in.cos = torch::mm(raw / in.norms, F::normalize(Wsel, F::NormalizeFuncOptions().dim(1)).t());
    in.onehot = F::one_hot(y, in.cos.size(1)).to(torch::kDouble);
    in.y = y.unsqueeze(1);
    in.p = params;
    in.seed = seed;
    in.forward = forward++;
    const auto it = head_references().find(head);
    if (it == head_references().end()) {
      ADD_FAILURE() << "no float64 reference for the " << head << " head";
      return torch::zeros({}, torch::kDouble);
    }
    const RefOutput out = it->second(in, state);
    const at::Tensor l = F::cross_entropy(out.logits, y);
    return out.extra.defined() ? l + out.extra : l;
  }
  // The state entry `name` of the head, as the reference holds it.
  double state_value(const std::string& name) const {
    return name == "t"            ? state.t
           : name == "iteration"  ? state.iteration
           : name == "batch_mean" ? state.batch_mean
                                  : state.batch_std;
  }
};

}  // namespace faceshard::testing
