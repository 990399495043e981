// The margin heads under everything Partial FC adds: W = 1..4 ranks with uneven shards and
// batches, sampling, gradient accumulation, resume. The reference is one process holding the
// whole batch and the whole weight matrix, written from each head's definition (the authors'
// code) with plain ops in float64 and autograd (tests/head_references.h);
// tests/e2e/heads_reference.py checks the single-process heads against the authors' code itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/record_function.h>
#ifdef FACESHARD_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "partial_fc/classifier/head_catalogue.h"
#include "partial_fc/classifier/heads/elasticface.h"
#include "partial_fc/classifier/margin_softmax.h"
#include "partial_fc/classifier/partial_fc.h"
#include "partial_fc/classifier/streamed_softmax.h"
#include "base/error.h"
#include "tests/classifier_batches.h"
#include "tests/harness.h"
#include "tests/head_references.h"

namespace faceshard {
namespace {

using testing::head_references;
using testing::HeadReference;
using testing::reference_elastic_draws;

// The catalogue keeps its tests: every registered head has a float64 reference here, and
// head_cases() runs each in the distributed equivalence below.
TEST(MarginHeads, EveryRegisteredHeadHasAFloat64Reference) {
  ASSERT_GE(head_catalogue().size(), 9u);
  for (const HeadInfo& h : head_catalogue())
    EXPECT_EQ(head_references().count(h.name), 1u) << "the " << h.name
                                                    << " head has no float64 reference in tests/head_references.h (a "
                                                       "function and its Reference line)";
  for (const auto& [name, fn] : head_references()) EXPECT_NE(find_head_info(name), nullptr) << name << " is no head";
  // Every head's published defaults are written in tests/head_references.h, one per parameter
  // of the catalogue (the combined head's come from loss.margin: m1, m2, m3 and s).
  for (const HeadInfo& h : head_catalogue()) {
    const auto it = testing::published_head_defaults().find(h.name);
    ASSERT_NE(it, testing::published_head_defaults().end()) << "no published defaults for " << h.name;
    if (h.params.empty()) continue;
    std::set<std::string> names;
    for (const HeadParam& p : h.params) names.insert(p.name);
    std::set<std::string> written;
    for (const auto& kv : it->second) written.insert(kv.first);
    EXPECT_EQ(names, written) << h.name;
  }
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
    HeadReference ref;
    ref.head = hc.head;
    ref.params = testing::reference_params(hc.head, o.head.params);  // the published defaults, not the catalogue's
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
// They are the definition's numbers (the float64 scalar reference of tests/head_references.h,
// to one fp32 ulp: its log and cos are the C library's), fp32 on the device asked for.
TEST(ElasticFaceDraws, SeededByRunAndForward) {
  const at::Tensor a = elasticface_draws(64, 0.5, 0.05, 7, 3), b = elasticface_draws(64, 0.5, 0.05, 7, 3);
  EXPECT_EQ(a.scalar_type(), at::kFloat);
  EXPECT_TRUE(a.device().is_cpu());
  EXPECT_EQ(a.sizes(), at::IntArrayRef({64}));
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_FALSE(torch::equal(a, elasticface_draws(64, 0.5, 0.05, 7, 4)));
  EXPECT_FALSE(torch::equal(a, elasticface_draws(64, 0.5, 0.05, 8, 3)));
  EXPECT_FALSE(torch::equal(a, elasticface_draws(64, 0.5, 0.05, 7 + (uint64_t(1) << 32), 3))) << "the seed's high half";
  EXPECT_FALSE(torch::equal(a, elasticface_draws(64, 0.5, 0.05, 7, 3 + (int64_t(1) << 32)))) << "the count's high half";
  // The first rows do not depend on how many are drawn (counters, not a stream's length).
  EXPECT_TRUE(torch::equal(a.narrow(0, 0, 16), elasticface_draws(16, 0.5, 0.05, 7, 3)));
  EXPECT_TRUE(torch::equal(elasticface_draws(5, 0.35, 0.0, 7, 0), torch::full({5}, 0.35f)));
  EXPECT_EQ(elasticface_draws(0, 0.5, 0.05, 7, 0).numel(), 0);
  for (const auto& [n, fwd] : std::vector<std::pair<int64_t, int64_t>>{{64, 3}, {1000, 0}, {333, 123456789}}) {
    const at::Tensor got = elasticface_draws(n, 0.5, 0.05, 2048, fwd).to(at::kDouble);
    const at::Tensor want = reference_elastic_draws(n, 0.5, 0.05, 2048, fwd);
    EXPECT_LE((got - want).abs().max().item<double>(), std::ldexp(1.0, -24)) << "forward " << fwd;
  }
}

// On a GPU the draws are made there, without a host synchronisation (LibTorch's sync debug
// mode as an error), and they are the CPU's numbers: fp32 from the same integers through
// float64 Box-Muller, so equal but where the two float64 libraries' last bits round an fp32
// the other way (at most one fp32 ulp, in about one value in 10^8).
TEST(ElasticFaceDrawsCuda, SameAsTheCpuWithoutHostSync) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
#ifdef FACESHARD_WITH_CUDA
  const torch::Device cuda(torch::kCUDA, 0);
  for (const int64_t forward : {int64_t(0), int64_t(5), int64_t(1) << 33}) {
    const at::Tensor cpu = elasticface_draws(100000, 0.5, 0.05, 11, forward);
    (void)elasticface_draws(8, 0.5, 0.05, 11, forward, cuda);  // the kernels' first load
    c10::cuda::device_synchronize();
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
    at::Tensor gpu;
    try {
      gpu = elasticface_draws(100000, 0.5, 0.05, 11, forward, cuda);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "the draws synchronised with the device: " << e.what();
    }
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    ASSERT_TRUE(gpu.defined());
    EXPECT_TRUE(gpu.is_cuda());
    EXPECT_EQ(gpu.scalar_type(), at::kFloat);
    const at::Tensor g = gpu.cpu();
    EXPECT_LE((g.to(at::kDouble) - cpu.to(at::kDouble)).abs().max().item<double>(), std::ldexp(1.0, -24));
    EXPECT_GE((g == cpu).to(at::kDouble).mean().item<double>(), 0.9999) << "forward " << forward;
  }
#endif
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
// --- what would make a GPU step wait for, or copy from, the host ---------------------------

// On the CPU nothing waits, but the operators that would are seen: every operator call passes
// LibTorch's RecordFunction hooks, which name it and its overload. Flagged: a tensor read on
// the host (item()) and a conversion that can name a device (.to(device), .to(other), .cpu(),
// torch::tensor(values, options): a tensor made on one side and moved to the other, on a GPU a
// pageable copy that waits; .to(dtype) is none) where the code under test calls them, not
// inside another operator (the CPU's std() reads its mean on the host, CUDA's does not); and,
// at any depth, operators whose output size depends on the values (nonzero, masked_select,
// unique: on a GPU the host waits for the size).
class HostTransferWatch {
 public:
  HostTransferWatch() {
    clear();
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end).scopes({at::RecordScope::FUNCTION}));
  }
  ~HostTransferWatch() { at::removeCallback(handle_); }
  HostTransferWatch(const HostTransferWatch&) = delete;
  HostTransferWatch& operator=(const HostTransferWatch&) = delete;
  // What was flagged since the last call, one line each.
  std::vector<std::string> take() {
    std::lock_guard<std::mutex> lock(mutex());
    return std::exchange(flagged(), {});
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::vector<std::string>& flagged() {
    static std::vector<std::string> f;
    return f;
  }
  static int& depth() {  // operators open on this thread
    thread_local int d = 0;
    return d;
  }
  static void clear() {
    std::lock_guard<std::mutex> lock(mutex());
    flagged().clear();
  }
  // Tensor::backward and the autograd engine's run of each backward function are ranges of
  // their own: what a backward function calls counts as called by the code under test.
  static bool transparent(const at::RecordFunction& fn) {
    const std::string name = fn.name();
    return name == "aten::_backward" || name.rfind("autograd::engine::", 0) == 0;
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    if (transparent(fn)) return nullptr;
    const bool called_by_us = depth()++ == 0;
    const std::string name = fn.name();
    std::string why;
    if (name == "aten::nonzero" || name == "aten::masked_select" || name == "aten::_unique" || name == "aten::_unique2" ||
        name == "aten::unique_dim" || name == "aten::unique_consecutive" || name == "aten::is_nonzero" ||
        name == "aten::equal")
      why = "an output that depends on the values";
    if (called_by_us && (name == "aten::item" || name == "aten::_local_scalar_dense"))
      why = "a host read of a tensor (item)";
    // aten::to's overloads that can name a device (to.dtype names a dtype alone).
    if (called_by_us && name == "aten::to") {
      const std::string overload = fn.overload_name();
      if (overload != "dtype") why = "a conversion that can name a device (to." + overload + ")";
    }
    if (!why.empty()) {
      std::lock_guard<std::mutex> lock(mutex());
      flagged().push_back(name + ": " + why);
    }
    return nullptr;
  }
  static void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
    if (!transparent(fn)) --depth();
  }
  at::CallbackHandle handle_ = 0;
};

// The watch sees what it is for (or the test below would pass by seeing nothing).
TEST(HostWatch, SeesHostReadsDeviceConversionsAndValueSizedOutputs) {
  const at::Tensor x = torch::arange(6, torch::kFloat);
  HostTransferWatch watch;
  (void)(x * 2);
  (void)x.to(at::kDouble);  // a dtype alone: no device named
  (void)x.std();            // reads its mean on the host inside, on the CPU only
  EXPECT_TRUE(watch.take().empty());
  (void)torch::tensor({0, 2, 4, 6}, x.options());
  EXPECT_EQ(watch.take().size(), 1u) << "torch::tensor(values, options)";
  (void)x.to(x.device());
  EXPECT_EQ(watch.take().size(), 1u) << ".to(device)";
  (void)x.sum().item<float>();
  EXPECT_EQ(watch.take().size(), 1u) << "item()";
  (void)(x > 2).nonzero();
  EXPECT_EQ(watch.take().size(), 1u) << "nonzero()";
  // Inside a backward function, called from Tensor::backward (an operator itself).
  struct HostMadeInBackward : public torch::autograd::Function<HostMadeInBackward> {
    static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& v) { return v * 2; }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
      return {g[0] * torch::tensor({2.0f}, g[0].options())};
    }
  };
  const at::Tensor leaf = torch::ones({3}).requires_grad_();
  HostMadeInBackward::apply(leaf).sum().backward();
  EXPECT_EQ(watch.take().size(), 1u) << "torch::tensor(values, options) in a backward";
}

