// The margin heads under everything Partial FC adds: W = 1..4 ranks with uneven shards and
// batches, sampling, gradient accumulation, resume. The reference is one process holding the
// whole batch and the whole weight matrix, written here from each head's definition (the
// authors' code) with plain ops in float64 and autograd; tests/e2e/heads_reference.py checks
// the single-process heads against the authors' code itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>

#include "partial_fc/classifier/head_catalogue.h"
#include "partial_fc/classifier/heads/elasticface.h"
#include "partial_fc/classifier/partial_fc.h"
#include "partial_fc/runtime/error.h"
#include "tests/classifier_batches.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

namespace F = torch::nn::functional;

// One process, float64: each head's logits written here from its definition (the authors'
// code) with plain ops, over the whole batch and the columns it uses; autograd gives the
// reference gradients. Every head of the catalogue must have one
// (EveryRegisteredHeadHasAFloat64Reference): a reference is a function and the line that
// registers it, below, with the head's parameters as the catalogue resolves them.
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
};
using RefFn = std::function<RefOutput(const RefInput&, RefState&)>;

std::map<std::string, RefFn>& head_references() {
  static std::map<std::string, RefFn> r;
  return r;
}
struct Reference {
  Reference(const std::string& head, RefFn fn) { head_references()[head] = std::move(fn); }
};

// The combined margin in exact mode (margin.h): s (cos(m1 theta + m2) - m3), continued with
// slope 1 in c beyond theta_max = (pi - m2) / m1.
RefOutput combined_margin(const RefInput& in, double m1, double m2, double m3, double s) {
  const double eps = 1e-7, tmax = (M_PI - m2) / m1;
  const at::Tensor c = in.cos.clamp(-1 + eps, 1 - eps), theta = c.acos();
  at::Tensor t = (theta * m1 + m2).cos() - m3;
  if (tmax < M_PI) t = torch::where(theta <= tmax, t, c - std::cos(tmax) - 1 - m3);
  return {torch::where(in.onehot > 0, t, in.cos) * s, {}};
}

const Reference kCombined("combined", [](const RefInput& in, RefState&) -> RefOutput {
  const CombinedMargin m;  // PartialFCOptions' default margin
  return combined_margin(in, m.m1, m.m2, m.m3, m.scale);
});
const Reference kArcFace("arcface", [](const RefInput& in, RefState&) -> RefOutput {
  return combined_margin(in, 1, in.p.at("m"), 0, in.p.at("s"));
});
const Reference kCosFace("cosface", [](const RefInput& in, RefState&) -> RefOutput {
  return combined_margin(in, 1, 0, in.p.at("m"), in.p.at("s"));
});

const Reference kAdaFace("adaface", [](const RefInput& in, RefState& st) -> RefOutput {
  const double m = in.p.at("m"), h = in.p.at("h"), ta = in.p.at("t_alpha"), eps = 1e-3;
  const at::Tensor cos = in.cos.clamp(-1 + eps, 1 - eps);
  const at::Tensor safe = in.norms.clamp(0.001, 100).detach();
  st.batch_mean = safe.mean().item<double>() * ta + (1 - ta) * st.batch_mean;
  st.batch_std = safe.std().item<double>() * ta + (1 - ta) * st.batch_std;
  const at::Tensor z = ((safe - st.batch_mean) / (st.batch_std + eps) * h).clamp(-1, 1);
  const at::Tensor theta_m = (cos.acos() + in.onehot * (z * -m)).clamp(eps, M_PI - eps);
  return {(theta_m.cos() - in.onehot * (z * m + m)) * in.p.at("s"), {}};
});

const Reference kCurricularFace("curricularface", [](const RefInput& in, RefState& st) -> RefOutput {
  const double m = in.p.at("m");
  const at::Tensor cos = in.cos.clamp(-1, 1);
  const at::Tensor tl = cos.gather(1, in.y);
  const at::Tensor ctm = tl * std::cos(m) - (1 - tl * tl).sqrt() * std::sin(m);
  const at::Tensor final_t = torch::where(tl > std::cos(M_PI - m), ctm, tl - std::sin(M_PI - m) * m);
  st.t = tl.mean().item<double>() * 0.01 + 0.99 * st.t;
  const at::Tensor mod = torch::where(cos > ctm, cos * (cos + st.t), cos);
  return {mod.scatter(1, in.y, final_t) * in.p.at("s"), {}};
});

