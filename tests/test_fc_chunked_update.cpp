// The classifier's chunked step (issue #26): the weight gradient is never materialised by
// the step, which computes dW a chunk of rows at a time from the logits buffer (G') and the
// embeddings and applies the optimiser to that chunk. Checked against a reference written
// here with plain ops in float64 (autograd of the CosFace loss over the step's columns for
// dW, the optimiser's formulas by hand): several chunk sizes (one of them not dividing the
// rows), SGD and AdamW, with and without sampling, an fp32 and a bf16 optimiser state,
// loss scaling (a finite scale is unscaled exactly; a non-finite gradient is flagged before
// anything moves), and a checkpoint's state dtype converted on resume.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "app/config/config.h"
#include "app/io/checkpoint.h"
#include "app/io/resharded_rows.h"
#include "app/train/train_job.h"
#include "app/train/train_state.h"
#include "models/torch_save/state_dict_io.h"
#include "partial_fc/classifier/partial_fc.h"
#include "partial_fc/distributed/dist_env.h"
#include "base/error.h"
#include "tests/harness.h"
#include "tests/test_errors.h"

namespace faceshard {
namespace {

constexpr double kScale = 30.0, kMargin = 0.4;  // CosFace: logit s * (cos - m) at the target

// dL/dW of the rows `cols` (sorted global classes, every label among them) for the mean
// CosFace loss of the batch over those columns, in float64 with autograd.
at::Tensor reference_grad(const at::Tensor& emb, const at::Tensor& W, const at::Tensor& labels, const at::Tensor& cols) {
  at::Tensor e = emb.to(at::kDouble);
  e = e / e.norm(2, {1}, true);
  at::Tensor wc = W.index_select(0, cols).to(at::kDouble).requires_grad_(true);
  at::Tensor cos = torch::mm(e, (wc / wc.norm(2, {1}, true)).t());
  at::Tensor onehot = (cols.unsqueeze(0) == labels.unsqueeze(1)).to(at::kDouble);
  at::Tensor logits = kScale * (cos - kMargin * onehot);
  at::Tensor loss = -(torch::log_softmax(logits, 1) * onehot).sum(1).mean();
  loss.backward();
  return wc.grad();
}

struct Case {
  std::string optimizer;
  double sample_rate;
  at::ScalarType state_dtype;
  int64_t chunk;
  bool fused = true;  // SGD on the CPU: the one-pass update (false: the generic path a GPU takes)
};

std::string name_of(const Case& c) {
  return c.optimizer + " rate " + std::to_string(c.sample_rate) + " state " + c10::toString(c.state_dtype) +
         " chunk " + std::to_string(c.chunk) + (c.fused ? "" : " generic");
}

PartialFCOptions options_of(const Case& c, int64_t C, int64_t D) {
  PartialFCOptions o;
  o.num_classes = C;
  o.embedding_size = D;
  o.sample_rate = c.sample_rate;
  o.margin = CombinedMargin{1.0, 0.0, kMargin, kScale};
  o.optimizer.kind = c.optimizer;
  o.optimizer.momentum = 0.9;
  o.optimizer.weight_decay = 5e-4;
  o.optimizer.state_dtype = c.state_dtype;
  o.update_chunk_rows = c.chunk;
  o.optimizer.fused_cpu_rows = c.fused;
  return o;
}

// The reference optimiser on the whole shard (float64, rows `rows` move): SGD momentum, or
// AdamW with a step count per row; a bf16 state is rounded to bf16 after each update.
struct ReferenceOptimizer {
  std::string kind;
  at::ScalarType state_dtype = at::kFloat;
  double lr = 0, wd = 0, mom = 0.9, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  at::Tensor w, m, v, t;  // float64 [C, D] (t: [C])