// SphereFace's annealing resumed from a saved forward count: loaded at 1657 forwards, the next
// three forwards' lambda (5.0013, then lambda_min 5 twice: base (1 + gamma 1659)^-1 = 4.998)
// crosses the floor, on 2 ranks, against the float64 reference resumed at the same count;
// the count goes on to 1660 on every rank. A count that restarted at 0 (lambda 893) or a floor
// that is not applied moves the loss by far more than the tolerance.
TEST(MarginHeads, SphereFaceAnnealingResumesFromItsForwardCount) {
  testing::run_ranks(2, [](Distributed& d) {
    const int64_t C = 301, D = 16;
    PartialFCOptions o;
    o.num_classes = C;
    o.embedding_size = D;
    o.head.name = "sphereface";
    o.optimizer = ShardOptimizerOptions{"sgd", 0.9, 0.0};
    const at::Tensor full = PartialFC::initial_rows(0, C, D, o.seed);
    PartialFC fc(d, o);
    fc.head().load_state("iteration", torch::full({1}, 1657.0, torch::kFloat), "test");
    HeadReference ref;
    ref.head = "sphereface";
    ref.params = testing::reference_params("sphereface", {});
    ref.state.iteration = 1657;
    for (int k = 0; k < 3; ++k) {
      Batch b = make_batch(d.world_size(), d.rank(), C, D, full, 40 + k);
      at::Tensor emb = b.emb.narrow(0, b.offset, b.rows).clone().requires_grad_();
      auto out = fc.forward(emb, b.labels.narrow(0, b.offset, b.rows));
      out.loss.backward();
      at::Tensor E = b.emb.to(torch::kDouble).requires_grad_();
      at::Tensor Wt = full.to(torch::kDouble).requires_grad_();
      at::Tensor rl = ref.loss(E, Wt, b.labels, at::Tensor());
      rl.backward();
      const std::string at = "forward " + std::to_string(1658 + k);
      EXPECT_LE(testing::relative_error(out.loss, rl.to(torch::kFloat)), 1e-5) << at;
      EXPECT_LE(testing::relative_error(emb.grad(), (E.grad().narrow(0, b.offset, b.rows) * d.world_size()).to(torch::kFloat)),
                5e-5)
          << at;
      EXPECT_LE(testing::relative_error(fc.gradient(), Wt.grad().narrow(0, fc.shard().start, fc.shard().count).to(torch::kFloat)),
                5e-5)
          << at;
      fc.zero_grad();
      ASSERT_EQ(fc.head().state().size(), 1u);
      EXPECT_EQ(fc.head().state()[0].second.item<double>(), 1658.0 + k) << at;
    }
  });
  // Not a key of the head: named.
  auto head = make_margin_head(HeadSpec{"sphereface", {}}, CombinedMargin{});
  EXPECT_THROW(head->load_state("t", torch::zeros({1}), "test"), Error);
}

