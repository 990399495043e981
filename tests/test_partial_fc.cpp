// The sharded classifier against one process holding the concatenated batch and the whole
// weight matrix, written here with plain tensor ops (independent of partial_fc's code). The
// GlooCuda cases run the same bodies at world 2 with both ranks' shards on cuda:0, over Gloo.
#include <gtest/gtest.h>

#include <cmath>

#include <ATen/CPUGeneratorImpl.h>

#include "partial_fc/classifier/class_shard.h"
#include "partial_fc/data_parallel/ddp.h"
#include "base/error.h"
#include "partial_fc/classifier/margin.h"
#include "partial_fc/classifier/partial_fc.h"
#include "tests/harness.h"

namespace faceshard {
namespace {

namespace F = torch::nn::functional;

// The initial centres: block b of 1024 classes is N(0, 0.01) from its own generator seeded
// by (seed, b), so any range of rows, drawn with any number of threads, is the same rows.
TEST(PartialFCInit, RowsDependOnClassAndSeedOnly) {
  const int64_t C = 5000, D = 16;
  const uint64_t seed = 2048;
  at::Tensor want = torch::empty({C, D});
  for (int64_t b = 0; b * 1024 < C; ++b) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ULL + static_cast<uint64_t>(b));
    const int64_t n = std::min<int64_t>(1024, C - b * 1024);
    want.narrow(0, b * 1024, n).copy_(at::normal(0.0, 0.01, {1024, D}, gen).narrow(0, 0, n));
  }
  const int threads = at::get_num_threads();
  for (int t : {1, 3}) {
    at::set_num_threads(t);
    EXPECT_TRUE(torch::equal(PartialFC::initial_rows(0, C, D, seed), want)) << t << " threads";
    EXPECT_TRUE(torch::equal(PartialFC::initial_rows(1500, 2000, D, seed), want.narrow(0, 1500, 2000))) << t;
    EXPECT_TRUE(torch::equal(PartialFC::initial_rows(4999, 1, D, seed), want.narrow(0, 4999, 1))) << t;
  }
  at::set_num_threads(threads);
  EXPECT_FALSE(torch::equal(PartialFC::initial_rows(0, C, D, seed + 1), want));
  EXPECT_NEAR(want.std().item<double>(), 0.01, 5e-4);
}

TEST(ClassShard, ContiguousRangesFirstRanksOneMore) {
  for (int W = 1; W <= 5; ++W) {
    auto all = ClassShard::all(1003, W);
    int64_t next = 0;
    for (int r = 0; r < W; ++r) {
      EXPECT_EQ(all[r].start, next);
      EXPECT_EQ(all[r].count, 1003 / W + (r < 1003 % W ? 1 : 0));
      next += all[r].count;
    }
    EXPECT_EQ(next, 1003);
  }
  EXPECT_THROW(ClassShard::of(2, 3, 0), Error);
}

// --- the margin ---------------------------------------------------------------------

TEST(Margin, ExactGradientMatchesFiniteDifferences) {
  const std::vector<CombinedMargin> margins{{1.0, 0.5, 0.0}, {1.0, 0.0, 0.4}, {1.0, 0.3, 0.2}, {1.35, 0.25, 0.1}};
  for (const auto& m : margins) {
    SCOPED_TRACE(::testing::Message() << "m1=" << m.m1 << " m2=" << m.m2 << " m3=" << m.m3);
    at::Tensor c = torch::linspace(-0.995, 0.995, 2001, torch::kDouble);
    const double h = 1e-6;
    at::Tensor fd = (m.target(c + h) - m.target(c - h)) / (2 * h);
    at::Tensor an = m.target_grad(c);
    // Skip the kink where m1*theta + m2 = pi (one-sided derivatives differ there).
    const double tmax = (M_PI - m.m2) / m.m1;
    at::Tensor keep = tmax < M_PI ? ((c.acos() - tmax).abs() > 1e-3) : torch::ones_like(c, torch::kBool);
    EXPECT_LT((fd - an).masked_select(keep).abs().max().item<double>(), 1e-6);
    // Monotone increasing in c (a margin never rewards a worse angle) and continuous.
    at::Tensor t = m.target(c);
    EXPECT_TRUE((t.narrow(0, 1, t.size(0) - 1) >= t.narrow(0, 0, t.size(0) - 1)).all().item<bool>());
    EXPECT_LT((t.narrow(0, 1, t.size(0) - 1) - t.narrow(0, 0, t.size(0) - 1)).abs().max().item<double>(), 0.02);
    // Closed form inside the valid range.
    at::Tensor inside = c.acos() * m.m1 + m.m2 < M_PI;
    at::Tensor closed = (c.acos() * m.m1 + m.m2).cos() - m.m3;
    EXPECT_LT((t - closed).masked_select(inside).abs().max().item<double>(), 1e-9);
  }
}

