// Sub-centre classes (loss.subcenters K, Sub-center ArcFace): every head of the catalogue with
// K = 3 centres per class on W = 1..4 ranks, with and without sampling, in both logits modes
// and with bf16 centres, against one process holding the whole batch and the whole
// [C x K, d] matrix. The reference is the paper's formula in float64 with plain ops, as
// insightface's MXNet code computes it (fc7 of the normalised embedding against the
// normalised C x K rows, reshaped to (batch, C, K), max over K), then the head's own float64
// reference (tests/head_references.h) on those class cosines; autograd of max gives the
// reference gradients (to the arg-max sub-centre only). Also: the layout of the rows
// (class-major, the same initial rows on any number of ranks), checkpoints resharded K rows
// per class and refused with another K, the memory plan and the config key.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "app/config/config.h"
#include "app/io/checkpoint.h"
#include "app/io/resharded_rows.h"
#include "app/train/train_job.h"
#include "app/train/train_state.h"
#include "models/torch_save/state_dict_io.h"
#include "partial_fc/classifier/class_shard.h"
#include "partial_fc/classifier/head_catalogue.h"
#include "partial_fc/classifier/partial_fc.h"
#include "partial_fc/distributed/dist_env.h"
#include "base/error.h"
#include "tests/classifier_batches.h"
#include "tests/harness.h"
#include "tests/head_references.h"
#include "tests/test_errors.h"

namespace faceshard {
namespace {

using testing::error_of;
constexpr int64_t kK = 3;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The paper's class cosine: max over the class's K sub-centres of cos(x, W_ck), the K rows of
// class c at c * K .. c * K + K - 1 (insightface: reshape (batch, C, K), max over K), then the
// head's logits and the softmax cross-entropy over the classes taking part.
struct SubcenterReference {
  std::string head;
  std::map<std::string, double> params;
  testing::RefState state;
  uint64_t seed = 0;
  int64_t forward = 0;