  void step(const at::Tensor& rows, const at::Tensor& g) {
    auto round = [&](const at::Tensor& x) {
      return state_dtype == at::kBFloat16 ? x.to(at::kFloat).to(at::kBFloat16).to(at::kDouble) : x;
    };
    at::Tensor wr = w.index_select(0, rows), mr = m.index_select(0, rows);
    if (kind == "sgd") {
      mr = mom * mr + (g + wd * wr);
      wr = wr - lr * mr;
      m.index_copy_(0, rows, round(mr));
    } else {
      at::Tensor vr = v.index_select(0, rows), tr = t.index_select(0, rows) + 1;
      mr = b1 * mr + (1 - b1) * g;
      vr = b2 * vr + (1 - b2) * g * g;
      const at::Tensor tf = tr.unsqueeze(1);
      wr = wr * (1 - lr * wd) - lr * (mr / (1 - torch::pow(b1, tf))) / ((vr / (1 - torch::pow(b2, tf))).sqrt() + eps);
      m.index_copy_(0, rows, round(mr));
      v.index_copy_(0, rows, round(vr));
      t.index_copy_(0, rows, tr);
    }
    w.index_copy_(0, rows, wr);
  }
};

// Two steps of the classifier on one rank against the reference: the materialised gradient
// (gradient(), on demand), then the weight and optimiser state after each chunked step. With
// `scale`, the loss is scaled and unscale_ runs before the step (a finite scale: the same
// result).
void check_case(const Case& c, double scale) {
  SCOPED_TRACE(name_of(c) + " scale " + std::to_string(scale));
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const int64_t C = 61, D = 16, N = 12;
  const double lr = 0.2;
  PartialFC fc(*dist, options_of(c, C, D));
  ReferenceOptimizer ref;
  ref.kind = c.optimizer;
  ref.state_dtype = c.state_dtype;
  ref.lr = lr;
  ref.wd = 5e-4;
  ref.w = fc.weight().to(at::kDouble);
  ref.m = torch::zeros({C, D}, at::kDouble);
  ref.v = torch::zeros({C, D}, at::kDouble);
  ref.t = torch::zeros({C}, at::kDouble);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    torch::manual_seed(100 + step);
    const at::Tensor emb = torch::randn({N, D}), labels = torch::randint(0, C, {N}, torch::kLong);
    const at::Tensor W0 = fc.weight().clone();
    auto out = fc.forward(emb, labels);
    (scale == 1 ? out.loss : out.loss * scale).backward();
    const at::Tensor cols = fc.samples() ? fc.sampled_index().clone() : torch::arange(C, torch::kLong);
    if (fc.samples()) {
      EXPECT_LT(cols.size(0), C);
    }
    const at::Tensor g = reference_grad(emb, W0, labels, cols);
    if (scale != 1) {
      const at::Tensor found = fc.unscale_(torch::full({1}, 1.0 / scale));
      EXPECT_EQ(found.item<float>(), 0.0f);
    }
    EXPECT_LE(testing::relative_error(fc.gradient(), g), 2e-5);
    fc.step(lr);
    ref.step(cols, g);
    // The weights move by lr times something of the gradient's size: compare the moves.
    EXPECT_LE(testing::relative_error(fc.weight().to(at::kDouble) - W0.to(at::kDouble), ref.w - W0.to(at::kDouble)),
              c.state_dtype == at::kBFloat16 ? 5e-3 : 1e-4);
    // AdamW's first steps move each element by about lr * sign(g): elements with a gradient
    // near eps carry fp32's rounding of g into the weight almost unscaled.
    EXPECT_LE(testing::relative_error(fc.weight(), ref.w), c.optimizer == "adamw" ? 5e-5 : 1e-6);
    const ShardRows state = fc.state();
    for (const auto& kv : state) {
      if (kv.first == "weight") continue;
      if (kv.first != "opt.row_steps") {
        EXPECT_EQ(kv.second.scalar_type(), c.state_dtype) << kv.first;
      }
      const at::Tensor& want = kv.first == "opt.exp_avg_sq" ? ref.v : kv.first == "opt.row_steps" ? ref.t : ref.m;
      EXPECT_LE(testing::relative_error(kv.second.to(at::kDouble), want),
                c.state_dtype == at::kBFloat16 ? 5e-3 : 2e-5)
          << kv.first;
    }
    // Rows outside the step's columns did not move.
    at::Tensor untouched = torch::ones({C}, torch::kBool).index_fill_(0, cols, false);
    EXPECT_TRUE(torch::equal(fc.weight().index_select(0, untouched.nonzero().squeeze(1)),
                             W0.index_select(0, untouched.nonzero().squeeze(1))));
  }
}

TEST(PartialFCChunkedUpdate, MatchesAMaterialisedGradientReference) {
  for (const std::string opt : {"sgd", "adamw"})
    for (const double rate : {1.0, 0.5})
      for (const int64_t chunk : {int64_t(1), int64_t(7), int64_t(16), int64_t(4096), int64_t(0)})
        for (const bool fused : {true, false}) check_case(Case{opt, rate, at::kFloat, chunk, fused}, 1.0);
}

// The CPU's one-pass SGD update (row_update_cpu.h) against the generic path (gather, the
// gradient's radial part, torch's fused SGD, scatter): three steps of the same classifier,
// momentum 0.9 or 0, fp32 or bf16 state, with and without sampling; every row and its
// state agree to fp32 rounding, and the rows no step took part in are bit-identical.
TEST(PartialFCChunkedUpdate, OnePassCpuUpdateMatchesTheGenericPath) {
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  const int64_t C = 300, D = 40, N = 16;
  for (const double rate : {1.0, 0.1})
    for (const double momentum : {0.9, 0.0})
      for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
        SCOPED_TRACE("rate " + std::to_string(rate) + " momentum " + std::to_string(momentum) + " " +
                     c10::toString(dtype));
        std::vector<ShardRows> states;
        at::Tensor moved;
        for (const bool fused : {true, false}) {
          PartialFCOptions o = options_of(Case{"sgd", rate, dtype, 64, fused}, C, D);
          o.optimizer.momentum = momentum;
          PartialFC fc(*dist, o);
          at::Tensor touched = torch::zeros({C}, torch::kBool);
          for (int step = 0; step < 3; ++step) {
            torch::manual_seed(50 + step);
            fc.forward(torch::randn({N, D}), torch::randint(0, C, {N}, torch::kLong)).loss.backward();
            touched.index_fill_(0, fc.samples() ? fc.sampled_index() : torch::arange(C), true);
            fc.step(0.5);
          }
          if (rate < 1) {
            EXPECT_LT(touched.sum().item<int64_t>(), C);
          }
          moved = touched;
          states.push_back(fc.state());
        }
        const at::Tensor still = (~moved).nonzero().squeeze(1);
        const at::Tensor w0 = PartialFC::initial_rows(0, C, D, PartialFCOptions{}.seed);
        for (size_t i = 0; i < states[0].size(); ++i) {
          const at::Tensor a = states[0][i].second.to(at::kDouble), b = states[1][i].second.to(at::kDouble);
          const std::string& name = states[0][i].first;
          if (name == "weight") {  // the moves, which are small against the rows
            EXPECT_LE(testing::relative_error(a - w0.to(at::kDouble), b - w0.to(at::kDouble)),
                      dtype == at::kBFloat16 ? 1e-3 : 2e-5)
                << name;
          } else if (b.abs().sum().item<double>() > 0) {  // a bf16 state may round either way
            EXPECT_LE(testing::relative_error(a, b), dtype == at::kBFloat16 ? 8e-3 : 2e-5) << name;
          }
          EXPECT_TRUE(torch::equal(states[0][i].second.index_select(0, still), states[1][i].second.index_select(0, still)))
              << name;
        }
      }
}

