// The margin heads under everything Partial FC adds: W = 1..4 ranks with uneven shards and
// batches, sampling, gradient accumulation, resume. The reference is one process holding the
// whole batch and the whole weight matrix, written here from each head's definition (the
// authors' code) with plain ops in float64 and autograd; tests/e2e/heads_reference.py checks
// the single-process heads against the authors' code itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "partial_fc/classifier/elasticface_head.h"
#include "partial_fc/classifier/partial_fc.h"
#include "partial_fc/runtime/error.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

namespace F = torch::nn::functional;

// One process, float64: the head's logits over the columns `cols` of the whole weight (all
// when undefined) and any extra loss term; keeps the head's state across calls.
struct HeadReference {
  std::string head;
  double s = 64;
  double batch_mean = 20, batch_std = 100;  // AdaFace
  double t = 0;                             // CurricularFace
  uint64_t seed = 0;
  int64_t forward = 0;

  at::Tensor loss(const at::Tensor& raw, const at::Tensor& weight, const at::Tensor& labels, const at::Tensor& cols) {
    const at::Tensor Wsel = cols.defined() ? weight.index_select(0, cols) : weight;
    const at::Tensor y = cols.defined() ? torch::searchsorted(cols, labels) : labels;
    const at::Tensor norms = raw.norm(2, {1}, true);
    at::Tensor cos = torch::mm(raw / norms, F::normalize(Wsel, F::NormalizeFuncOptions().dim(1)).t());
    const at::Tensor onehot = F::one_hot(y, cos.size(1)).to(torch::kDouble);
    const at::Tensor yy = y.unsqueeze(1);
    at::Tensor logits, extra;
    if (head == "adaface") {
      const double m = 0.4, h = 0.333, ta = 0.01, eps = 1e-3;
      cos = cos.clamp(-1 + eps, 1 - eps);
      const at::Tensor safe = norms.clamp(0.001, 100).detach();
      batch_mean = safe.mean().item<double>() * ta + (1 - ta) * batch_mean;
      batch_std = safe.std().item<double>() * ta + (1 - ta) * batch_std;
      const at::Tensor z = ((safe - batch_mean) / (batch_std + eps) * h).clamp(-1, 1);
      const at::Tensor theta_m = (cos.acos() + onehot * (z * -m)).clamp(eps, M_PI - eps);
      logits = (theta_m.cos() - onehot * (z * m + m)) * s;
    } else if (head == "curricularface") {
      const double m = 0.5;
      cos = cos.clamp(-1, 1);
      const at::Tensor tl = cos.gather(1, yy);
      const at::Tensor ctm = tl * std::cos(m) - (1 - tl * tl).sqrt() * std::sin(m);
      const at::Tensor final_t = torch::where(tl > std::cos(M_PI - m), ctm, tl - std::sin(M_PI - m) * m);
      t = tl.mean().item<double>() * 0.01 + 0.99 * t;
      const at::Tensor hard = cos > ctm;
      at::Tensor mod = torch::where(hard, cos * (cos + t), cos);
      logits = mod.scatter(1, yy, final_t) * s;
    } else if (head == "magface") {
      const double la = 10, ua = 110, lm = 0.45, um = 0.8, lg = 35;
      const at::Tensor a = norms.clamp(la, ua);
      const at::Tensor mg = (um - lm) / (ua - la) * (a - la) + lm;
      cos = cos.clamp(-1, 1);
      const at::Tensor ctm = cos * mg.cos() - (1 - cos * cos).sqrt() * mg.sin();
      logits = (onehot * torch::where(cos > 0, ctm, cos) + (1 - onehot) * cos) * s;
      extra = (a / (ua * ua) + 1 / a).mean() * lg;
    } else if (head == "elasticface_arc") {
      cos = cos.clamp(-1, 1);
      // The draws of this forward, handed out as the plus variant does.
      at::Tensor mg = elasticface_draws(raw.size(0), 0.5, 0.0125, seed, forward).to(torch::kDouble);
      const at::Tensor order = std::get<1>(cos.gather(1, yy).squeeze(1).detach().sort(0, true));
      mg = std::get<0>(mg.sort()).index_select(0, order);
      logits = (cos.acos() + onehot * mg.unsqueeze(1)).cos() * s;
    } else {
      ADD_FAILURE() << "no reference for " << head;
    }
    ++forward;
    at::Tensor l = F::cross_entropy(logits, y);
    return extra.defined() ? l + extra : l;
  }
};

int64_t rows_of(int r) { return 4 + (r % 2); }

// The global batch: every rank builds all of it from the same seeds, with feature norms from
// 2 to 140 and target cosines from negative to 0.8.
struct Batch {
  at::Tensor emb, labels;
  int64_t offset = 0, rows = 0;
};
Batch make_batch(int W, int r, int64_t C, int64_t D, const at::Tensor& weight, int salt) {
  Batch b;
  std::vector<at::Tensor> es, ls;
  for (int q = 0; q < W; ++q) {
    torch::manual_seed(900 + 31 * salt + q);
    const int64_t n = rows_of(q);
    at::Tensor y = torch::randint(0, C, {n}, torch::kLong);
    at::Tensor e = torch::randn({n, D});
    const at::Tensor wy = F::normalize(weight.index_select(0, y), F::NormalizeFuncOptions().dim(1));
    e = F::normalize(e, F::NormalizeFuncOptions().dim(1)) + (torch::rand({n, 1}) * 2.2 - 0.6) * wy;
    e = F::normalize(e, F::NormalizeFuncOptions().dim(1)) * (torch::rand({n, 1}) * 138 + 2);
    es.push_back(e);
    ls.push_back(y);
    if (q < r) b.offset += n;
  }
  b.rows = rows_of(r);
  b.emb = torch::cat(es);
  b.labels = torch::cat(ls);
  return b;
}

struct HeadCase {
  const char* head;
  int world;
  const char* mode;  // full | sampled | accumulate
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
    if (std::string(hc.head) == "elasticface_arc") o.head.params["plus"] = 1;
    o.sample_rate = mode == "sampled" ? 0.3 : (mode == "accumulate" ? 0.2 : 1.0);
    o.optimizer = ShardOptimizerOptions{"sgd", 0.9, 0.0};  // first step: w - lr * g
    const at::Tensor full = PartialFC::initial_rows(0, C, D, o.seed);
    PartialFC fc(d, o);
    HeadReference ref{hc.head};
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
      const std::string at = std::string(hc.head) + " forward " + std::to_string(k);
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
        const double want = kv.first == "t" ? ref.t : kv.first == "batch_mean" ? ref.batch_mean : ref.batch_std;
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

std::vector<HeadCase> head_cases() {
  std::vector<HeadCase> out;
  for (const char* h : {"adaface", "curricularface", "magface", "elasticface_arc"}) {
    for (int w = 1; w <= 4; ++w) out.push_back({h, w, "full"});
    out.push_back({h, 3, "sampled"});
    out.push_back({h, 2, "accumulate"});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Heads, MarginHeadsDistributed, ::testing::ValuesIn(head_cases()), [](const auto& info) {
  return std::string(info.param.head) + "_W" + std::to_string(info.param.world) + "_" + info.param.mode;
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

TEST(MarginHeads, UnknownHeadOrParameterNamed) {
  HeadSpec bad{"sphereface", {}};
  try {
    make_margin_head(bad, CombinedMargin{});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.option(), "head");
    EXPECT_NE(std::string(e.what()).find("'sphereface' is not a head"), std::string::npos) << e.what();
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
