// faceshard-plan's answers beyond memory: the largest batch per rank that fits (against a
// plain scan of every batch), the hours of a schedule (against a hand computation from the
// GPU check's report), the checkpoint's size (against the files a short training writes),
// the BatchNorm buffers it counts (against the networks as built), and the learning-rate
// reminder (against each preset's own header comment).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>

#include <yaml-cpp/yaml.h>

#include "app/config/config.h"
#include "app/plan/activation_table.h"
#include "app/plan/job_memory_plan.h"
#include "app/plan/job_time_plan.h"
#include "models/backbone_registry.h"
#include "tests/harness.h"
#include "tests/test_errors.h"
#include "tests/test_files.h"
#include "tests/test_paths.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;

JobSettings r50_eight_ranks() {
  JobSettings in;
  in.network = "r50";
  in.precision = "bf16";
  in.batch_per_rank = 128;
  in.world_size = 8;
  in.num_classes = 2059906;
  in.sample_rate = 0.2;
  return in;
}

bool fits(JobSettings in, int64_t batch, const ActivationTable& t, double budget) {
  in.batch_per_rank = batch;
  return plan_job_memory(in, t).total_bytes() <= budget;
}

// The largest batch by a scan of every batch from 2 on, far past the last one that fits.
int64_t scanned_largest_batch(const JobSettings& in, const ActivationTable& t, double budget, int64_t scan_to) {
  int64_t best = 0;
  for (int64_t b = 2; b <= scan_to; ++b)
    if (fits(in, b, t, budget)) best = b;
  return best;
}

TEST(PlanBatch, LargestBatchFitsAndOneMoreDoesNot) {
  const ActivationTable t = ActivationTable::shipped();
  const double budget = 80e9 - 1073741824.0;
  // loss.logits auto: the buffer of 4 B x global batch x sampled classes turns to streamed
  // logits at some batch, where the plan drops; the scan sees both sides.
  for (const std::string logits : {"auto", "buffer", "streamed"}) {
    JobSettings in = r50_eight_ranks();
    in.logits = logits;
    const int64_t best = max_batch_that_fits(in, t, budget);
    ASSERT_GT(best, 2) << logits;
    EXPECT_TRUE(fits(in, best, t, budget)) << logits;
    EXPECT_FALSE(fits(in, best + 1, t, budget)) << logits;
    EXPECT_EQ(best, scanned_largest_batch(in, t, budget, 3 * best)) << logits;
  }
  // Where the plan drops: with loss.logits auto the buffer turns to streamed logits at the
  // first batch b* where it would outgrow the centres and their state (2M rows a rank here),
  // so b* - 1 needs more than b*. A budget between the two: b* - 1 does not fit, b* does.
  JobSettings in = r50_eight_ranks();
  in.num_classes = 16000000;
  in.sample_rate = 1.0;
  int64_t switch_at = 2;
  auto plan_at = [&](int64_t b) {
    JobSettings x = in;
    x.batch_per_rank = b;
    return plan_job_memory(x, t);
  };
  while (!plan_at(switch_at).classifier.streamed) ++switch_at;
  const double below = plan_at(switch_at - 1).total_bytes(), at = plan_at(switch_at).total_bytes();
  ASSERT_GT(below, at + 1e9) << "the plan must drop by more than 1 GB at b* = " << switch_at;
  const double drop_budget = at + 0.5e9;
  const int64_t best = max_batch_that_fits(in, t, drop_budget);
  EXPECT_FALSE(fits(in, switch_at - 1, t, drop_budget));
  EXPECT_GE(best, switch_at);
  EXPECT_EQ(best, scanned_largest_batch(in, t, drop_budget, 3 * best));
  // Nothing fits when the backbone alone does not.
  EXPECT_EQ(max_batch_that_fits(r50_eight_ranks(), t, 1e6), 0);
}

// The r50 bf16 channels-last step of the shipped GPU check report, read here on its own.
double report_rate(const std::string& network, const std::string& precision) {
  const YAML::Node js =
      YAML::LoadFile(std::string(FACESHARD_SOURCE_DIR) + "/docs/benchmarks/nvidia-h200_2026-11-26_run2.json");
  for (const YAML::Node& r : js["records"])
    if (r["who"].as<std::string>() == "faceshard" && r["network"].as<std::string>() == network &&
        r["precision"].as<std::string>() == precision && r["channels_last"].as<bool>())
      return r["images_per_s"].as<double>();
  return 0;
}