TEST(Margin, ArcFaceBeyondPiContinuesLinearly) {
  CombinedMargin m{1.0, 0.5, 0.0};
  const double cmax = std::cos(M_PI - 0.5);
  at::Tensor c = torch::tensor({cmax - 0.1, cmax - 0.2}, torch::kDouble);
  at::Tensor t = m.target(c);
  EXPECT_NEAR(t[0].item<double>(), -1.0 - 0.1, 1e-12);
  EXPECT_NEAR(t[1].item<double>(), -1.0 - 0.2, 1e-12);
  EXPECT_TRUE(torch::allclose(m.target_grad(c), torch::ones_like(c)));
}

// arcface_torch's CombinedMarginLoss: the angular margin without a correction where
// theta + m2 > pi (the cosine turns back up), its gradient passed straight through, m3
// alone whenever m3 > 0, and no case for m1 != 1 without m3.
TEST(Margin, ArcfaceTorchModeClosedForms) {
  CombinedMargin arc{1.0, 0.5, 0.0};
  arc.mode = MarginMode::ArcfaceTorch;
  at::Tensor c = torch::linspace(-1.0, 1.0, 2001, torch::kDouble);
  EXPECT_LT((arc.target(c) - (c.acos() + 0.5).cos()).abs().max().item<double>(), 1e-12);
  EXPECT_TRUE(torch::equal(arc.target_grad(c), torch::ones_like(c)));
  EXPECT_TRUE(arc.unit_gradient());
  // Beyond theta = pi - m2: cos(theta + m2) > -1 (here the exact mode continues below -1).
  const double cmax = std::cos(M_PI - 0.5);
  at::Tensor beyond = torch::tensor({cmax - 0.05, -1.0}, torch::kDouble);
  EXPECT_NEAR(arc.target(beyond)[0].item<double>(), std::cos(std::acos(cmax - 0.05) + 0.5), 1e-12);
  EXPECT_NEAR(arc.target(beyond)[1].item<double>(), std::cos(M_PI + 0.5), 1e-12);
  CombinedMargin exact{1.0, 0.5, 0.0};
  EXPECT_NEAR(exact.target(beyond)[1].item<double>(), -1.0 - cmax - 1.0, 1e-12);
  EXPECT_FALSE(exact.unit_gradient());
  // Combined margins: m3 alone (m1 and m2 ignored), gradient 1.
  CombinedMargin combined{1.2, 0.3, 0.2};
  combined.mode = MarginMode::ArcfaceTorch;
  EXPECT_NO_THROW(combined.validate());
  EXPECT_LT((combined.target(c) - (c - 0.2)).abs().max().item<double>(), 1e-12);
  EXPECT_TRUE(torch::equal(combined.target_grad(c), torch::ones_like(c)));
  // CosFace is the same in both modes; plain softmax (0, 0, 0) too.
  CombinedMargin cos_exact{1.0, 0.0, 0.4}, cos_torch{1.0, 0.0, 0.4}, plain{1.0, 0.0, 0.0};
  cos_torch.mode = MarginMode::ArcfaceTorch;
  plain.mode = MarginMode::ArcfaceTorch;
  EXPECT_TRUE(torch::equal(cos_exact.target(c), cos_torch.target(c)));
  EXPECT_TRUE(torch::equal(plain.target(c), c));
  EXPECT_EQ(arc.row_loss_cap(), -std::log(static_cast<double>(1e-30f)));
  EXPECT_TRUE(std::isinf(exact.row_loss_cap()));
  // What arcface_torch raises for, and margins out of range, are option errors naming "margin".
  for (CombinedMargin bad : {CombinedMargin{1.35, 0.0, 0.0}, CombinedMargin{1.0, 0.5, -0.1}}) {
    EXPECT_NO_THROW(bad.validate());
    bad.mode = MarginMode::ArcfaceTorch;
    try {
      bad.validate();
      ADD_FAILURE() << "expected an error for m1=" << bad.m1 << " m3=" << bad.m3;
    } catch (const Error& e) {
      EXPECT_EQ(e.option(), "margin");
      EXPECT_NE(std::string(e.what()).find("no arcface_torch equivalent"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(parse_margin_mode("arcface_torch"), MarginMode::ArcfaceTorch);
  EXPECT_THROW(parse_margin_mode("torch"), Error);
}

// --- reference ----------------------------------------------------------------------

struct Reference {
  at::Tensor loss, emb_grad, weight_grad, accuracy;
};

// Margin softmax over the columns `cols` of the full weight (all classes when undefined),
// in float64: the truth both fp32 implementations are measured against.
Reference reference(const at::Tensor& emb, const at::Tensor& weight, const at::Tensor& labels, const CombinedMargin& m,
                    at::Tensor cols = at::Tensor()) {
  at::Tensor E = emb.to(torch::kDouble).clone().requires_grad_();
  at::Tensor Wt = weight.to(torch::kDouble).clone().requires_grad_();
  at::Tensor Wsel = cols.defined() ? Wt.index_select(0, cols) : Wt;
  at::Tensor y = labels;
  if (cols.defined()) y = torch::searchsorted(cols, labels);
  at::Tensor cos = torch::mm(F::normalize(E, F::NormalizeFuncOptions().dim(1)),
                             F::normalize(Wsel, F::NormalizeFuncOptions().dim(1)).t());
  at::Tensor onehot = F::one_hot(y, cos.size(1)).to(torch::kBool);
  at::Tensor c = cos;
  if (m.interclass_filter > 0) c = torch::where((c > m.interclass_filter) & ~onehot, torch::zeros_like(c), c);
  at::Tensor theta = c.clamp(-1 + 1e-7, 1 - 1e-7).acos();
  at::Tensor t = (theta * m.m1 + m.m2).cos() - m.m3;  // test data stays inside m1*theta + m2 < pi
  at::Tensor logits = torch::where(onehot, t, c) * m.scale;
  Reference r;
  r.loss = F::cross_entropy(logits, y);
  r.loss.backward();
  r.emb_grad = E.grad();
  r.weight_grad = Wt.grad();
  r.accuracy = (std::get<1>(cos.max(1)) == y).to(torch::kFloat).mean();
  return r;
}

int64_t rows_of(int r) { return 4 + (r % 2); }  // uneven batches across ranks

struct Data {
  at::Tensor emb, labels;  // concatenated over ranks
  int64_t offset = 0, rows = 0;
};

Data make_data(int W, int r, int64_t C, int64_t d) {
  Data dt;
  std::vector<at::Tensor> es, ls;
  for (int q = 0; q < W; ++q) {
    torch::manual_seed(300 + q);
    es.push_back(torch::randn({rows_of(q), d}));
    ls.push_back(torch::randint(0, C, {rows_of(q)}, torch::kLong));
    if (q < r) dt.offset += rows_of(q);
  }
  dt.rows = rows_of(r);
  dt.emb = torch::cat(es);
  dt.labels = torch::cat(ls);
  return dt;
}

struct FcCase {
  int world;
  const char* margin;  // arcface | cosface | filter
  bool streamed = false;  // loss.logits: streamed (several chunks per shard)
  bool cuda = false;      // the shards and the embeddings on cuda:0 (every rank on the one GPU)
};

torch::Device device_of(bool cuda) { return cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU); }

// fp32 on a GPU means fp32: TF32 would round the GEMMs' inputs to 10 bits.
void fp32_on_gpu(bool cuda) {
  if (!cuda) return;
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
}

// Tolerance of a GPU case against the float64 reference: the fp32 CPU path holds 1e-5; cuBLAS
// and the CUDA softmax sum the dot products and the rows in other orders, and the scale (64)
// multiplies a cosine's rounding into the logits, so a few 1e-6 more. A wrong shard, margin,
// reduction or gradient convention is off by 1e-2 or more.
constexpr double kCudaTolerance = 1e-4;

class PartialFCEquivalence : public ::testing::TestWithParam<FcCase> {};

TEST_P(PartialFCEquivalence, LossAndGradientsMatchFullSoftmax) {
  const FcCase fc_case = GetParam();
  if (fc_case.cuda && !torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  testing::run_ranks(fc_case.world, [fc_case](Distributed& d) {
    const torch::Device dev = device_of(fc_case.cuda);
    fp32_on_gpu(fc_case.cuda);
    const double tol = fc_case.cuda ? kCudaTolerance : 1e-5;
    const int64_t C = 1003, D = 16;
    const std::string mname = fc_case.margin;
    PartialFCOptions o;
    o.num_classes = C;
    o.embedding_size = D;
    o.margin = mname == "cosface" ? CombinedMargin{1.0, 0.0, 0.4} : CombinedMargin{1.0, 0.5, 0.0};
    if (mname == "filter") o.margin.interclass_filter = 0.2;
    o.streamed_logits = fc_case.streamed;
    if (fc_case.streamed) o.update_chunk_rows = 100;
    Data data = make_data(d.world_size(), d.rank(), C, D);
    if (mname == "filter") data.emb.narrow(1, 0, 1).add_(3.0);  // correlated embeddings: some cosines above 0.2
    at::Tensor full_weight = PartialFC::initial_rows(0, C, D, o.seed);
    Reference ref = reference(data.emb, full_weight, data.labels, o.margin);

    PartialFC fc(d, o, dev);
    ASSERT_EQ(fc.weight().device(), dev);
    ASSERT_TRUE(torch::equal(fc.weight().cpu(), full_weight.narrow(0, fc.shard().start, fc.shard().count)));
    // The labels stay on the host (PartialFC::forward).
    at::Tensor emb = data.emb.narrow(0, data.offset, data.rows).clone().to(dev).requires_grad_();
    auto out = fc.forward(emb, data.labels.narrow(0, data.offset, data.rows));
    out.loss.backward();
    EXPECT_LE(testing::relative_error(out.loss.cpu(), ref.loss), tol) << out.loss.item<double>() << " vs " << ref.loss.item<double>();
    EXPECT_NEAR(out.accuracy.item<double>(), ref.accuracy.item<double>(), 1e-6);
    // Embedding gradient: W x dL/demb by the gradient convention (partial_fc.h).
    ASSERT_EQ(emb.grad().device(), dev);
    EXPECT_LE(testing::relative_error(emb.grad().cpu(), ref.emb_grad.narrow(0, data.offset, data.rows) * d.world_size()), tol);
    EXPECT_LE(testing::relative_error(fc.gradient().cpu(), ref.weight_grad.narrow(0, fc.shard().start, fc.shard().count)), tol);
  });
}

std::string fc_case_name(const ::testing::TestParamInfo<FcCase>& info) {
  return "W" + std::to_string(info.param.world) + "_C1003_" + info.param.margin + (info.param.streamed ? "_streamed" : "");
}

INSTANTIATE_TEST_SUITE_P(Worlds, PartialFCEquivalence,
                         ::testing::Values(FcCase{1, "arcface"}, FcCase{2, "arcface"}, FcCase{3, "arcface"},
                                           FcCase{4, "arcface"}, FcCase{1, "cosface"}, FcCase{2, "cosface"},
                                           FcCase{3, "cosface"}, FcCase{4, "cosface"}, FcCase{3, "filter"},
                                           FcCase{1, "arcface", true}, FcCase{2, "arcface", true},
                                           FcCase{3, "arcface", true}, FcCase{4, "arcface", true},
                                           FcCase{2, "cosface", true}, FcCase{3, "filter", true}),
                         fc_case_name);
INSTANTIATE_TEST_SUITE_P(GlooCuda, PartialFCEquivalence,
                         ::testing::Values(FcCase{2, "arcface", false, true}, FcCase{2, "cosface", false, true},
                                           FcCase{2, "filter", false, true}, FcCase{2, "arcface", true, true}),
                         fc_case_name);

class PartialFCSampling : public ::testing::TestWithParam<std::string> {};

TEST_P(PartialFCSampling, SampledSoftmaxAndUntouchedRows) {
  const std::string kind = GetParam();
  testing::run_ranks(3, [kind](Distributed& d) {
    const int64_t C = 1003, D = 16;
    PartialFCOptions o;
    o.num_classes = C;
    o.embedding_size = D;
    o.sample_rate = 0.1;
    o.optimizer = ShardOptimizerOptions{kind, 0.9, 5e-4};
    Data data = make_data(d.world_size(), d.rank(), C, D);
    at::Tensor full_weight = PartialFC::initial_rows(0, C, D, o.seed);
    PartialFC fc(d, o);
    for (int step = 0; step < 3; ++step) {
      at::Tensor before = fc.weight().clone();
      std::map<std::string, at::Tensor> state_before;
      for (auto& kv : fc.state()) state_before[kv.first] = kv.second.clone();
      at::Tensor emb = data.emb.narrow(0, data.offset, data.rows).clone().requires_grad_();
      auto out = fc.forward(emb, data.labels.narrow(0, data.offset, data.rows));
      ASSERT_EQ(fc.sampled_index().size(0), std::max<int64_t>(fc.num_sample(), 0));
      // Every positive class of the global batch that this rank owns is sampled.
      at::Tensor global_index = fc.sampled_index() + fc.shard().start;
      for (int64_t i = 0; i < data.labels.size(0); ++i) {
        const int64_t y = data.labels[i].item<int64_t>();
        if (fc.shard().owns(y)) EXPECT_TRUE((global_index == y).any().item<bool>()) << "positive " << y;
      }
      // Loss = full softmax restricted to the union of sampled classes (current weights).
      at::Tensor cols = std::get<0>(torch::sort(d.all_gather(global_index)));
      std::vector<at::Tensor> shards;
      at::Tensor cur = d.all_gather(fc.weight().detach());
      Reference ref = reference(data.emb, cur, data.labels, o.margin, cols);
      EXPECT_LE(testing::relative_error(out.loss, ref.loss), 1e-5);
      out.loss.backward();
      // Sampled negatives' gradients are s/N times their probabilities, whose relative error
      // is that of the logits: s * (a few fp32 roundings of a cosine), about 2e-5 at s = 64
      // against the float64 truth.
      EXPECT_LE(testing::relative_error(fc.gradient(), ref.weight_grad.index_select(0, global_index)), 3e-5);
      fc.step(0.1);
      // Unsampled rows and their optimiser state: bit-identical. Sampled rows: changed.
      at::Tensor unsampled = torch::ones({fc.shard().count}, torch::kBool);
      unsampled.index_fill_(0, fc.sampled_index(), false);
      at::Tensor ui = unsampled.nonzero().view({-1});
      EXPECT_TRUE(torch::equal(fc.weight().index_select(0, ui), before.index_select(0, ui)));
      for (auto& kv : fc.state())
        EXPECT_TRUE(torch::equal(kv.second.index_select(0, ui), state_before[kv.first].index_select(0, ui))) << kv.first;
      EXPECT_FALSE(torch::equal(fc.weight().index_select(0, fc.sampled_index()), before.index_select(0, fc.sampled_index())));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Optimisers, PartialFCSampling, ::testing::Values("sgd", "adamw"),
                         [](const auto& info) { return info.param; });

// Gradient accumulation with sampling: each micro-batch samples its own rows; one step must
// apply the summed gradient of both micro-batch losses (each divided by 2, as the trainer
// does) to the union of the rows, and nothing else. Reference: one process, autograd on the
// whole weight matrix, a hand-written SGD step.
TEST(PartialFCSampling, AccumulatedMicroBatchesStepTheUnionOfRows) {
  testing::run_ranks(2, [](Distributed& d) {
    const int64_t C = 301, D = 8;
    const double lr = 0.1, wd = 5e-4;
    PartialFCOptions o;
    o.num_classes = C;
    o.embedding_size = D;
    o.sample_rate = 0.2;
    o.optimizer = ShardOptimizerOptions{"sgd", 0.9, wd};
    PartialFC fc(d, o);
    const at::Tensor full = PartialFC::initial_rows(0, C, D, o.seed);
    Data first = make_data(d.world_size(), d.rank(), C, D), second = first;
    second.emb = -first.emb + 0.3;
    second.labels = (first.labels * 7 + 11) % C;
    at::Tensor dense_grad = torch::zeros_like(full);
    at::Tensor touched = torch::zeros({C}, torch::kBool);
    int k = 0;
    for (const Data* data : {&first, &second}) {
      auto out = fc.forward(data->emb.narrow(0, data->offset, data->rows), data->labels.narrow(0, data->offset, data->rows));
      (out.loss / 2).backward();
      at::Tensor cols = std::get<0>(torch::sort(d.all_gather(fc.sampled_index() + fc.shard().start)));
      dense_grad += reference(data->emb, full, data->labels, o.margin, cols).weight_grad / 2;
      touched.index_fill_(0, fc.sampled_index() + fc.shard().start, true);
      if (k++ == 0) fc.accumulate();
    }
    fc.step(lr);
    const int64_t s = fc.shard().start, n = fc.shard().count;
    at::Tensor w0 = full.narrow(0, s, n), g = dense_grad.narrow(0, s, n), mask = touched.narrow(0, s, n).unsqueeze(1);
    at::Tensor expected = torch::where(mask, w0 - lr * (g + wd * w0), w0);
    EXPECT_LE(testing::relative_error(fc.weight(), expected), 1e-5);
    EXPECT_TRUE(torch::equal(fc.weight().masked_select(~mask), w0.masked_select(~mask)));
    // Two micro-batches with different labels sample different rows: more than one forward's worth.
    EXPECT_GT(fc.sampled_index().size(0), fc.num_sample());
  });
}

// The classifier in arcface_torch mode against that semantics written with plain ops: the
// margin applied to a detached target (value cos(theta + m2), gradient straight through),
// rows whose theta + m2 exceeds pi (embeddings facing away from their class centre: their
// target turns back up), and a loss of -log(max(p_target, 1e-30)) per row (those rows'
// target probabilities are far below 1e-30). On 1 and 2 ranks, in float64 for the reference.
TEST(PartialFCArcfaceTorchMode, MatchesStraightThroughReference) {
  for (int W : {1, 2})
  for (bool streamed : {false, true}) {
    testing::run_ranks(W, [streamed](Distributed& d) {
      const int64_t C = 61, D = 16;
      PartialFCOptions o;
      o.num_classes = C;
      o.embedding_size = D;
      o.margin = CombinedMargin{1.0, 0.5, 0.0};
      o.margin.mode = MarginMode::ArcfaceTorch;
      o.streamed_logits = streamed;
      o.update_chunk_rows = 16;
      Data data = make_data(d.world_size(), d.rank(), C, D);
      const at::Tensor full = PartialFC::initial_rows(0, C, D, o.seed);
      // Every third row faces away from its centre: cos(theta) near -1, theta + m2 > pi.
      for (int64_t i = 0; i < data.emb.size(0); i += 3)
        data.emb[i] = -full[data.labels[i].item<int64_t>()] * 50 + 0.02 * data.emb[i];
      at::Tensor E = data.emb.to(torch::kDouble).clone().requires_grad_();
      at::Tensor Wd = full.to(torch::kDouble).clone().requires_grad_();
      at::Tensor cos = torch::mm(F::normalize(E, F::NormalizeFuncOptions().dim(1)),
                                 F::normalize(Wd, F::NormalizeFuncOptions().dim(1)).t()).clamp(-1, 1);
      at::Tensor onehot = F::one_hot(data.labels, C).to(torch::kBool);
      at::Tensor shifted = torch::where(onehot, (cos.acos() + 0.5).cos(), cos).detach();
      at::Tensor logits = (cos + (shifted - cos).detach()) * 64.0;  // value shifted, gradient of cos
      F::cross_entropy(logits, data.labels).backward();
      at::Tensor p_target = torch::softmax(logits.detach(), 1).gather(1, data.labels.unsqueeze(1));
      const at::Tensor ref_loss = -p_target.clamp_min(1e-30).log().mean();
      ASSERT_GT((p_target < 1e-30).sum().item<int64_t>(), 0) << "no row reaches the cap";
      at::Tensor beyond = (cos.masked_select(onehot).acos() + 0.5) > M_PI;
      ASSERT_GT(beyond.sum().item<int64_t>(), 0) << "no row beyond theta + m2 = pi";

      PartialFC fc(d, o);
      at::Tensor emb = data.emb.narrow(0, data.offset, data.rows).clone().requires_grad_();
      auto out = fc.forward(emb, data.labels.narrow(0, data.offset, data.rows));
      out.loss.backward();
      EXPECT_LE(testing::relative_error(out.loss, ref_loss), 1e-5) << out.loss.item<double>() << " vs " << ref_loss.item<double>();
      EXPECT_LE(testing::relative_error(emb.grad(), E.grad().narrow(0, data.offset, data.rows) * d.world_size()), 1e-5);
      EXPECT_LE(testing::relative_error(fc.gradient(), Wd.grad().narrow(0, fc.shard().start, fc.shard().count)), 1e-5);
    });
  }
}

// optim.fc_update: all. With sampling, every row takes the SGD step, the unsampled ones
// with a zero gradient (weight decay and momentum move them), as one optimiser over the
// whole weight does; the sampled rows as before.
TEST(PartialFCSampling, StepAllRowsMovesUnsampledRowsLikeADenseOptimiser) {
  // Momentum 0 too: plain SGD, the buffers unused (and still zero in the state).
  for (const double mom : {0.9, 0.0}) {
    testing::run_ranks(2, [mom](Distributed& d) {
      const int64_t C = 201, D = 8;
      const double lr = 0.1, wd = 5e-4;
      PartialFCOptions o;
      o.num_classes = C;
      o.embedding_size = D;
      o.sample_rate = 0.2;
      o.step_all_rows = true;
      o.optimizer = ShardOptimizerOptions{"sgd", mom, wd};
      PartialFC fc(d, o);
      Data data = make_data(d.world_size(), d.rank(), C, D);
      at::Tensor w = PartialFC::initial_rows(0, C, D, o.seed), buf;
      for (int step = 0; step < 2; ++step) {
        auto out = fc.forward(data.emb.narrow(0, data.offset, data.rows), data.labels.narrow(0, data.offset, data.rows));
        out.loss.backward();
        at::Tensor cols = std::get<0>(torch::sort(d.all_gather(fc.sampled_index() + fc.shard().start)));
        at::Tensor dense = torch::zeros_like(w).index_copy_(0, cols, reference(data.emb, w, data.labels, o.margin, cols)
                                                                       .weight_grad.index_select(0, cols).to(torch::kFloat));
        fc.step(lr);
        at::Tensor dp = dense + wd * w;
        buf = buf.defined() ? buf * mom + dp : dp;
        w = w - lr * buf;
        EXPECT_LE(testing::relative_error(fc.weight(), w.narrow(0, fc.shard().start, fc.shard().count)), 1e-5)
            << "step " << step << " momentum " << mom;
      }
    });
  }
}

// The classifier's state is its rows (weight and optimiser state); loading checks names and
// shapes, and a loaded shard continues exactly where the saved one was.
TEST(PartialFCState, RoundTripAndBadRowsNamed) {
  auto dist = Distributed::init(DistEnv{});
  PartialFCOptions o;
  o.num_classes = 20;
  o.embedding_size = 4;
  o.optimizer.kind = "adamw";
  PartialFC a(*dist, o);
  at::Tensor emb = torch::randn({6, 4}), labels = torch::randint(0, 20, {6}, torch::kLong);
  a.forward(emb, labels).loss.backward();
  a.step(0.01);
  ShardRows saved;
  for (auto& kv : a.state()) saved.emplace_back(kv.first, kv.second.clone());
  std::vector<std::string> names;
  for (auto& kv : saved) names.push_back(kv.first);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "opt.exp_avg", "opt.exp_avg_sq", "opt.row_steps"}));
  PartialFC b(*dist, o);
  b.load_state(saved, "ckpt");
  for (PartialFC* fc : {&a, &b}) {
    fc->forward(emb, labels).loss.backward();
    fc->step(0.01);
  }
  EXPECT_TRUE(torch::equal(a.weight(), b.weight()));
  ShardRows wrong{{"opt.momentum", torch::zeros({20, 4})}};
  std::string msg;
  try {
    b.load_state(wrong, "ckpt");
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("ckpt: classifier state 'opt.momentum'"), std::string::npos) << msg;
  ShardRows short_rows{{"weight", torch::zeros({19, 4})}};
  msg.clear();
  try {
    b.load_state(short_rows, "ckpt");
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("'weight' has shape [19, 4], expected [20, 4]"), std::string::npos) << msg;
}

TEST(PartialFCSampling, RateOneEqualsFullComputation) {
  testing::run_ranks(2, [](Distributed& d) {
    PartialFCOptions o;
    o.num_classes = 101;
    o.embedding_size = 8;
    o.sample_rate = 1.0;
    Data data = make_data(2, d.rank(), 101, 8);
    PartialFC fc(d, o);
    EXPECT_FALSE(fc.samples());
    auto out = fc.forward(data.emb.narrow(0, data.offset, data.rows), data.labels.narrow(0, data.offset, data.rows));
    Reference ref = reference(data.emb, PartialFC::initial_rows(0, 101, 8, o.seed), data.labels, o.margin);
    EXPECT_LE(testing::relative_error(out.loss, ref.loss), 1e-5);
  });
}

// Under mixed precision the big GEMMs run in bf16 (the CPU runs them natively), the logits
// and the softmax in fp32: the loss and gradients stay close to the fp32 computation. The
// tolerance is what bf16's 8-bit mantissa allows for cosines scaled by s = 64 on a shard of
// 1003 classes (about 0.4% per input element, averaged over d = 64).
TEST(PartialFCPrecision, Bf16GemmsStayCloseToFp32) {
  testing::run_ranks(2, [](Distributed& d) {
    const int64_t C = 1003, D = 64;
    Data data = make_data(d.world_size(), d.rank(), C, D);
    PartialFCOptions o;
    o.num_classes = C;
    o.embedding_size = D;
    at::Tensor full_weight = PartialFC::initial_rows(0, C, D, o.seed);
    Reference ref = reference(data.emb.to(torch::kDouble), full_weight.to(torch::kDouble), data.labels, o.margin);
    for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
      o.gemm_dtype = dt;
      PartialFC fc(d, o);
      at::Tensor emb = data.emb.narrow(0, data.offset, data.rows).clone().requires_grad_();
      auto out = fc.forward(emb, data.labels.narrow(0, data.offset, data.rows));
      out.loss.backward();
      EXPECT_EQ(out.loss.scalar_type(), at::kFloat);
      const double tol = dt == at::kFloat ? 1e-5 : 2e-2;
      const double e_loss = testing::relative_error(out.loss, ref.loss);
      const double e_emb = testing::relative_error(emb.grad(), ref.emb_grad.narrow(0, data.offset, data.rows) * d.world_size());
      const double e_w = testing::relative_error(fc.gradient(), ref.weight_grad.narrow(0, fc.shard().start, fc.shard().count));
      EXPECT_LE(e_loss, tol) << c10::toString(dt);
      EXPECT_LE(e_emb, tol) << c10::toString(dt);
      EXPECT_LE(e_w, tol) << c10::toString(dt);
      if (dt == at::kBFloat16) EXPECT_GT(e_loss + e_emb + e_w, 1e-6) << "bf16 GEMMs left no trace: were they run in fp32?";
      std::printf("[rank %d] %s GEMMs: relative error of loss %.2e, embedding gradient %.2e, weight gradient %.2e\n",
                  d.rank(), c10::toString(dt), e_loss, e_emb, e_w);
    }
  });
}

// LibTorch's C++ build registers no Meta kernel for a few operators (Python adds them):
// their shape and type rules, for the meta-device test below.
at::Tensor where_meta(const at::Tensor& cond, const at::Tensor& a, const at::Tensor& b) {
  const auto shape = at::infer_size(at::infer_size(cond.sizes(), a.sizes()), b.sizes());
  return at::empty(shape, a.options().dtype(at::result_type(a, b)).device(torch::kMeta));
}
at::Tensor searchsorted_meta(const at::Tensor& sorted, const at::Tensor& values, bool out_int32, bool right,
                             std::optional<c10::string_view> side, const std::optional<at::Tensor>& sorter) {
  return at::empty(values.sizes(), values.options().dtype(out_int32 ? at::kInt : at::kLong).device(torch::kMeta));
}
at::Tensor index_select_meta(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  auto shape = self.sizes().vec();
  shape[at::maybe_wrap_dim(dim, self.dim())] = index.numel();
  return at::empty(shape, self.options());
}
void fused_sgd_meta(at::TensorList, at::TensorList, at::TensorList, double, double, double, double, bool, bool, bool,
                    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {}  // in place: shapes stay
TORCH_LIBRARY_IMPL(aten, Meta, m) {
  m.impl("_fused_sgd_", fused_sgd_meta);
  m.impl("index_select", index_select_meta);
  m.impl("where.self", where_meta);
  m.impl("searchsorted.Tensor", searchsorted_meta);
}

// The classifier step reads no device value on the host: run with the shard on the meta
// device (tensors with shapes and no data), any data-dependent operation (nonzero,
// masked_select, unique, item, a boolean-mask index) or device-to-host copy would throw.
// Labels stay host data, as the loader hands them over.
TEST(PartialFCDevice, StepNeedsNoDeviceValueOnTheHost) {
  auto dist = Distributed::init(DistEnv{});
  for (MarginMode mode : {MarginMode::Exact, MarginMode::ArcfaceTorch}) {
    for (double rate : {1.0, 0.3}) {
      for (double filter : {0.0, 0.2}) {
        for (bool all_rows : {false, true}) {
          if (all_rows && rate == 1.0) continue;
          PartialFCOptions o;
          o.num_classes = 40;
          o.embedding_size = 8;
          o.sample_rate = rate;
          o.margin.interclass_filter = filter;
          o.margin.mode = mode;
          o.step_all_rows = all_rows;
          PartialFC fc(*dist, o, torch::kMeta);
          at::Tensor emb = torch::empty({6, 8}, torch::TensorOptions().device(torch::kMeta)).requires_grad_();
          at::Tensor labels = torch::randint(0, 40, {6}, torch::kLong);
          PartialFCOutput out;
          ASSERT_NO_THROW({
            out = fc.forward(emb, labels);
            out.loss.backward();
            fc.step(0.1);
          }) << to_string(mode) << " rate " << rate << " filter " << filter << " all rows " << all_rows;
          EXPECT_TRUE(out.loss.is_meta() && out.accuracy.is_meta());
          EXPECT_TRUE(emb.grad().defined() && emb.grad().is_meta());
          EXPECT_EQ(emb.grad().sizes(), emb.sizes());
        }
      }
    }
  }
}

TEST(PartialFCLabels, OutOfRangeNamesLabelAndRank) {
  testing::run_ranks(3, [](Distributed& d) {
    PartialFCOptions o;
    o.num_classes = 50;
    o.embedding_size = 8;
    PartialFC fc(d, o);
    at::Tensor labels = torch::tensor({1, 2, 3}, torch::kLong);
    if (d.rank() == 2) labels[1] = 50;
    try {
      fc.forward(torch::randn({3, 8}), labels);
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("label 50 of rank 2 (batch row 1)"), std::string::npos) << msg;
    }
  });
}

// The gradient convention (docs/architecture.md) end to end: a replicated backbone under DataParallel (averaging)
// feeding the sharded classifier gets exactly the gradient of one process that holds the
// whole batch and the whole weight matrix.
void backbone_gradient_through_ddp(int world, bool cuda) {
  testing::run_ranks(world, [cuda](Distributed& d) {
    const torch::Device dev = device_of(cuda);
    fp32_on_gpu(cuda);
    const double tol = cuda ? kCudaTolerance : 1e-5;
    const int64_t C = 37, D = 8;
    PartialFCOptions o;
    o.num_classes = C;
    o.embedding_size = D;
    std::vector<at::Tensor> xs, ys;
    for (int q = 0; q < d.world_size(); ++q) {
      torch::manual_seed(900 + q);
      xs.push_back(torch::randn({rows_of(q) - (q % 2), 6}));  // equal per-rank batches
      ys.push_back(torch::randint(0, C, {xs.back().size(0)}, torch::kLong));
    }
    torch::manual_seed(5);
    torch::nn::Linear ref_backbone(6, D);
    torch::manual_seed(5);
    torch::nn::Linear backbone(6, D);
    // Reference: one process.
    Reference ref;
    {
      at::Tensor E = ref_backbone(torch::cat(xs));
      at::Tensor Wf = PartialFC::initial_rows(0, C, D, o.seed);
      at::Tensor cos = torch::mm(F::normalize(E, F::NormalizeFuncOptions().dim(1)),
                                 F::normalize(Wf, F::NormalizeFuncOptions().dim(1)).t());
      at::Tensor onehot = F::one_hot(torch::cat(ys), C).to(torch::kBool);
      at::Tensor t = (cos.clamp(-1 + 1e-7, 1 - 1e-7).acos() + 0.5).cos();
      F::cross_entropy(torch::where(onehot, t, cos) * 64.0, torch::cat(ys)).backward();
    }
    backbone->to(dev);
    DataParallel ddp(backbone.ptr(), d);
    PartialFC fc(d, o, dev);
    auto out = fc.forward(backbone(xs[d.rank()].to(dev)), ys[d.rank()]);
    ddp.prepare_for_backward({out.loss});
    out.loss.backward();
    ASSERT_EQ(backbone->weight.grad().device(), dev);
    EXPECT_LE(testing::relative_error(backbone->weight.grad().cpu(), ref_backbone->weight.grad()), tol);
    EXPECT_LE(testing::relative_error(backbone->bias.grad().cpu(), ref_backbone->bias.grad()), tol);
  });
}

TEST(PartialFCConvention, BackboneGradientThroughDdpEqualsOneProcess) {
  for (int W : {2, 3}) backbone_gradient_through_ddp(W, false);
}

TEST(PartialFCConventionGlooCuda, BackboneGradientThroughDdpEqualsOneProcess) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  backbone_gradient_through_ddp(2, true);
}

}  // namespace
}  // namespace faceshard