const Reference kMagFace("magface", [](const RefInput& in, RefState&) -> RefOutput {
  const double la = in.p.at("l_a"), ua = in.p.at("u_a"), lm = in.p.at("l_m"), um = in.p.at("u_m");
  const at::Tensor a = in.norms.clamp(la, ua);
  const at::Tensor mg = (um - lm) / (ua - la) * (a - la) + lm;
  const at::Tensor cos = in.cos.clamp(-1, 1);
  const at::Tensor ctm = cos * mg.cos() - (1 - cos * cos).sqrt() * mg.sin();
  const at::Tensor target = in.p.at("easy_margin") != 0 ? torch::where(cos > 0, ctm, cos) : ctm;
  return {(in.onehot * target + (1 - in.onehot) * cos) * in.p.at("s"),
          (a / (ua * ua) + 1 / a).mean() * in.p.at("lambda_g")};
});

// ElasticFace's margins are this forward's draws (elasticface_draws, the one thing taken from
// faceshard: a seeded stream), handed out as the authors' plus variant does when it is on.
at::Tensor elastic_margins(const RefInput& in, double m, double sigma) {
  at::Tensor mg = elasticface_draws(in.cos.size(0), m, sigma, in.seed, in.forward).to(torch::kDouble);
  if (in.p.at("plus") != 0) {
    const at::Tensor order = std::get<1>(in.cos.gather(1, in.y).squeeze(1).detach().sort(0, true));
    mg = std::get<0>(mg.sort()).index_select(0, order);
  }
  return mg.unsqueeze(1);
}
const Reference kElasticArc("elasticface_arc", [](const RefInput& in, RefState&) -> RefOutput {
  const at::Tensor cos = in.cos.clamp(-1, 1), mg = elastic_margins(in, in.p.at("m"), in.p.at("sigma"));
  return {(cos.acos() + in.onehot * mg).cos() * in.p.at("s"), {}};
});
const Reference kElasticCos("elasticface_cos", [](const RefInput& in, RefState&) -> RefOutput {
  const at::Tensor mg = elastic_margins(in, in.p.at("m"), in.p.at("sigma"));
  return {(in.cos - in.onehot * mg) * in.p.at("s"), {}};
});

const Reference kSphereFace("sphereface", [](const RefInput& in, RefState&) -> RefOutput {
  const double m = in.p.at("m");
  const at::Tensor theta = in.cos.clamp(-1, 1).acos();
  const at::Tensor k = (theta.detach() * m / M_PI).floor().clamp_max(std::ceil(m) - 1);
  const at::Tensor psi = (1 - 2 * k.remainder(2)) * (theta * m).cos() - 2 * k;
  return {torch::where(in.onehot > 0, psi, in.cos) * in.p.at("s"), {}};
});

struct HeadReference {
  std::string head;
  std::map<std::string, double> params;  // resolved against the catalogue
  RefState state;
  uint64_t seed = 0;
  int64_t forward = 0;

  at::Tensor loss(const at::Tensor& raw, const at::Tensor& weight, const at::Tensor& labels, const at::Tensor& cols) {
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
    return name == "t" ? state.t : name == "batch_mean" ? state.batch_mean : state.batch_std;
  }
};

// The catalogue keeps its tests: every registered head has a float64 reference here, and
// head_cases() runs each in the distributed equivalence below.
TEST(MarginHeads, EveryRegisteredHeadHasAFloat64Reference) {
  ASSERT_GE(head_catalogue().size(), 9u);
  for (const HeadInfo& h : head_catalogue())
    EXPECT_EQ(head_references().count(h.name), 1u) << "the " << h.name << " head has no float64 reference in "
                                                    << __FILE__ << " (a function and its Reference line)";
  for (const auto& [name, fn] : head_references()) EXPECT_NE(find_head_info(name), nullptr) << name << " is no head";
}

int64_t rows_of(int r) { return 4 + (r % 2); }

// The global batch: every rank builds all of it from the same seeds, with feature norms from
// 2 to 140 and target cosines from negative to 0.8.
using Batch = testing::ClassBatch;
Batch make_batch(int W, int r, int64_t C, int64_t D, const at::Tensor& weight, int salt) {
  return testing::class_batch(W, r, C, D, weight, 900 + 31 * salt, rows_of, -0.6, 2.2);
}

struct HeadCase {
  std::string head;
  int world;
  const char* mode;  // full | sampled | accumulate
  bool streamed = false;  // loss.logits: streamed
};

class MarginHeadsDistributed : public ::testing::TestWithParam<HeadCase> {};

