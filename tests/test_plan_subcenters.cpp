// faceshard-plan with sub-centres (loss.subcenters K): the classifier GEMMs' FLOPs per step
// and the checkpoint's shard bytes at K = 3 against their closed forms (K times those of
// K = 1), and the --subcenters flag against the config key it stands for.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include <yaml-cpp/yaml.h>

#include "app/plan/activation_table.h"
#include "app/plan/job_memory_plan.h"
#include "app/plan/job_time_plan.h"
#include "tests/harness.h"
#include "tests/test_paths.h"

namespace faceshard {
namespace {

// 1,000,003 classes over 8 ranks: rank 0 holds ceil(C / 8) = 125,001 rows, samples
// floor(0.1 x 125,001) = 12,500 of them.
JobSettings job(int64_t k) {
  JobSettings in;
  in.network = "r50";
  in.batch_per_rank = 128;
  in.world_size = 8;
  in.num_classes = 1000003;
  in.sample_rate = 0.1;
  in.embedding_size = 512;
  in.grad_accumulation = 2;
  in.subcenters = k;
  return in;
}

TEST(PlanSubcenters, ClassifierGemmFlopsAreKTimesTheColumns) {
  const double shard0 = 125001, sampled = 12500;
  ASSERT_EQ(int64_t(0.1 * shard0), int64_t(sampled));
  const StepRateTable rates = StepRateTable::parse(
      R"({"mode": "step", "network": "r50", "precision": "fp32", "batch_per_rank": 256, "classes": 2000000,
          "sample_rate": 0.2, "world_size": 2, "images_per_s": 2000})",
      "test");
  TimePlanInputs tin;
  tin.images = 1000000;
  for (int64_t k : {1, 3}) {
    const JobSettings in = job(k);
    // Forward logits [B x W, S x K] and the two backward products, 2 x rows x columns x E
    // FLOPs each, per micro-batch.
    const double want = 6.0 * (128 * 8) * (sampled * double(k)) * 512 * 2;
    int64_t columns = 0;
    EXPECT_DOUBLE_EQ(classifier_gemm_flops(in, &columns), want) << "K = " << k;
    EXPECT_EQ(columns, int64_t(sampled) * k);
    const TimePlan t = plan_job_time(in, tin, rates);
    EXPECT_DOUBLE_EQ(t.classifier_gemm_flops, want);
    EXPECT_EQ(t.classifier_columns, int64_t(sampled) * k);
    // The measured step's, at K = 1: rank 0 of 2 holds 1,000,000 rows and samples 200,000.
    EXPECT_DOUBLE_EQ(t.measured_classifier_gemm_flops, 6.0 * (256 * 2) * 200000 * 512);
  }
  EXPECT_DOUBLE_EQ(classifier_gemm_flops(job(3)), 3 * classifier_gemm_flops(job(1)));
}

TEST(PlanSubcenters, CheckpointShardsHoldKRowsPerClass) {
  const ActivationTable table = ActivationTable::shipped();
  for (int64_t k : {1, 3}) {
    const CheckpointPlan ck = plan_checkpoint(job(k), table, 3);
    const auto shards = std::find_if(ck.files.begin(), ck.files.end(),
                                     [](const CheckpointFilePlan& f) { return f.name.rfind("fc_shard_0.pt", 0) == 0; });
    ASSERT_NE(shards, ck.files.end());
    // Every class's K rows in fp32 and their SGD momentum in fp32: C x K x E x (4 + 4) B.
    EXPECT_DOUBLE_EQ(shards->bytes, 1000003.0 * double(k) * 512 * 8) << "K = " << k << ": " << shards->how;
  }
}

TEST(PlanSubcentersTool, FlagEqualsTheConfigKey) {
  const std::string dir = testing::temp_dir("plan_subcenters");
  const std::string base = std::string(FACESHARD_SOURCE_DIR) + "/configs/base.yaml";
  const std::string common = "base: " + base +
                             "\ndata: {rec: synthetic, num_classes: 1000003, batch_size: 128}\n"
                             "model: {backbone: r50}\n";
  testing::write_text(dir + "/k3.yaml", common + "loss: {subcenters: 3}\n");
  testing::write_text(dir + "/k1.yaml", common);
  auto plan = [&](const std::string& args, const std::string& json) {
    const auto r = testing::run_tool("faceshard-plan", args + " --ranks 8 --images 5000000 --json " + dir + "/" + json);
    EXPECT_EQ(r.status, 0) << args << "\n" << r.output;
    return testing::read_text(dir + "/" + json);
  };
  const std::string by_key = plan("--config " + dir + "/k3.yaml", "key.json");
  const std::string by_flag = plan("--config " + dir + "/k1.yaml --subcenters 3", "flag.json");
  const std::string k1 = plan("--config " + dir + "/k1.yaml", "k1.json");
  const std::string k1_over_key = plan("--config " + dir + "/k3.yaml --subcenters 1", "k1_over_key.json");
  EXPECT_EQ(by_flag, by_key);
  EXPECT_EQ(k1_over_key, k1);  // the flag overrides the config
  const YAML::Node a = YAML::Load(by_flag), b = YAML::Load(k1);
  EXPECT_EQ(a["subcenters"].as<int64_t>(), 3);
  EXPECT_EQ(b["subcenters"].as<int64_t>(), 1);
  EXPECT_DOUBLE_EQ(a["time"]["classifier_gemm_flops"].as<double>(), 3 * b["time"]["classifier_gemm_flops"].as<double>());
  // Rank 0's centres: K rows of E fp32 per class (the logits may switch to streamed, so the
  // classifier's total is not K times).
  auto centres = [](const YAML::Node& js) {
    for (const auto& p : js["parts"])
      if (p["name"].as<std::string>() == "rows (centres)") return p["bytes"].as<double>();
    ADD_FAILURE() << "no rows (centres) part";
    return 0.0;
  };
  EXPECT_DOUBLE_EQ(centres(a), 125001.0 * 3 * 512 * 4);
  EXPECT_DOUBLE_EQ(centres(b), 125001.0 * 512 * 4);
  for (const char* bad : {"--classes 1M --subcenters 0", "--classes 1M --subcenters three"}) {
    const auto r = testing::run_tool("faceshard-plan", bad);
    EXPECT_EQ(r.status, 2) << bad << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << bad << "\n" << r.output;
    EXPECT_NE(r.output.find("--subcenters"), std::string::npos) << r.output;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace faceshard
