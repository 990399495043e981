// One road from a config to the classifier (app/config/job_settings.h): every key that reaches
// the classifier, run through faceshard-config, faceshard-plan and the trainer's own start-up
// line, must give the same shard. The trainer's bytes are counted from the tensors it built,
// so a setting that one of the three drops (or reads differently) shows as a disagreement.
#include <gtest/gtest.h>

#include <regex>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "app/config/config.h"
#include "app/config/job_settings.h"
#include "tests/harness.h"
#include "tests/test_paths.h"

namespace faceshard {
namespace {

struct Shard {
  double centres = -1, state = -1;  // bytes
  int64_t sampled = -1;             // classes a step
  std::string logits;               // "streamed" or "buffered: N bytes"
  double staging = -1;              // rank 0's checkpoint staging, bytes (faceshard-plan, the trainer)
};

// A figure as format_bytes writes it ("6.05 MB": three significant digits, powers of 1000).
double parse_bytes(const std::string& number, const std::string& unit) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  double scale = 1;
  for (const char* u : units) {
    if (unit == u) return std::stod(number) * scale;
    scale *= 1000;
  }
  ADD_FAILURE() << "unit " << unit;
  return -1;
}

std::string sets(const std::vector<std::string>& keys) {
  std::string s;
  for (const auto& k : keys) s += " --set '" + k + "'";
  return s;
}

std::smatch must_match(const std::string& text, const std::regex& re, const std::string& what) {
  std::smatch m;
  if (!std::regex_search(text, m, re)) ADD_FAILURE() << what << ": no match in:\n" << text;
  return m;
}

Shard from_config(const std::string& config, const std::vector<std::string>& keys) {
  const testing::CommandResult r = testing::run_tool("faceshard-config", "--config '" + config + "'" + sets(keys) + " 2>&1");
  EXPECT_EQ(r.status, 0) << r.output;
  Shard s;
  std::smatch m = must_match(r.output, std::regex(R"(: (\d+) bytes \([^)]*\) of centres \+ (\d+) bytes)"), "config bytes");
  if (!m.empty()) s.centres = std::stod(m[1]), s.state = std::stod(m[2]);
  m = must_match(r.output, std::regex(R"(on one rank: (\d+) classes take part in a step .*, logits (streamed|buffered: \d+ bytes))"),
                 "config step");
  if (!m.empty()) s.sampled = std::stoll(m[1]), s.logits = m[2];
  return s;
}

Shard from_plan(const std::string& config, const std::vector<std::string>& keys, int ranks, const std::string& json) {
  const testing::CommandResult r = testing::run_tool(
      "faceshard-plan", "--config '" + config + "'" + sets(keys) + " --ranks " + std::to_string(ranks) + " --json '" + json + "' 2>&1");
  EXPECT_EQ(r.status, 0) << r.output;
  Shard s;
  if (r.status != 0) return s;
  const YAML::Node plan = YAML::LoadFile(json);
  s.sampled = plan["sampled_rows"].as<int64_t>();
  double logits = -1;
  for (const auto& part : plan["parts"]) {
    if (part["group"].as<std::string>() != "classifier") continue;
    const std::string name = part["name"].as<std::string>();
    if (name == "rows (centres)") s.centres = part["bytes"].as<double>();
    if (name == "optimiser state") s.state = part["bytes"].as<double>();
    if (name == "logits buffer") logits = part["bytes"].as<double>();
  }
  s.staging = plan["checkpoint"]["staging"]["rank0_bytes"].as<double>();
  s.logits = plan["logits"].as<std::string>() == "streamed"
                 ? "streamed"
                 : "buffered: " + std::to_string(static_cast<long long>(logits)) + " bytes";
  return s;
}

Shard from_trainer(const std::string& config, const std::vector<std::string>& keys, int ranks) {
  const std::string train = std::string("\"") + FACESHARD_BIN_DIR + "/faceshard-train\" --config '" + config + "'" +
                            sets(keys) + " --overwrite";
  const std::string cmd = ranks == 1 ? "OMP_NUM_THREADS=1 " + train + " 2>&1"
                                     : std::string("\"") + FACESHARD_SOURCE_DIR + "/tools/launch.sh\" --nproc " +
                                           std::to_string(ranks) + " -- " + train + " 2>&1";
  const testing::CommandResult r = testing::run_command(cmd);
  EXPECT_EQ(r.status, 0) << r.output;
  Shard s;
  const std::smatch m = must_match(
      r.output,
      std::regex(R"(classifier shard \(rank 0 of (\d+)\): .*; centres (\d+) bytes \([^)]*\), optimiser state (\d+) bytes \([^)]*\), as allocated; (\d+) classes take part in a step; logits (streamed|buffered: \d+ bytes))"),
      "trainer's start-up line");
  if (m.empty()) return s;
  EXPECT_EQ(std::stoi(m[1]), ranks);
  s.centres = std::stod(m[2]);
  s.state = std::stod(m[3]);
  s.sampled = std::stoll(m[4]);
  s.logits = m[5];
  if (s.logits.rfind("streamed", 0) == 0) s.logits = "streamed";
  // The background checkpoint's staging, from the tensors the trainer holds (checkpoint_writer).
  const std::smatch st =
      must_match(r.output, std::regex(R"(train\.checkpoint_async auto: staging ([0-9.]+) (B|KB|MB|GB) a rank)"),
                 "trainer's staging line");
  if (!st.empty()) s.staging = parse_bytes(st[1], st[2]);
  return s;
}

class JobSettingsAgree : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(testing::temp_dir("job_settings"));
    const testing::CommandResult r =
        testing::run_tool("faceshard-synth", "--output '" + *dir_ + "/data' --identities 30 --images 4 --pairs 0 2>&1");
    ASSERT_EQ(r.status, 0) << r.output;
    testing::write_text(*dir_ + "/job.yaml", "base: " + std::string(FACESHARD_SOURCE_DIR) +
                                                "/configs/base.yaml\noutput: " + *dir_ +
                                                "/run\ndata: {rec: " + *dir_ +
                                                "/data, batch_size: 8, num_workers: 1, num_classes: 30}\n"
                                                "model: {backbone: mbf_small}\n"
                                                "train: {max_steps: 1, precision: fp32, tensorboard: false}\n");
  }
  static std::string* dir_;

  // On one rank faceshard-config's whole classifier is the shard: all three must agree.
  void agree(const std::vector<std::string>& keys) {
    SCOPED_TRACE(sets(keys));
    const std::string config = *dir_ + "/job.yaml";
    const Shard c = from_config(config, keys), p = from_plan(config, keys, 1, *dir_ + "/plan.json"),
                t = from_trainer(config, keys, 1);
    ASSERT_GT(t.centres, 0);
    for (const Shard* other : {&c, &p}) {
      EXPECT_EQ(other->centres, t.centres) << (other == &c ? "faceshard-config" : "faceshard-plan");
      EXPECT_EQ(other->state, t.state) << (other == &c ? "faceshard-config" : "faceshard-plan");
      EXPECT_EQ(other->sampled, t.sampled) << (other == &c ? "faceshard-config" : "faceshard-plan");
      EXPECT_EQ(other->logits, t.logits) << (other == &c ? "faceshard-config" : "faceshard-plan");
    }
    // The checkpoint's staging: the planner's files against the trainer's tensors (the
    // trainer's figure is rounded to three significant digits).
    EXPECT_NEAR(p.staging, t.staging, 0.005 * p.staging) << "checkpoint staging: faceshard-plan against the trainer";
  }
};
std::string* JobSettingsAgree::dir_ = nullptr;