TEST(PartialFCChunkedUpdate, Bf16StateRoundsTheStoredStateOnly) {
  for (const std::string opt : {"sgd", "adamw"})
    for (const double rate : {1.0, 0.5})
      for (const int64_t chunk : {int64_t(7), int64_t(4096)})
        for (const bool fused : {true, false}) check_case(Case{opt, rate, at::kBFloat16, chunk, fused}, 1.0);
}

// Loss scaling: a finite scale is divided out chunk by chunk (same result as unscaled); a
// gradient with an inf is flagged before the update pass, and the skipped step (zero_grad,
// as TrainStep does) leaves weight and state bit-identical.
TEST(PartialFCChunkedUpdate, LossScalingUnscalesLazilyAndFlagsInf) {
  for (const std::string opt : {"sgd", "adamw"})
    for (const double rate : {1.0, 0.5})
      for (const bool fused : {true, false}) check_case(Case{opt, rate, at::kFloat, 7, fused}, 1024.0);
  // fp16 training: the GEMMs in half precision, the loss scaled.
  for (const double rate : {1.0, 0.5}) {
    SCOPED_TRACE("rate " + std::to_string(rate));
    std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
    PartialFCOptions o = options_of(Case{"sgd", rate, at::kFloat, 7}, 61, 16);
    o.gemm_dtype = at::kHalf;
    PartialFC fc(*dist, o);
    // One step first, so that the momentum is not zero.
    torch::manual_seed(7);
    auto first = fc.forward(torch::randn({12, 16}), torch::randint(0, 61, {12}, torch::kLong));
    first.loss.backward();
    fc.step(0.2);
    std::vector<at::Tensor> before;
    for (const auto& kv : fc.state()) before.push_back(kv.second.clone());
    auto out = fc.forward(torch::randn({12, 16}), torch::randint(0, 61, {12}, torch::kLong));
    (out.loss * std::numeric_limits<double>::infinity()).backward();
    const at::Tensor found = fc.unscale_(torch::full({1}, 1.0 / 65536));
    EXPECT_EQ(found.item<float>(), 1.0f);
    // The materialised gradient would indeed have held a non-finite value.
    EXPECT_FALSE(torch::isfinite(fc.gradient()).all().item<bool>());
    fc.zero_grad();
    fc.step(0.2);  // nothing left to apply
    const ShardRows after = fc.state();
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(torch::equal(after[i].second, before[i])) << after[i].first;
  }
}