TEST_P(MarginHeadsDistributed, EqualOneProcessWithTheWholeBatchAndWeight) {
  const HeadCase hc = GetParam();
  testing::run_ranks(hc.world, [hc](Distributed& d) {
    const int64_t C = 1003, D = 16;
    const std::string mode = hc.mode;
    PartialFCOptions o;
    o.num_classes = C;
    o.embedding_size = D;
    o.head.name = hc.head;
    // ElasticFace's plus variant where the head has it: the target cosines' all-reduce too.
    const HeadInfo* info = find_head_info(hc.head);
    ASSERT_NE(info, nullptr) << hc.head;
    for (const HeadParam& p : info->params)
      if (p.name == "plus") o.head.params["plus"] = 1;
    o.sample_rate = mode == "sampled" ? 0.3 : (mode == "accumulate" ? 0.2 : 1.0);
    o.optimizer = ShardOptimizerOptions{"sgd", 0.9, 0.0};  // first step: w - lr * g
    o.streamed_logits = hc.streamed;
    if (hc.streamed) o.update_chunk_rows = 72;  // several chunks, the last one short
    const at::Tensor full = PartialFC::initial_rows(0, C, D, o.seed);
    PartialFC fc(d, o);
    HeadReference ref{hc.head, resolve_head_params(*info, o.head.params)};
    ref.seed = o.seed;
    const int64_t s0 = fc.shard().start, n0 = fc.shard().count;
    at::Tensor acc_grad = torch::zeros({C, D}, torch::kDouble);
    at::Tensor touched = torch::zeros({C}, torch::kBool);
    const int forwards = 2;
    for (int k = 0; k < forwards; ++k) {
      Batch b = make_batch(d.world_size(), d.rank(), C, D, full, k);
      at::Tensor emb = b.emb.narrow(0, b.offset, b.rows).clone().requires_grad_();
      auto out = fc.forward(emb, b.labels.narrow(0, b.offset, b.rows));
      const double w = mode == "accumulate" ? 0.5 : 1.0;
      (out.loss * w).backward();
      // The reference sees the columns every rank used (all of them without sampling).
      at::Tensor cols;
      if (fc.samples()) cols = std::get<0>(torch::sort(d.all_gather(fc.sampled_index() + s0)));
      at::Tensor E = b.emb.to(torch::kDouble).requires_grad_();
      at::Tensor Wt = full.to(torch::kDouble).requires_grad_();
      at::Tensor rl = ref.loss(E, Wt, b.labels, cols);
      (rl * w).backward();
      const std::string at = hc.head + " forward " + std::to_string(k);
      EXPECT_LE(testing::relative_error(out.loss, rl.to(torch::kFloat)), 1e-5) << at;
      EXPECT_LE(testing::relative_error(emb.grad(), (E.grad().narrow(0, b.offset, b.rows) * d.world_size()).to(torch::kFloat)),
                5e-5)
          << at;
      at::Tensor wg = Wt.grad();
      if (mode == "accumulate") {
        acc_grad += wg;
        touched.index_fill_(0, fc.sampled_index() + s0, true);
        if (k + 1 < forwards) fc.accumulate();
      } else {
        at::Tensor mine = fc.samples() ? wg.index_select(0, fc.sampled_index() + s0) : wg.narrow(0, s0, n0);
        EXPECT_LE(testing::relative_error(fc.gradient(), mine.to(torch::kFloat)), 5e-5) << at;
        fc.zero_grad();
      }
      // The head's state: the reference's, and the same on every rank.
      for (const auto& kv : fc.head().state()) {
        const double v = kv.second.item<double>();
        const double want = ref.state_value(kv.first);
        EXPECT_NEAR(v, want, 1e-5 * std::max(1.0, std::abs(want))) << at << " " << kv.first;
        at::Tensor all = d.all_gather(kv.second.reshape({1}).cpu());
        EXPECT_TRUE(torch::equal(all, all[0].expand_as(all))) << kv.first << " differs between ranks";
      }
    }
    if (mode == "accumulate") {
      const double lr = 0.1;
      fc.step(lr);
      at::Tensor w0 = full.narrow(0, s0, n0), g = acc_grad.narrow(0, s0, n0).to(torch::kFloat);
      at::Tensor mask = touched.narrow(0, s0, n0).unsqueeze(1);
      EXPECT_LE(testing::relative_error(fc.weight(), torch::where(mask, w0 - lr * g, w0)), 1e-5);
      EXPECT_GT(fc.sampled_index().size(0), fc.num_sample());
    }
  });
}