TEST_F(JobSettingsAgree, Defaults) { agree({}); }

TEST_F(JobSettingsAgree, SubcentresSampledBf16CentresAndState) {
  agree({"loss.subcenters=3", "loss.sample_rate=0.5", "optim.fc_weight_dtype=bf16", "optim.fc_state_dtype=bf16",
         "train.precision=bf16"});
}

TEST_F(JobSettingsAgree, AdamWStreamedLogits) {
  agree({"optim.fc_optimizer=adamw", "optim.fc_state_dtype=bf16", "loss.logits=streamed"});
}

TEST_F(JobSettingsAgree, GlobalBatchHeadWithCodesAccumulation) {
  agree({"data.global_batch_size=16", "optim.grad_accumulation=2", "loss.head=adaface", "loss.logits=buffer",
         "loss.sample_rate=0.4"});
}

TEST_F(JobSettingsAgree, NoMomentumEveryRowSteps) {
  agree({"optim.momentum=0", "optim.fc_update=all", "loss.sample_rate=0.3", "loss.subcenters=2"});
}

// Two ranks: rank 0's shard (15 classes) as faceshard-plan plans it and the trainer builds it.
TEST_F(JobSettingsAgree, TwoRanksPlanAndTrainer) {
  const std::vector<std::string> keys{"loss.sample_rate=0.5", "optim.fc_weight_dtype=bf16", "loss.subcenters=3",
                                      "data.global_batch_size=16"};
  const std::string config = *dir_ + "/job.yaml";
  const Shard p = from_plan(config, keys, 2, *dir_ + "/plan2.json"), t = from_trainer(config, keys, 2);
  ASSERT_GT(t.centres, 0);
  // 15 classes x 3 sub-centres x 512 x 2 B; 7 of 15 sampled; SGD momentum in fp32.
  EXPECT_EQ(t.centres, 15.0 * 3 * 512 * 2);
  EXPECT_EQ(t.state, 15.0 * 3 * 512 * 4);
  EXPECT_EQ(t.sampled, 7);
  EXPECT_EQ(p.centres, t.centres);
  EXPECT_EQ(p.state, t.state);
  EXPECT_EQ(p.sampled, t.sampled);
  EXPECT_EQ(p.logits, t.logits);
  EXPECT_NEAR(p.staging, t.staging, 0.005 * p.staging) << "checkpoint staging: faceshard-plan against the trainer";
}