// Two ranks: the softmax across shards, each shard's chunked step against the reference over
// the columns of both shards (their sampled ones with sampling).
TEST(PartialFCChunkedUpdate, TwoRanksMatchTheReference) {
  for (const double rate : {1.0, 0.5}) {
    testing::run_ranks(2, [rate](Distributed& d) {
      const int64_t C = 41, D = 8, B = 5;
      const double lr = 0.2, wd = 5e-4;
      PartialFCOptions o = options_of(Case{"sgd", rate, at::kFloat, 3}, C, D);
      PartialFC fc(d, o);
      torch::manual_seed(11);  // the same global batch on both ranks
      const at::Tensor emb = torch::randn({2 * B, D}), labels = torch::randint(0, C, {2 * B}, torch::kLong);
      const at::Tensor W = PartialFC::initial_rows(0, C, D, o.seed);
      auto out = fc.forward(emb.narrow(0, d.rank() * B, B), labels.narrow(0, d.rank() * B, B));
      out.loss.backward();
      const int64_t s0 = fc.shard().start;
      const at::Tensor mine = fc.samples() ? fc.sampled_index() + s0 : torch::arange(s0, s0 + fc.shard().count);
      const at::Tensor cols = std::get<0>(torch::sort(d.all_gather(mine.contiguous())));
      const at::Tensor g = reference_grad(emb, W, labels, cols);
      const at::Tensor g_mine = g.index_select(0, torch::searchsorted(cols, mine));
      EXPECT_LE(testing::relative_error(fc.gradient(), g_mine), 2e-5);
      fc.step(lr);
      const at::Tensor w0 = W.index_select(0, mine).to(at::kDouble);
      const at::Tensor want = w0 - lr * (g_mine + wd * w0);
      EXPECT_LE(testing::relative_error(fc.weight().index_select(0, mine - s0).to(at::kDouble) - w0, want - w0), 1e-4);
    });
  }
}

// What the optimiser state costs in the memory plan, and the config key.
TEST(PartialFCChunkedUpdate, MemoryPlanAndConfigKey) {
  PartialFCOptions po;
  po.num_classes = 1000;
  po.embedding_size = 512;
  ClassifierMemoryPlan p = classifier_memory_plan(po, 1, 0, 128);
  EXPECT_DOUBLE_EQ(p.state_bytes, 1000.0 * 512 * 4);
  EXPECT_DOUBLE_EQ(p.gradient_bytes, 0.0);
  // Chunk temporaries: 1000 rows fit one chunk of a GPU's budget; the logits passes' columns
  // (6 x 512 + 12 x 128 B each) take more than the update's raw rows (4 x 512 B each).
  EXPECT_DOUBLE_EQ(p.chunk_bytes, 1000.0 * (6 * 512 + 12 * 128));
  EXPECT_DOUBLE_EQ(p.total_bytes(), 1000.0 * (512 * 4 * 2 + 128 * 4) + p.chunk_bytes);
  po.optimizer.state_dtype = at::kBFloat16;
  p = classifier_memory_plan(po, 1, 0, 128);
  EXPECT_DOUBLE_EQ(p.state_bytes, 1000.0 * 512 * 2);
  po.optimizer.kind = "adamw";
  p = classifier_memory_plan(po, 1, 0, 128);
  EXPECT_DOUBLE_EQ(p.state_bytes, 1000.0 * (2 * 512 * 2 + 8));
  // Accumulation sets gradients aside: without sampling one running sum of the shard.
  po.grad_accumulation = 2;
  EXPECT_DOUBLE_EQ(classifier_memory_plan(po, 1, 0, 128).gradient_bytes, 1000.0 * 512 * 4);
  po.optimizer.state_dtype = at::kHalf;
  EXPECT_NE(testing::error_of([&] { classifier_memory_plan(po, 1, 0, 128); }).find("fp32 or bf16"), std::string::npos);

  EXPECT_EQ(load_config_text("data:\n  num_classes: 10\n", "s.yaml").optim.fc_state_dtype, "fp32");
  const Config bf16 = load_config_text("data:\n  num_classes: 10\noptim:\n  fc_state_dtype: bf16\n", "s.yaml");
  EXPECT_EQ(bf16.optim.fc_state_dtype, "bf16");
  EXPECT_NE(config_to_yaml(bf16).find("fc_state_dtype: bf16"), std::string::npos);  // faceshard-config --print-config
  const std::string msg =
      testing::error_of([] { load_config_text("data:\n  num_classes: 10\noptim:\n  fc_state_dtype: fp16\n", "s.yaml"); });
  EXPECT_NE(msg.find("key 'optim.fc_state_dtype'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fp32, bf16"), std::string::npos) << msg;
}