// Every head of the catalogue (with its default parameters, and with each yes/no parameter
// turned over: ElasticFace+, MagFace's margin everywhere), through both logits modes, every
// column or sampled ones, with and without a deferred weight gradient, over two forwards (the
// heads' state starts and moves on), forward, backward and the deferred gradient's rows: no
// host read, no value-sized output and no conversion to a device. On a GPU each of those
// would be a host synchronisation or a copy of a host-made tensor in every step; the same
// calls run there under LibTorch's sync debug mode (TrainStepCuda, PartialFCCuda).
TEST(MarginHeads, NoHostReadOrHostMadeTensorInAnyHeadOrLogitsMode) {
  auto dist = Distributed::init(DistEnv{});
  const int64_t N = 10, S = 21, D = 8;  // 27 or 21 columns: chunks of 8, the last one short
  for (const HeadInfo& info : head_catalogue()) {
    std::vector<std::map<std::string, double>> settings{{}};
    std::map<std::string, double> flipped;
    for (const HeadParam& p : info.params)
      if (p.flag) flipped[p.name] = p.default_value != 0 ? 0.0 : 1.0;
    if (!flipped.empty()) settings.push_back(flipped);
    for (const auto& params : settings)
      for (const bool streamed : {false, true})
        for (const bool sampled : {false, true})
          for (const bool deferred : {false, true}) {
            if (sampled && !deferred) continue;  // sampled columns need a deferred gradient
            SCOPED_TRACE(info.name + (params.empty() ? "" : " (flags turned over)") +
                         (streamed ? ", streamed" : ", buffered") + (sampled ? ", sampled" : "") +
                         (deferred ? ", deferred" : ""));
            const std::unique_ptr<MarginHead> head = make_margin_head(HeadSpec{info.name, params}, CombinedMargin{});
            torch::manual_seed(5);
            const at::Tensor weight = torch::randn({S + 6, D});
            HostTransferWatch watch;
            for (int64_t forward = 0; forward < 2; ++forward) {
              // Rows lean towards their class (margins active) with norms from 2 to 60; rows 0
              // and 5 belong to another rank's classes.
              at::Tensor raw = torch::randn({N, D}, torch::kFloat);
              const at::Tensor target = torch::randint(0, S, {N}, torch::kLong).index_fill_(0, torch::arange(0, N, 5), -1);
              MarginSoftmaxOptions o;
              o.head = head.get();
              o.seed = 2048;
              o.forward = forward;
              o.chunk_classes = 8;
              if (sampled) o.rows = torch::arange(3, 3 + S, torch::kLong);  // sorted rows of the 27
              if (deferred) o.deferred = std::make_shared<DeferredWeightGrad>();
              raw = raw + 3 * weight.index_select(0, sampled ? o.rows.index_select(0, target.clamp_min(0)) : target.clamp_min(0));
              raw = (raw / raw.norm(2, {1}, true) * (torch::rand({N, 1}) * 58 + 2)).requires_grad_();
              const at::Tensor emb = raw / raw.norm(2, {1}, true);
              const at::Tensor norms = head->needs_norms() ? raw.norm(2, {1}) : at::Tensor();
              const at::Tensor w = weight.clone().requires_grad_(!deferred);
              at::Tensor acc;
              at::Tensor loss = streamed ? streamed_margin_softmax_loss(emb, w, target, norms, o, *dist, &acc)
                                         : margin_softmax_loss(emb, w, target, norms, o, *dist, &acc);
              if (at::Tensor extra = head->extra_loss(norms); extra.defined()) loss = loss + extra;
              loss.backward();
              if (deferred) {
                const int64_t n = sampled ? o.rows.size(0) : w.size(0);
                const at::Tensor cols = sampled ? weight.index_select(0, o.rows) : weight;
                ASSERT_TRUE(o.deferred->ready());
                const at::Tensor gw = o.deferred->rows(0, n, cols);
                EXPECT_EQ(gw.sizes(), cols.sizes());
              } else {
                EXPECT_TRUE(w.grad().defined());
              }
              EXPECT_TRUE(raw.grad().defined());
              for (const std::string& f : watch.take()) ADD_FAILURE() << "forward " << forward << ": " << f;
              // The numbers themselves (read outside the watch) are the equivalence tests' business.
              EXPECT_TRUE(std::isfinite(loss.item<double>()));
              (void)watch.take();
            }
          }
  }
}

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