TEST(PlanTime, HoursAreTheScheduleOverTheMeasuredRate) {
  const JobSettings in = r50_eight_ranks();
  TimePlanInputs tin;
  tin.images = 42474557;
  tin.epochs = 20;
  const TimePlan p = plan_job_time(in, tin, StepRateTable::shipped());
  // By hand: 42,474,557 / 1,024 = 41,479.06 -> 41,479 whole steps an epoch, x 20.
  EXPECT_EQ(p.global_batch, 1024);
  EXPECT_EQ(p.steps_per_epoch, 41479);
  EXPECT_EQ(p.total_steps, 829580);
  const double rate = report_rate("r50", "bf16");
  ASSERT_GT(rate, 0);
  EXPECT_DOUBLE_EQ(p.images_per_s_per_gpu, rate);
  ASSERT_TRUE(p.rate);
  EXPECT_EQ(p.rate->card, "NVIDIA H200");
  EXPECT_NEAR(p.hours, 829580.0 * 1024 / (rate * 8) / 3600, 1e-9);
  EXPECT_EQ(p.gpus_per_host, 8);
  EXPECT_DOUBLE_EQ(p.decode_per_host, rate * 8);
  // optim.total_steps overrides the epochs; fp32 has no measured figure and says how to get one.
  tin.total_steps = 1000;
  EXPECT_NEAR(plan_job_time(in, tin, StepRateTable::shipped()).hours, 1000.0 * 1024 / (rate * 8) / 3600, 1e-12);
  JobSettings fp32 = in;
  fp32.precision = "fp32";
  const TimePlan none = plan_job_time(fp32, tin, StepRateTable::shipped());
  EXPECT_FALSE(none.rate);
  EXPECT_NE(none.rate_note.find("faceshard-bench --mode step"), std::string::npos) << none.rate_note;

  // The tool: the same figures in its JSON, a faceshard-bench step file read with --bench.
  testing::TempDir d;
  testing::write_text(d / "step.json",
                      "{\"mode\":\"step\",\"network\":\"r50\",\"device\":\"cuda:0\",\"world_size\":2,\"batch_per_rank\":128,"
                      "\"micro_batches\":1,\"classes\":1000000,\"precision\":\"bf16\",\"sample_rate\":0.2,"
                      "\"channels_last\":true,\"images_per_s\":5000}");
  auto r = testing::run_tool("faceshard-plan", "--network r50 --precision bf16 --batch 128 --ranks 8 --classes 2059906 "
                                               "--sample-rate 0.2 --images 42474557 --epochs 20 --device-memory 80GB "
                                               "--json " + d / "plan.json");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* s : {"largest batch per rank that fits", "hours:", "images/s to decode per host", "checkpoint:",
                        "NVIDIA H200"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  YAML::Node js = YAML::LoadFile(d / "plan.json");
  EXPECT_NEAR(js["time"]["hours"].as<double>(), 829580.0 * 1024 / (rate * 8) / 3600, 1e-6);
  EXPECT_EQ(js["time"]["total_steps"].as<int64_t>(), 829580);
  EXPECT_EQ(js["max_batch_per_rank"].as<int64_t>(), max_batch_that_fits(in, ActivationTable::shipped(), 80e9 - 1073741824.0));
  EXPECT_FALSE(js["lr_reminder"]) << "8 x 128 is base.yaml's global batch";
  r = testing::run_tool("faceshard-plan", "--network r50 --precision bf16 --batch 128 --ranks 16 --classes 2059906 "
                                          "--images 42474557 --bench " + d / "step.json" + " --json " + d / "b.json");
  ASSERT_EQ(r.status, 0) << r.output;
  js = YAML::LoadFile(d / "b.json");
  EXPECT_DOUBLE_EQ(js["time"]["images_per_s_per_gpu"].as<double>(), 2500);  // 5000 images/s over its 2 ranks
  EXPECT_EQ(js["time"]["global_batch"].as<int64_t>(), 2048);
  EXPECT_NEAR(js["time"]["hours"].as<double>(), 20.0 * (42474557 / 2048) * 2048 / (2500.0 * 16) / 3600, 1e-6);
  EXPECT_NE(js["lr_reminder"].as<std::string>().find("--set optim.lr=0.2"), std::string::npos) << r.output;
  // Bad values are one line with status 2.
  for (const char* args : {"--network r50 --classes 1M --images 0", "--network r50 --classes 1M --bench /nonexistent",
                           "--network r50 --classes 1M --images 1M --epochs -3"}) {
    const auto bad = testing::run_tool("faceshard-plan", args);
    EXPECT_EQ(bad.status, 2) << args << "\n" << bad.output;
    EXPECT_EQ(std::count(bad.output.begin(), bad.output.end(), '\n'), 1) << args << "\n" << bad.output;
  }
}

// BatchNorm's running statistics per network, from the networks as built.
// A network without a measured step in the job's precision: r50's figure in the same precision
// scaled by the MACs per image (insightface publishes 6.3 and 12.1 GFLOPs for r50 and r100:
// the ratio within 1%), said to be an estimate. The planned device memory of another card
// than the figures' gets one warning line; the card's own memory none.
TEST(PlanTime, UnmeasuredNetworkIsScaledByMacsAndSaidToBeAnEstimate) {
  JobSettings in = r50_eight_ranks();
  in.network = "r100";
  TimePlanInputs tin;
  tin.images = 5000000;
  tin.epochs = 2;
  const TimePlan p = plan_job_time(in, tin, StepRateTable::shipped());
  ASSERT_TRUE(p.rate);
  EXPECT_TRUE(p.estimated);
  EXPECT_EQ(p.rate->network, "r50");
  const double rate = report_rate("r50", "bf16");
  EXPECT_NEAR(p.images_per_s_per_gpu, rate * p.reference_macs / p.macs, 1e-9);
  EXPECT_NEAR(p.macs / p.reference_macs, 12.1 / 6.3, 0.01 * 12.1 / 6.3);
  EXPECT_NEAR(p.hours, double(p.total_steps) * 1024 / (p.images_per_s_per_gpu * 8) / 3600, 1e-9);
  EXPECT_NE(p.rate_note.find("an estimate: no measured step of r100 in bf16"), std::string::npos) << p.rate_note;
  // The measured network itself is no estimate.
  EXPECT_FALSE(plan_job_time(r50_eight_ranks(), tin, StepRateTable::shipped()).estimated);
  const StepRateTable rates = StepRateTable::shipped();
  ASSERT_GT(rates.card_memory_gib(), 100);
  EXPECT_NE(card_mismatch_warning(rates, 32510.0 * 1048576).find("is another card's"), std::string::npos);
  EXPECT_EQ(card_mismatch_warning(rates, rates.card_memory_gib() * 1073741824.0), "");
  EXPECT_EQ(card_mismatch_warning(StepRateTable::parse("{\"mode\":\"step\",\"network\":\"r50\",\"world_size\":1,"
                                                       "\"batch_per_rank\":128,\"precision\":\"bf16\",\"images_per_s\":100}",
                                                       "step.json"),
                                  32510.0 * 1048576),
            "")
      << "a bench file says no card memory: no warning";
  const auto r = testing::run_tool("faceshard-plan", "--network r100 --precision bf16 --batch 128 --ranks 8 --classes 2M "
                                                     "--images 5M --epochs 2 --device-memory 32510MiB");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* want : {"warning: the step figures are of NVIDIA H200 with", "speed: ", "an estimate: no measured step of r100",
                           ": an estimate"})
    EXPECT_NE(r.output.find(want), std::string::npos) << want << "\n" << r.output;
}