// A checkpoint keeps a classifier entry in its dtype; a resume with the other dtype key
// converts it (bf16 -> fp32 exactly, fp32 -> bf16 rounded), resharded or not. `key` is the
// optim.* key ("fc_state_dtype", "fc_weight_dtype"), `entry` the state's row entry.
void check_resume_converts(const std::string& key, const std::string& entry) {
  const std::string dir = testing::temp_dir(key);
  std::shared_ptr<Distributed> dist = Distributed::init(DistEnv{});
  auto config = [&](const std::string& dtype) {
    return load_config_text("output: " + dir + "/out_" + dtype + "\n" + R"(data: {rec: synthetic, num_classes: 10, batch_size: 4, num_workers: 1}
model: {backbone: mbf, embedding_size: 8}
train: {verify_every: 0, tensorboard: false}
dist: {device: cpu}
optim: {)" + key + ": " + dtype + "}\n",
                            "job.yaml");
  };
  for (const std::string from : {"bf16", "fp32"}) {
    const std::string to = from == "bf16" ? "fp32" : "bf16";
    SCOPED_TRACE(key + " " + from + " -> " + to);
    const at::Tensor rows = torch::randn({10, 8});
    // Each check below finds its entry by name; a renamed entry must fail, not skip it.
    int found = 0;
    {
      TrainJob job = build_train_job(config(from), dist);
      for (const auto& kv : job.fc->state())
        if (kv.first == entry) {
          ++found;
          EXPECT_EQ(kv.second.scalar_type(), from == "bf16" ? at::kBFloat16 : at::kFloat);
          kv.second.copy_(rows);
        }
      TrainState state(job);
      state.progress().step = 2;
      CheckpointManager checkpoints(dir + "/ck_" + from, *dist, 100);
      state.save(checkpoints);
    }
    const std::string ck = dir + "/ck_" + from + "/step_00000002";
    // Saved in its own dtype.
    for (const auto& kv : read_state_dict(ck + "/fc_shard_0.pt"))
      if (kv.first == "rows/" + entry) {
        ++found;
        EXPECT_EQ(kv.second.scalar_type(), from == "bf16" ? at::kBFloat16 : at::kFloat);
      }
    EXPECT_EQ(ReshardedRows(read_checkpoint_info(ck), 0, 10).dtype(entry), from == "bf16" ? at::kBFloat16 : at::kFloat);
    TrainJob job = build_train_job(config(to), dist, ClassifierStart::FromCheckpoint);
    TrainState(job).load(ck);
    for (const auto& kv : job.fc->state())
      if (kv.first == entry) {
        ++found;
        EXPECT_EQ(kv.second.scalar_type(), to == "bf16" ? at::kBFloat16 : at::kFloat);
        EXPECT_TRUE(torch::equal(kv.second.to(at::kFloat), rows.to(at::kBFloat16).to(at::kFloat)));
      }
    EXPECT_EQ(found, 3) << "the " << entry << " entry was not found in the state, the file and the resumed state";
  }
}

TEST(PartialFCChunkedUpdate, ResumeConvertsTheStateDtype) { check_resume_converts("fc_state_dtype", "opt.momentum"); }

// The same for the centres (optim.fc_weight_dtype: rows/weight).
TEST(PartialFCChunkedUpdate, ResumeConvertsTheCentresDtype) { check_resume_converts("fc_weight_dtype", "weight"); }

}  // namespace
}  // namespace faceshard