// Every head of the catalogue, on 1 and 4 ranks, with sampling on 3 and accumulation on 2;
// and with streamed logits on 2 (without sampling), 3 (sampled) and 4 (accumulated).
std::vector<HeadCase> head_cases() {
  std::vector<HeadCase> out;
  for (const HeadInfo& h : head_catalogue()) {
    for (int w : {1, 4}) out.push_back({h.name, w, "full"});
    out.push_back({h.name, 3, "sampled"});
    out.push_back({h.name, 2, "accumulate"});
    out.push_back({h.name, 2, "full", true});
    out.push_back({h.name, 3, "sampled", true});
    out.push_back({h.name, 4, "accumulate", true});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Heads, MarginHeadsDistributed, ::testing::ValuesIn(head_cases()), [](const auto& info) {
  return info.param.head + "_W" + std::to_string(info.param.world) + "_" + info.param.mode +
         (info.param.streamed ? "_streamed" : "");
});

// ElasticFace's draws: a function of the run's seed and the forward count only, so every
// rank, and a resumed run, draws the same; sigma = 0 is the fixed margin.
TEST(ElasticFaceDraws, SeededByRunAndForward) {
  const at::Tensor a = elasticface_draws(64, 0.5, 0.05, 7, 3), b = elasticface_draws(64, 0.5, 0.05, 7, 3);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_FALSE(torch::equal(a, elasticface_draws(64, 0.5, 0.05, 7, 4)));
  EXPECT_TRUE(torch::equal(elasticface_draws(5, 0.35, 0.0, 7, 0), torch::full({5}, 0.35f)));
}

// The margins are N(m, sigma^2): on 1e5 draws the mean within 5 standard errors, the spread
// within 1%, the Kolmogorov-Smirnov distance to the normal CDF below its 1% critical value
// (1.63 / sqrt(n)), and two forwards' draws uncorrelated.
TEST(ElasticFaceDraws, NormalWithTheGivenMeanAndSpread) {
  const int64_t n = 100000;
  const double m = 0.5, sigma = 0.05;
  const at::Tensor x = elasticface_draws(n, m, sigma, 11, 5).to(at::kDouble);
  EXPECT_NEAR(x.mean().item<double>(), m, 5 * sigma / std::sqrt(double(n)));
  EXPECT_NEAR(x.std().item<double>(), sigma, 0.01 * sigma);
  const at::Tensor sorted = std::get<0>(x.sort());
  const double* v = sorted.data_ptr<double>();
  double d = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double cdf = 0.5 * std::erfc(-(v[i] - m) / (sigma * std::sqrt(2.0)));
    d = std::max({d, std::abs(cdf - double(i) / double(n)), std::abs(cdf - double(i + 1) / double(n))});
  }
  EXPECT_LT(d, 1.63 / std::sqrt(double(n))) << "KS distance";
  // A uniform draw of the same mean and spread is far from normal by the same measure.
  const at::Tensor u = (torch::rand({n}, at::kDouble) - 0.5) * sigma * std::sqrt(12.0) + m;
  const at::Tensor us = std::get<0>(u.sort());
  double du = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double cdf = 0.5 * std::erfc(-(us.data_ptr<double>()[i] - m) / (sigma * std::sqrt(2.0)));
    du = std::max(du, std::abs(cdf - double(i) / double(n)));
  }
  EXPECT_GT(du, 1.63 / std::sqrt(double(n))) << "the KS check cannot tell a uniform draw";
  const at::Tensor y = elasticface_draws(n, m, sigma, 11, 6).to(at::kDouble);
  const double r = ((x - x.mean()) * (y - y.mean())).mean().item<double>() / (x.std().item<double>() * y.std().item<double>());
  EXPECT_LT(std::abs(r), 5 / std::sqrt(double(n)));
}

// The trainer's start-up line names a head by its own parameters, resolved (defaults and
// the config's settings); the combined head by its margin.
TEST(MarginHeads, DescribedByTheirOwnParameters) {
  EXPECT_EQ(describe_margin_head(HeadSpec{"adaface", {{"m", 0.5}}}, CombinedMargin{}),
            "adaface (m 0.5, h 0.333, s 64, t_alpha 0.01)");
  EXPECT_EQ(describe_margin_head(HeadSpec{"magface", {{"easy_margin", 0}}}, CombinedMargin{}),
            "magface (l_a 10, u_a 110, l_m 0.45, u_m 0.8, lambda_g 35, s 64, easy_margin false)");
  EXPECT_EQ(describe_margin_head(HeadSpec{"combined", {}}, CombinedMargin{1, 0, 0.4, 32}),
            "combined (margin (1, 0, 0.4), s 32, exact mode)");
  for (const HeadInfo& h : head_catalogue()) {
    const std::string d = describe_margin_head(HeadSpec{h.name, {}}, CombinedMargin{});
    EXPECT_EQ(d.rfind(h.name + " (", 0), 0u) << d;
    for (const HeadParam& p : h.params) EXPECT_NE(d.find(p.name + " "), std::string::npos) << d;
  }
}

TEST(MarginHeads, UnknownHeadOrParameterNamed) {
  HeadSpec bad{"no_such_head", {}};
  try {
    make_margin_head(bad, CombinedMargin{});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.option(), "head");
    EXPECT_NE(std::string(e.what()).find("'no_such_head' is not a head (adaface | arcface | combined"), std::string::npos)
        << e.what();
  }
  try {
    make_margin_head(HeadSpec{"adaface", {{"t", 0.1}}}, CombinedMargin{});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.option(), "t");
  }
  EXPECT_THROW(make_margin_head(HeadSpec{"adaface", {{"t_alpha", 2.0}}}, CombinedMargin{}), Error);
}

}  // namespace
}  // namespace faceshard