  at::Tensor loss(const at::Tensor& raw, const at::Tensor& rows, const at::Tensor& labels, const at::Tensor& classes,
                  int64_t K) {
    namespace F = torch::nn::functional;
    const int64_t N = raw.size(0), C = rows.size(0) / K;
    testing::RefInput in;
    in.norms = raw.norm(2, {1}, true);
    const at::Tensor x = raw / in.norms;
    const at::Tensor w = rows / rows.norm(2, {1}, true);
    const at::Tensor fc7 = torch::mm(x, w.t()).reshape({N, C, K});
    at::Tensor cos = std::get<0>(fc7.max(2));  // [N, C]
    at::Tensor y = labels;
    if (classes.defined()) {
      cos = cos.index_select(1, classes);
      y = torch::searchsorted(classes, labels);
    }
    in.cos = cos;
    in.onehot = F::one_hot(y, cos.size(1)).to(torch::kDouble);
    in.y = y.unsqueeze(1);
    in.p = params;
    in.seed = seed;
    in.forward = forward++;
    const testing::RefOutput out = testing::head_references().at(head)(in, state);
    const at::Tensor l = F::cross_entropy(out.logits, y);
    return out.extra.defined() ? l + out.extra : l;
  }
};

struct SubcenterCase {
  std::string head;
  int world;
  bool sampled;
  bool streamed;
  bool bf16 = false;
  // Every row's target sub-centres at cosines 0.05, -0.3 and -0.5: MagFace's easy margin
  // makes its target non-monotone at 0 (cos(theta + m) above, cos below), so the margin of
  // the best cosine (-0.43 or so) differs from the best of the margins (-0.3): the order
  // of max and margin shows.
  bool straddle = false;
};

class SubcentersDistributed : public ::testing::TestWithParam<SubcenterCase> {};

int64_t rows_of(int r) { return 4 + (r % 2); }

TEST_P(SubcentersDistributed, EqualOneProcessWithTheWholeBatchAndEveryRowOfEveryClass) {
  const SubcenterCase sc = GetParam();
  testing::run_ranks(sc.world, [sc](Distributed& d) {
    const int64_t C = 211, D = 16, K = kK;
    PartialFCOptions o;
    o.num_classes = C;
    o.embedding_size = D;
    o.subcenters = K;
    o.head.name = sc.head;
    const HeadInfo* info = find_head_info(sc.head);
    ASSERT_NE(info, nullptr) << sc.head;
    for (const HeadParam& p : info->params)
      if (p.name == "plus") o.head.params["plus"] = 1;
    o.sample_rate = sc.sampled ? 0.3 : 1.0;
    o.optimizer = ShardOptimizerOptions{"sgd", 0.9, 0.0};  // first step: w - lr * g
    o.streamed_logits = sc.streamed;
    // Chunks that are no multiple of K: a chunk of rows ends inside a class.
    o.update_chunk_rows = 70;
    if (sc.bf16) o.weight_dtype = at::kBFloat16;
    PartialFC fc(d, o);
    // The global matrix: row c * K + k is class c's sub-centre k, drawn by the global row.
    at::Tensor full = PartialFC::initial_rows(0, C * K, D, o.seed);
    if (sc.bf16) full = full.to(at::kBFloat16).to(at::kFloat);  // the stored centres
    const int64_t s0 = fc.shard().start, n0 = fc.shard().count;
    ASSERT_EQ(fc.weight().size(0), n0 * K);
    ASSERT_TRUE(torch::equal(fc.weight().to(at::kFloat), full.narrow(0, s0 * K, n0 * K)))
        << "a shard's rows are the global rows of its classes, class-major";

    // The batch leans towards one sub-centre of its class (varied per row), so that the
    // arg-max differs between rows of a class and between rows.
    testing::ClassBatch b = testing::class_batch(d.world_size(), d.rank(), C, D, full.narrow(0, 0, C), 977, rows_of, -0.6, 2.2);
    {
      namespace F = torch::nn::functional;
      torch::manual_seed(4242);
      const at::Tensor k = torch::randint(0, K, {b.labels.size(0)}, torch::kLong);
      const at::Tensor lean = torch::rand({b.labels.size(0), 1}) * 2.2 - 0.6;
      const at::Tensor wy = F::normalize(full.index_select(0, b.labels * K + k), F::NormalizeFuncOptions().dim(1));
      const at::Tensor norms = b.emb.norm(2, {1}, true);
      b.emb = F::normalize(F::normalize(b.emb, F::NormalizeFuncOptions().dim(1)) + lean * wy,
                           F::NormalizeFuncOptions().dim(1)) * norms;
    }
    if (sc.straddle) {
      namespace F = torch::nn::functional;
      const at::Tensor want = torch::tensor({0.05, -0.3, -0.5}, torch::kDouble);
      for (int64_t i = 0; i < b.labels.size(0); ++i) {
        const int64_t y = b.labels[i].item<int64_t>();
        const at::Tensor A = F::normalize(full.narrow(0, y * K, K).to(torch::kDouble), F::NormalizeFuncOptions().dim(1));
        const at::Tensor P = torch::linalg_pinv(A);  // [D, K]
        const at::Tensor x = torch::mv(P, want);
        at::Tensor r = torch::randn({D}, torch::kDouble);
        r = r - torch::mv(P, torch::mv(A, r));  // orthogonal to the K sub-centres
        const double fill = std::sqrt(1 - x.dot(x).item<double>());
        b.emb[i].copy_(((x + r * (fill / r.norm().item<double>())) * 60).to(torch::kFloat));
      }
    }
    at::Tensor emb = b.emb.narrow(0, b.offset, b.rows).clone().requires_grad_();
    auto out = fc.forward(emb, b.labels.narrow(0, b.offset, b.rows));
    out.loss.backward();

    // The classes every rank used: each sampled class brings its K rows, in order.
    at::Tensor classes;
    if (fc.samples()) {
      const at::Tensor rows = fc.sampled_index().cpu();
      ASSERT_EQ(rows.size(0) % K, 0);
      const at::Tensor mine = rows.reshape({-1, K}).select(1, 0).div(K, "floor");
      ASSERT_TRUE(torch::equal(rows, (mine.unsqueeze(1) * K + torch::arange(K).unsqueeze(0)).reshape({-1})))
          << "a sampled class brings all its sub-centres";
      classes = std::get<0>(torch::sort(d.all_gather(mine + s0)));
    }
    SubcenterReference ref;
    ref.head = sc.head;
    ref.params = testing::reference_params(sc.head, o.head.params);
    ref.seed = o.seed;
    at::Tensor E = b.emb.to(torch::kDouble).requires_grad_();
    at::Tensor Wt = full.to(torch::kDouble).requires_grad_();
    at::Tensor rl = ref.loss(E, Wt, b.labels, classes, K);
    rl.backward();
    EXPECT_LE(testing::relative_error(out.loss, rl.to(torch::kFloat)), 1e-5);
    EXPECT_LE(testing::relative_error(emb.grad(), (E.grad().narrow(0, b.offset, b.rows) * d.world_size()).to(torch::kFloat)),
              5e-5);
    const at::Tensor wg = Wt.grad();
    const at::Tensor mine =
        fc.samples() ? wg.index_select(0, fc.sampled_index().cpu() + s0 * K) : wg.narrow(0, s0 * K, n0 * K);
    const at::Tensor g = fc.gradient();
    EXPECT_LE(testing::relative_error(g, mine.to(torch::kFloat)), 5e-5);
    // The max routes each class's gradient to one sub-centre: rows that no row's arg-max
    // picked get exactly nothing, as in the reference.
    EXPECT_TRUE(torch::equal(g.abs().sum(1) == 0, mine.abs().sum(1) == 0));

    // The step moves K rows per class as it would single centres.
    const double lr = 0.1;
    const at::Tensor index = fc.samples() ? fc.sampled_index().cpu() : at::Tensor();
    fc.step(lr);
    at::Tensor want = full.narrow(0, s0 * K, n0 * K).clone();
    const at::Tensor moved = want.index_select(0, fc.samples() ? index : torch::arange(n0 * K)) - lr * mine.to(at::kFloat);
    want.index_copy_(0, fc.samples() ? index : torch::arange(n0 * K), moved);
    EXPECT_LE(testing::relative_error(fc.weight().to(at::kFloat), want), sc.bf16 ? 1e-2 : 1e-5);
  });
}

// Every head of the catalogue at W = 1..4: without sampling on 1 and 3 ranks, sampled on 2
// and 4, streamed logits on 3 (full) and 4 (sampled); bf16 centres for the default head.
std::vector<SubcenterCase> subcenter_cases() {
  std::vector<SubcenterCase> out;
  for (const HeadInfo& h : head_catalogue()) {
    out.push_back({h.name, 1, false, false});
    out.push_back({h.name, 2, true, false});
    out.push_back({h.name, 3, false, true});
    out.push_back({h.name, 4, true, false});
    out.push_back({h.name, 4, true, true});
  }
  out.push_back({"combined", 2, true, false, true});
  out.push_back({"combined", 3, false, true, true});
  out.push_back({"magface", 2, false, false, false, true});
  out.push_back({"magface", 3, true, true, false, true});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Heads, SubcentersDistributed, ::testing::ValuesIn(subcenter_cases()), [](const auto& info) {
  const SubcenterCase& c = info.param;
  return c.head + "_W" + std::to_string(c.world) + (c.sampled ? "_sampled" : "_full") + (c.streamed ? "_streamed" : "") +
         (c.bf16 ? "_bf16" : "") + (c.straddle ? "_straddle" : "");
});

// A class's K rows are one run of the global matrix (row c * K + k), whatever the ranks: a
// checkpoint saved on W ranks reads back on any other number, K rows per class, and one saved
// with another K (or read as one centre per class) is refused naming both.
TEST(Subcenters, CheckpointRowsReshardKPerClassAndRefuseAnotherK) {
  const std::string dir = testing::temp_dir("subcenters_ckpt");
  const int64_t C = 23, K = kK, D = 5;
  const at::Tensor weight = torch::randn({C * K, D}), momentum = torch::randn({C * K, D});
  const int saved_w = 3;
  std::filesystem::create_directories(dir + "/ck");
  for (const ClassShard& s : ClassShard::all(C, saved_w))
    write_state_dict({{"rows.start", torch::tensor({s.start})},
                      {"rows.count", torch::tensor({s.count})},
                      {"rows.subcenters", torch::tensor({K})},
                      {"rows/weight", weight.narrow(0, s.start * K, s.count * K)},
                      {"rows/opt.momentum", momentum.narrow(0, s.start * K, s.count * K)}},
                     dir + "/ck/fc_shard_" + std::to_string(s.rank) + ".pt");
  testing::write_text(dir + "/ck/COMMITTED", "step 3\nworld_size 3\nnum_classes 23\n");
  const CheckpointInfo info = read_checkpoint_info(dir + "/ck");
  for (int W : {1, 2, 4}) {
    for (const ClassShard& s : ClassShard::all(C, W)) {
      SCOPED_TRACE("rank " + std::to_string(s.rank) + " of " + std::to_string(W));
      const ReshardedRows rows(info, s.start, s.count, K);
      EXPECT_EQ(rows.subcenters(), K);
      at::Tensor w = at::empty({s.count * K, D}), m = at::empty({s.count * K, D});
      rows.read_into("weight", w);
      rows.read_into("opt.momentum", m);
      EXPECT_TRUE(torch::equal(w, weight.narrow(0, s.start * K, s.count * K)));
      EXPECT_TRUE(torch::equal(m, momentum.narrow(0, s.start * K, s.count * K)));
    }
  }
  EXPECT_EQ(ReshardedRows(info, 0, C, 0).subcenters(), K) << "0 takes the saved K";
  std::string msg = error_of([&] { ReshardedRows(info, 0, C, 1); });
  EXPECT_TRUE(contains(msg, "saved with loss.subcenters 3") && contains(msg, "this run has 1")) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  msg = error_of([&] { ReshardedRows(info, 0, C, 5); });
  EXPECT_TRUE(contains(msg, "saved with loss.subcenters 3") && contains(msg, "this run has 5")) << msg;
  // A file whose rows are not K per class is named.
  write_state_dict({{"rows.start", torch::tensor({int64_t{8}})},
                    {"rows.count", torch::tensor({int64_t{8}})},
                    {"rows.subcenters", torch::tensor({K})},
                    {"rows/weight", weight.narrow(0, 8, 8)},
                    {"rows/opt.momentum", momentum.narrow(0, 8, 8)}},
                   dir + "/ck/fc_shard_1.pt");
  msg = error_of([&] { ReshardedRows(info, 0, C, K); });
  EXPECT_TRUE(contains(msg, "fc_shard_1.pt") && contains(msg, "expected 24 (8 classes x 3 sub-centres)")) << msg;
}

// A training run's checkpoint records K ("rows.subcenters" in each fc_shard_<r>.pt, beside
// rows/* of rows.count x K rows); the same K resumes the centres exactly, another K stops
// with one line naming loss.subcenters.
TEST(Subcenters, TrainingCheckpointRecordsKAndAResumeWithAnotherKIsAnError) {
  const std::string dir = testing::temp_dir("subcenters_resume");
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  auto config = [&](int64_t K) {
    return load_config_text("output: " + dir + "/out\n" + R"(data: {rec: synthetic, num_classes: 10, batch_size: 4, num_workers: 1}
model: {backbone: mbf, embedding_size: 8}
train: {verify_every: 0, tensorboard: false}
dist: {device: cpu}
loss: {subcenters: )" + std::to_string(K) + "}\n", "job.yaml");
  };
  at::Tensor saved;
  {
    TrainJob job = build_train_job(config(3), dist);
    ASSERT_EQ(job.fc->weight().size(0), 30);
    saved = job.fc->weight().clone();
    TrainState state(job);
    state.progress().step = 2;
    CheckpointManager checkpoints(dir + "/ck", *dist, 100);
    ASSERT_TRUE(state.save(checkpoints));
  }
  const std::string ck = dir + "/ck/step_00000002";
  bool recorded = false;
  for (const auto& kv : read_state_dict(ck + "/fc_shard_0.pt")) {
    if (kv.first == "rows.subcenters") recorded = kv.second.item<int64_t>() == 3;
    if (kv.first.rfind("rows/", 0) == 0) EXPECT_EQ(kv.second.size(0), 30) << kv.first;
  }
  EXPECT_TRUE(recorded) << "fc_shard_0.pt records rows.subcenters 3";
  {
    TrainJob j = build_train_job(config(3), dist, ClassifierStart::FromCheckpoint);
    TrainState(j).load(ck);
    EXPECT_TRUE(torch::equal(j.fc->weight(), saved));
  }
  for (int64_t K : {1, 2}) {
    const std::string msg = error_of([&] {
      TrainJob j = build_train_job(config(K), dist, ClassifierStart::FromCheckpoint);
      TrainState(j).load(ck);
    });
    EXPECT_TRUE(contains(msg, "saved with loss.subcenters 3") && contains(msg, "this run has " + std::to_string(K)))
        << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// The shard's rows are drawn by global row: the same sub-centre gets the same initial value
// on any number of ranks, and a shard holds its classes' K rows each.
TEST(Subcenters, InitialRowsAreTheGlobalRowsOfTheShardsClasses) {
  for (int W : {2, 3}) {
    testing::run_ranks(W, [](Distributed& d) {
      PartialFCOptions o;
      o.num_classes = 17;
      o.embedding_size = 8;
      o.subcenters = 4;
      PartialFC fc(d, o);
      const at::Tensor full = PartialFC::initial_rows(0, 17 * 4, 8, o.seed);
      EXPECT_TRUE(torch::equal(fc.weight(), full.narrow(0, fc.shard().start * 4, fc.shard().count * 4)));
      for (const auto& kv : fc.state()) EXPECT_EQ(kv.second.size(0), fc.shard().count * 4) << kv.first;
    });
  }
}

// K x the per-class bytes of the centres and their state; the logits stay per class (a
// byte more each for the arg-max sub-centre), the streamed pass keeps 1 / ||w|| per row.
TEST(Subcenters, MemoryPlanCountsKRowsPerClass) {
  PartialFCOptions o;
  o.num_classes = 100000;
  o.embedding_size = 512;
  o.sample_rate = 0.5;
  o.optimizer = ShardOptimizerOptions{"sgd", 0.9, 0.0};
  const ClassifierMemoryPlan one = classifier_memory_plan(o, 4, 0, 128, true);
  o.subcenters = 3;
  const ClassifierMemoryPlan three = classifier_memory_plan(o, 4, 0, 128, true);
  EXPECT_EQ(three.rows, one.rows);
  EXPECT_DOUBLE_EQ(three.weight_bytes, 25000.0 * 3 * 512 * 4);
  EXPECT_DOUBLE_EQ(three.state_bytes, 3 * one.state_bytes);
  EXPECT_DOUBLE_EQ(three.logits_bytes, one.logits_bytes / 4 * 5);
  o.streamed_logits = true;
  EXPECT_DOUBLE_EQ(classifier_memory_plan(o, 4, 0, 128, true).logits_bytes, 12500.0 * 3 * 4);
}

TEST(Subcenters, ConfigKeyIsValidatedAndReachesTheClassifier) {
  const Config cfg = load_config_text("data:\n  num_classes: 10\nloss:\n  subcenters: 3\n", "t.yaml");
  EXPECT_EQ(cfg.loss.subcenters, 3);
  EXPECT_EQ(load_config_text("data:\n  num_classes: 10\n", "t.yaml").loss.subcenters, 1);
  for (const char* bad : {"0", "-2", "256", "2.5", "many"}) {
    const std::string msg =
        error_of([&] { load_config_text(std::string("data:\n  num_classes: 10\nloss:\n  subcenters: ") + bad + "\n", "t.yaml"); });
    EXPECT_TRUE(contains(msg, "loss.subcenters")) << bad << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  PartialFCOptions o;
  o.num_classes = 10;
  o.subcenters = 0;
  testing::run_ranks(1, [o](Distributed& d) {
    const std::string msg = error_of([&] { PartialFC fc(d, o); });
    EXPECT_TRUE(contains(msg, "subcenters") && contains(msg, "got 0")) << msg;
  });
}

}  // namespace
}  // namespace faceshard