TEST(PlanCheckpoint, BufferTableIsTheBuiltNetworks) {
  // r2060, vit_l and vit_h (over 250M parameters) are left out for time: the same formulas.
  for (const std::string& net : backbone_names()) {
    if (net == "r2060" || net == "vit_l_dp005_mask_005" || net == "vit_h") continue;
    BackboneOptions o;
    o.name = net;
    const auto b = make_backbone(o);
    // Everything its state_dict holds beyond the trainable parameters' fp32 bytes.
    double bytes = 0, trainable = 0;
    for (const auto& kv : b->named_parameters(true)) {
      bytes += double(kv.value().nbytes());
      if (kv.value().requires_grad()) trainable += double(kv.value().numel());
    }
    for (const auto& kv : b->named_buffers(true)) bytes += double(kv.value().nbytes());
    EXPECT_DOUBLE_EQ(backbone_buffer_bytes(net), bytes - 4 * trainable) << net;
    const ActivationEntry* a = ActivationTable::shipped().find(net, "fp32", false);
    if (a) EXPECT_EQ(a->parameters, int64_t(trainable)) << net << ": the table's count is the trainable one";
  }
  EXPECT_EQ(backbone_buffer_bytes("r51"), -1);
}

// The checkpoint a short training writes, file by file, against the plan of the same job.
TEST(PlanCheckpoint, SizeIsTheFilesAShortTrainingWrites) {
  testing::TempDir d;
  const std::string out = d / "run";
  testing::write_text(d / "t.yaml", "output: " + out +
                                        "\ndata: {rec: synthetic, num_classes: 3000, batch_size: 4, num_workers: 1}\n"
                                        "model: {backbone: mbf_small}\n"
                                        "optim: {lr: 0.01, total_steps: 2}\n"
                                        "train: {verify_every: 0, tensorboard: false, precision: fp32, "
                                        "checkpoint_every: 2}\ndist: {device: cpu}\n");
  const testing::CommandResult r = testing::run_tool("faceshard-train", "--config '" + d / "t.yaml" + "' 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string step = out + "/checkpoints/step_00000002";
  ASSERT_TRUE(fs::exists(step + "/COMMITTED")) << r.output;
  JobSettings in;
  in.network = "mbf_small";
  in.precision = "fp32";
  in.batch_per_rank = 4;
  in.num_classes = 3000;
  const CheckpointPlan plan = plan_checkpoint(in, ActivationTable::shipped(), 3);
  ASSERT_EQ(plan.files.size(), 3u);
  const std::map<std::string, std::string> on_disk = {
      {"backbone.pt", step + "/backbone.pt"}, {"train_state.pt", step + "/train_state.pt"},
      {"fc_shard_0.pt", step + "/fc_shard_0.pt"}};
  double total = 0;
  for (const CheckpointFilePlan& f : plan.files) {
    ASSERT_TRUE(on_disk.count(f.name)) << f.name;
    const double bytes = double(fs::file_size(on_disk.at(f.name)));
    total += bytes;
    // The files' own headers (zip entries, the pickle) are what the plan does not count: a few
    // hundred bytes a tensor.
    EXPECT_LT(std::abs(bytes - f.bytes), 0.02 * f.bytes) << f.name << ": " << bytes << " B on disk, planned " << f.bytes;
  }
  EXPECT_LT(std::abs(total - plan.bytes), 0.01 * plan.bytes) << total << " B on disk, planned " << plan.bytes;
  EXPECT_DOUBLE_EQ(plan.model_bytes, plan.files[0].bytes);
  EXPECT_LT(std::abs(double(fs::file_size(out + "/model.pt")) - plan.model_bytes), 0.02 * plan.model_bytes);
}

// The ranks a preset's comments name ("8 ranks x 128", "x 4 ranks = 512", "32 ranks x
// 128", "64 ranks x 384"): the first in the file, else in its base's; 0 when none does.
int ranks_in_comments(const fs::path& file, int depth = 0) {
  std::ifstream in(file);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::smatch m;
  if (std::regex_search(text, m, std::regex("(\\d+) ranks"))) return std::stoi(m[1]);
  const YAML::Node y = YAML::Load(text);
  if (y["base"] && depth < 8) return ranks_in_comments(file.parent_path() / y["base"].as<std::string>(), depth + 1);
  return 0;
}

// A new preset is a YAML file and nothing else: its own comment line makes it one.
TEST(PlanLr, APresetIsAFileThatStatesItself) {
  testing::TempDir d;
  const std::string base = (fs::path(FACESHARD_SOURCE_DIR) / "configs" / "base.yaml").string();
  testing::write_text(d / "mine.yaml", "# My data set.\n# preset: ranks=16; data=Mine; images=1000; classes=10\nbase: " +
                                           base + "\ndata: {batch_size: 64}\n");
  const auto ref = lr_reference(d / "mine.yaml");
  ASSERT_TRUE(ref);
  EXPECT_EQ(ref->preset, "mine.yaml");
  EXPECT_EQ(ref->ranks, 16);
  EXPECT_EQ(ref->global_batch, 64 * 16);
  EXPECT_EQ(ref->dataset, "Mine");
  EXPECT_EQ(ref->images, 1000);
  EXPECT_EQ(ref->classes, 10);
  // A line that does not parse states nothing: the base's preset is the reference.
  testing::write_text(d / "bad.yaml", "# preset: ranks=sixteen\nbase: " + base + "\n");
  const auto fallback = lr_reference(d / "bad.yaml");
  ASSERT_TRUE(fallback);
  EXPECT_EQ(fallback->preset, "base.yaml");
  EXPECT_EQ(fallback->ranks, 8);
  EXPECT_EQ(fallback->images, 0);
}

TEST(PlanLr, EveryPresetIsKnownWithTheRanksItsCommentNames) {
  const fs::path configs = fs::path(FACESHARD_SOURCE_DIR) / "configs";
  int checked = 0;
  for (const auto& e : fs::directory_iterator(configs)) {
    if (e.path().extension() != ".yaml") continue;
    const std::string name = e.path().filename().string();
    const auto ref = lr_reference(e.path().string());
    ASSERT_TRUE(ref) << name;
    EXPECT_EQ(ref->preset, name);
    const Config c = load_config(e.path().string());
    if (c.optim.optimizer != "sgd" || name == "base.yaml" || name == "demo.yaml") continue;
    const int stated = ranks_in_comments(e.path());
    if (stated == 0) continue;  // its comments name no rank count (ms1mv3_r50, ms1mv3_r100)
    EXPECT_EQ(ref->ranks, stated) << name;
    EXPECT_EQ(ref->global_batch, c.data.batch_size * ref->ranks * c.optim.grad_accumulation) << name;
    checked++;
  }
  EXPECT_GE(checked, 13);
  // The published image counts the presets' comments give.
  EXPECT_EQ(lr_reference((configs / "wf42m_pfc02_r50.yaml").string())->images, 42474557);
  EXPECT_EQ(lr_reference((configs / "ms1mv3_r50_curricularface.yaml").string())->images, 5179510);
}

TEST(PlanLr, ReminderWhenTheGlobalBatchDiffers) {
  testing::TempDir d;
  const fs::path configs = fs::path(FACESHARD_SOURCE_DIR) / "configs";
  // A user's config on a preset: the preset's rate and batch are the reference.
  testing::write_text(d / "mine.yaml", "base: " + (configs / "wf42m_pfc02_r100.yaml").string() + "\n");
  const auto ref = lr_reference(d / "mine.yaml");
  ASSERT_TRUE(ref);
  EXPECT_EQ(ref->preset, "wf42m_pfc02_r100.yaml");
  EXPECT_EQ(ref->global_batch, 1024);
  EXPECT_EQ(lr_scaling_reminder(*ref, 1024, 0.1), "");
  const std::string two = lr_scaling_reminder(*ref, 2048, 0.1);
  EXPECT_NE(two.find("2 x the 1024"), std::string::npos) << two;
  EXPECT_NE(two.find("--set optim.lr=0.2"), std::string::npos) << two;
  EXPECT_NE(lr_scaling_reminder(*ref, 512, 0.1).find("--set optim.lr=0.05"), std::string::npos);
  // pfc03: 32 ranks x 128 at 0.4; on 8 ranks, 0.1.
  const auto p3 = lr_reference((configs / "wf42m_pfc03_r50.yaml").string());
  EXPECT_NE(lr_scaling_reminder(*p3, 1024, 0.4).find("--set optim.lr=0.1"), std::string::npos);
  // AdamW: not scaled, said so.
  auto vit = lr_reference((configs / "wf42m_pfc03_40epoch_8gpu_vit_t.yaml").string());
  EXPECT_NE(lr_scaling_reminder(*vit, 999, 0.001).find("not scaled"), std::string::npos);
  // No preset on the chain: no reference.
  testing::write_text(d / "alone.yaml", "data: {rec: synthetic, num_classes: 10}\n");
  EXPECT_FALSE(lr_reference(d / "alone.yaml"));
}

}  // namespace
}  // namespace faceshard