// The copy from the config: every key the classifier reads lands in the settings, and the
// settings' options carry it (the road's two halves, without a process).
TEST(JobSettings, EveryClassifierKeyReachesTheOptions) {
  Config cfg = load_config_text(
      "data: {num_classes: 1000, global_batch_size: 96}\n"
      "loss: {sample_rate: 0.25, subcenters: 3, margin: [1.0, 0.3, 0.1], scale: 48, head: combined, logits: streamed,"
      " interclass_filtering_threshold: 0.2}\n"
      "optim: {fc_optimizer: adamw, momentum: 0.8, fc_weight_decay: 0.01, betas: [0.8, 0.9], eps: 1.0e-6,"
      " fc_state_dtype: bf16, fc_weight_dtype: bf16, fc_weight_rounding: nearest, fc_update: all,"
      " grad_accumulation: 2}\n"
      "model: {embedding_size: 256}\ntrain: {precision: fp16}\nseed: 7\n",
      "inline", {});
  const JobSettings s = job_settings(cfg, 3);
  EXPECT_EQ(s.batch_per_rank, 16);  // 96 / (3 ranks x 2 micro-batches)
  const PartialFCOptions o = classifier_options(s);
  EXPECT_EQ(o.num_classes, 1000);
  EXPECT_EQ(o.embedding_size, 256);
  EXPECT_EQ(o.sample_rate, 0.25);
  EXPECT_EQ(o.subcenters, 3);
  EXPECT_EQ(o.margin.m1, 1.0);
  EXPECT_EQ(o.margin.m2, 0.3);
  EXPECT_EQ(o.margin.m3, 0.1);
  EXPECT_EQ(o.margin.scale, 48);
  EXPECT_EQ(o.margin.interclass_filter, 0.2);
  EXPECT_EQ(o.seed, 7u);
  EXPECT_EQ(o.optimizer.kind, "adamw");
  EXPECT_EQ(o.optimizer.momentum, 0.8);
  EXPECT_EQ(o.optimizer.weight_decay, 0.01);
  EXPECT_EQ(o.optimizer.beta1, 0.8);
  EXPECT_EQ(o.optimizer.beta2, 0.9);
  EXPECT_EQ(o.optimizer.eps, 1e-6);
  EXPECT_EQ(o.optimizer.state_dtype, at::kBFloat16);
  EXPECT_EQ(o.weight_dtype, at::kBFloat16);
  EXPECT_TRUE(o.weight_round_nearest);
  EXPECT_TRUE(o.step_all_rows);
  EXPECT_EQ(o.grad_accumulation, 2);
  EXPECT_EQ(o.gemm_dtype, at::kHalf);
  EXPECT_TRUE(o.streamed_logits);
  JobSettings bad = s;
  bad.fc_state_dtype = "fp8";
  EXPECT_THROW(classifier_options(bad), Error);
}

}  // namespace
}  // namespace faceshard
