// Fine-tuning a released model: the freeze keys (validated, key paths in errors), the
// stages a network can freeze, frozen parameters and BatchNorm statistics unchanged bit for
// bit while frozen (no weight decay, no momentum or AdamW state) and training after,
// the classifier training meanwhile, on one rank and two (DataParallel's buckets of frozen
// parameters never all-reduced), fused flat buffers against per-parameter steps, and the
// start-up lines (model.init, the learning rates, the freeze).
#include <gtest/gtest.h>

#include <fstream>
#include <regex>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "app/config/config.h"
#include "app/train/fine_tune.h"
#include "app/train/graphed_backbone.h"
#include "app/train/train_job.h"
#include "app/train/train_step.h"
#include "models/backbone_registry.h"
#include "models/torch_save/state_dict_io.h"
#include "partial_fc/distributed/dist_env.h"
#include "tests/harness.h"
#include "tests/test_errors.h"
#include "tests/test_files.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

// ---------------------------------------------------------------------------------------
// The keys

TEST(FineTuneConfig, KeysValidatedWithTheirPaths) {
  const std::string base = "data: {rec: synthetic, num_classes: 10}\n";
  const Config def = load_config_text(base, "f.yaml");
  EXPECT_EQ(def.optim.freeze_backbone_steps, 0);
  EXPECT_FALSE(def.optim.freeze_stages.has_value());
  EXPECT_FALSE(def.data.skip_bad);
  const std::string yaml = config_to_yaml(def);
  EXPECT_NE(yaml.find("freeze_backbone_steps: 0"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("freeze_stages: ~"), std::string::npos) << yaml;
  EXPECT_NE(yaml.find("skip_bad: false"), std::string::npos) << yaml;
  const Config on = load_config_text(base, "f.yaml",
                                     {"optim.freeze_backbone_steps=500", "optim.freeze_stages=2", "data.skip_bad=true"});
  EXPECT_EQ(on.optim.freeze_backbone_steps, 500);
  EXPECT_EQ(on.optim.freeze_stages.value_or(-1), 2);
  EXPECT_TRUE(on.data.skip_bad);
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"optim.freeze_backbone_steps=-1"}, "--set: key 'optim.freeze_backbone_steps': must be >= 0"},
      {{"optim.freeze_backbone_steps=2.5"}, "key 'optim.freeze_backbone_steps': expected an integer"},
      {{"optim.freeze_backbone_steps=5", "optim.freeze_stages=-1"}, "key 'optim.freeze_stages': must be >= 0"},
      {{"optim.freeze_stages=2"},
       "--set: key 'optim.freeze_stages': freezes nothing while optim.freeze_backbone_steps is 0"},
      {{"data.skip_bad=maybe"}, "key 'data.skip_bad': expected true or false"},
      {{"optim.freeze_steps=3"}, "unknown key 'optim.freeze_steps'"},
  };
  for (const auto& [sets, want] : bad) {
    const std::string msg = error_of([&] { load_config_text(base, "f.yaml", sets); });
    EXPECT_NE(msg.find(want), std::string::npos) << sets.back() << ": " << msg;
  }
  // How many stages a network has is checked with the network (faceshard-config does too).
  auto model_error = [&](const std::string& net, int stages) {
    const Config c = load_config_text(base + "model: {backbone: " + net + "}\noptim: {freeze_backbone_steps: 5, freeze_stages: " +
                                          std::to_string(stages) + "}\n",
                                      "m.yaml");
    return error_of([&] { check_model_config(c); });
  };
  EXPECT_EQ(model_error("r50", 4), "<no error>");
  EXPECT_EQ(model_error("mbf_small", 0), "<no error>");
  EXPECT_EQ(model_error("vit_t", 12), "<no error>");
  EXPECT_NE(model_error("r50", 5).find("m.yaml:3: key 'optim.freeze_stages': 5 but r50 has 4 stages; leave "
                                       "optim.freeze_stages out to freeze the whole backbone"),
            std::string::npos)
      << model_error("r50", 5);
  EXPECT_NE(model_error("vit_t", 13).find("13 but vit_t has 12 blocks"), std::string::npos) << model_error("vit_t", 13);
}

// Every trainable tensor of each family lies in exactly one part (stem, a stage, or the
// head after them), and the parts follow the network's registration order: stem, stage 1,
// ..., head. Checked against hand-written names of each family's first layers.
TEST(FineTuneStages, PartsCoverTheNetworkInOrder) {
  for (const std::string net : {"r18", "mbf_small", "vit_t"}) {
    BackboneOptions o;
    o.name = net;
    auto model = make_backbone(o);
    const auto parts = backbone_stage_prefixes(net);
    ASSERT_GE(parts.size(), 5u) << net;
    int last = 0;
    std::vector<int> per_part(parts.size() + 1, 0);
    for (const auto& np : model->named_parameters()) {
      int part = static_cast<int>(parts.size());  // the head
      for (size_t s = 0; s < parts.size(); ++s) {
        if (!under_prefix(np.key(), parts[s])) continue;
        EXPECT_EQ(part, static_cast<int>(parts.size())) << net << ": " << np.key() << " in two parts";
        part = static_cast<int>(s);
      }
      EXPECT_GE(part, last) << net << ": " << np.key() << " out of order";
      last = part;
      per_part[part]++;
    }
    for (size_t s = 0; s < per_part.size(); ++s) EXPECT_GT(per_part[s], 0) << net << " part " << s;
  }
  EXPECT_TRUE(under_prefix("conv1.weight", backbone_stage_prefixes("r50")[0]));
  EXPECT_TRUE(under_prefix("prelu.weight", backbone_stage_prefixes("r50")[0]));
  EXPECT_FALSE(under_prefix("layer1.0.prelu.weight", backbone_stage_prefixes("r50")[0]));
  EXPECT_TRUE(under_prefix("layers.3.layers.0.layers.0.conv.weight", backbone_stage_prefixes("mbf")[2]));
  EXPECT_FALSE(under_prefix("blocks.10.norm1.weight", backbone_stage_prefixes("vit_t")[2]));  // blocks.1
  EXPECT_TRUE(under_prefix("pos_embed", backbone_stage_prefixes("vit_t")[0]));
}

// ---------------------------------------------------------------------------------------
// Training with a frozen part

constexpr int64_t kBatch = 8, kClasses = 16;

std::string job_yaml(const std::string& out, bool fused, const std::string& optimizer, int64_t freeze_steps,
                     int64_t stages) {
  std::ostringstream y;
  y << "output: " << out << "\nseed: 7\ndata:\n  rec: synthetic\n  num_classes: " << kClasses << "\n  batch_size: " << kBatch
    << "\n  num_workers: 1\nmodel:\n  backbone: mbf_small\n  embedding_size: 64\n  channels_last: false\n"
    << "optim:\n  optimizer: " << optimizer << "\n  lr: " << (optimizer == "sgd" ? 0.1 : 0.001)
    << "\n  momentum: 0.9\n  weight_decay: 0.01\n  total_steps: 50\n  warmup_steps: 0\n  grad_clip: 5.0\n  fused: "
    << (fused ? "true" : "false") << "\n  freeze_backbone_steps: " << freeze_steps << "\n";
  if (stages >= 0) y << "  freeze_stages: " << stages << "\n";
  y << "train:\n  precision: fp32\n  verify_every: 0\n  tensorboard: false\ndist:\n  device: cpu\n";
  return y.str();
}

// mbf_small's stem and stages 1-2, written out (not from backbone_stage_prefixes).
bool in_first_two_stages(const std::string& name) {
  for (const char* p : {"layers.0.", "layers.1.", "layers.2.", "layers.3."})
    if (name.rfind(p, 0) == 0) return true;
  return false;
}

std::map<std::string, at::Tensor> snapshot(const Backbone& b) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, t] : b.state_dict()) out[name] = t.detach().clone();
  return out;
}

struct RunRecord {
  std::vector<std::map<std::string, at::Tensor>> backbone;  // before step 1, after each step
  std::vector<at::Tensor> fc;
  std::vector<std::vector<std::string>> state_names;
  std::vector<int> launched;  // buckets all-reduced per step (W > 1)
  int buckets = 0;
  std::vector<std::string> trainable;  // names of the optimiser's params, in its order
  std::map<std::string, double> final_counts;  // AdamW's "step.<i>" after the last step
};

// `steps` steps of a job on this rank, batches drawn from (step, rank).
RunRecord run_job(Distributed& d, const std::string& yaml, int64_t steps) {
  Config cfg = load_config_text(yaml, "ft.yaml");
  TrainJob job = build_train_job(cfg, std::shared_ptr<Distributed>(&d, [](Distributed*) {}));
  job.backbone->train();
  RunRecord rec;
  rec.buckets = job.ddp->num_buckets();
  std::map<const void*, std::string> names;
  for (const auto& np : job.backbone->named_parameters()) names[np.value().unsafeGetTensorImpl()] = np.key();
  for (const auto& p : job.backbone_params) rec.trainable.push_back(names[p.unsafeGetTensorImpl()]);
  rec.backbone.push_back(snapshot(*job.backbone));
  rec.fc.push_back(job.fc->weight().detach().clone());
  TrainStep step(job);
  for (int64_t k = 0; k < steps; ++k) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(9000 + k * 16 + d.rank());
    Batch b;
    b.images = at::randn({kBatch, 3, 112, 112}, gen);
    b.labels = at::randint(0, kClasses, {kBatch}, gen, torch::kLong);
    StepResult r = step.run([&] { return b; }, k);
    EXPECT_TRUE(std::isfinite(r.loss.item<double>()));
    rec.backbone.push_back(snapshot(*job.backbone));
    rec.fc.push_back(job.fc->weight().detach().clone());
    std::vector<std::string> state;
    for (const auto& kv : job.opt->state()) state.push_back(kv.first);
    rec.state_names.push_back(state);
    rec.launched.push_back(static_cast<int>(job.ddp->last_step().launch_ms.size()));
  }
  for (const auto& kv : job.opt->state())
    if (kv.first.rfind("step.", 0) == 0) rec.final_counts[kv.first] = kv.second.item<double>();
  return rec;
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) { return torch::equal(a, b); }

// Freeze for `frozen` steps (stages: -1 the whole backbone), then train; checks everything
// the record can show. Returns the record (for the fused/per-parameter comparison).
RunRecord check_freeze(Distributed& d, const std::string& dir, bool fused, const std::string& optimizer, int64_t frozen,
                       int64_t stages, int64_t steps) {
  const RunRecord rec = run_job(d, job_yaml(dir, fused, optimizer, frozen, stages), steps);
  auto covered = [&](const std::string& name) { return stages < 0 || in_first_two_stages(name); };
  const std::string what = std::string(fused ? "fused " : "per-parameter ") + optimizer + " W" +
                           std::to_string(d.world_size());
  for (int64_t k = 1; k <= steps; ++k) {
    const auto& now = rec.backbone[k];
    const auto& before = rec.backbone[k - 1];
    const bool frozen_step = k <= frozen;
    int moved_trained = 0, moved_frozen = 0, frozen_tensors = 0;
    for (const auto& [name, t] : now) {
      if (!covered(name)) {
        moved_trained += !same_bits(t, before.at(name));
        continue;
      }
      frozen_tensors++;
      if (frozen_step) {
        // Parameters and BatchNorm statistics alike: not one bit moves while frozen.
        EXPECT_TRUE(same_bits(t, rec.backbone[0].at(name))) << what << ": " << name << " moved at frozen step " << k;
      } else if (name.find("num_batches_tracked") == std::string::npos) {
        moved_frozen += !same_bits(t, before.at(name));
      }
    }
    EXPECT_GT(frozen_tensors, 0);
    if (stages >= 0) {
      EXPECT_GT(moved_trained, 0) << what << ": nothing trained at step " << k;
    }
    if (!frozen_step) {
      EXPECT_GT(moved_frozen, frozen_tensors / 2) << what << ": the thawed part did not train at step " << k;
    }
    // The classifier trains all along.
    EXPECT_FALSE(same_bits(rec.fc[k], rec.fc[k - 1])) << what << ": classifier still at step " << k;
    // No optimiser state for a frozen parameter until it thaws (no momentum accumulation).
    std::set<std::string> state(rec.state_names[k - 1].begin(), rec.state_names[k - 1].end());
    for (size_t i = 0; i < rec.trainable.size(); ++i) {
      const std::string key = (optimizer == "sgd" ? "momentum." : "exp_avg.") + std::to_string(i);
      const bool want = !(covered(rec.trainable[i]) && frozen_step);
      EXPECT_EQ(state.count(key) == 1, want) << what << ": " << key << " (" << rec.trainable[i] << ") at step " << k;
    }
    if (d.world_size() > 1) {
      // Frozen buckets are not all-reduced; every bucket is once the backbone thaws.
      if (frozen_step) {
        EXPECT_LT(rec.launched[k - 1], rec.buckets) << what << " step " << k;
      } else {
        EXPECT_EQ(rec.launched[k - 1], rec.buckets) << what << " step " << k;
      }
      if (frozen_step && stages < 0) {
        EXPECT_EQ(rec.launched[k - 1], 0) << what << " step " << k;
      }
      // DataParallel keeps the ranks' backbones equal.
      for (const auto& [name, t] : now) {
        if (name.find("running") != std::string::npos || name.find("num_batches") != std::string::npos) continue;
        at::Tensor all = d.all_gather(t.reshape({1, -1}).contiguous());
        EXPECT_TRUE(torch::equal(all[0], all[1])) << what << ": ranks differ in " << name << " at step " << k;
      }
    }
  }
  // AdamW's step count of a thawed parameter starts at the thaw, as torch.optim's state of
  // a parameter that first gets a gradient: steps - frozen, the others' steps.
  if (optimizer == "adamw") {
    for (size_t i = 0; i < rec.trainable.size(); ++i) {
      const std::string key = "step." + std::to_string(i);
      if (!rec.final_counts.count(key)) {
        ADD_FAILURE() << what << ": no " << key;
        continue;
      }
      EXPECT_EQ(rec.final_counts.at(key), static_cast<double>(covered(rec.trainable[i]) ? steps - frozen : steps))
          << what << ": " << key << " (" << rec.trainable[i] << ")";
    }
  }
  return rec;
}

void freeze_cases(Distributed& d, const std::string& dir) {
  for (const std::string opt : {"sgd", "adamw"}) {
    const RunRecord fused = check_freeze(d, dir + "/f_" + opt, true, opt, 3, 2, 5);
    const RunRecord plain = check_freeze(d, dir + "/p_" + opt, false, opt, 3, 2, 5);
    // The flat buffers' one kernel per group against torch.optim's per-parameter semantics
    // (a frozen parameter's state starts when it thaws): the same SGD trajectory. (AdamW's
    // is not comparable this way: biases of a BatchNorm that another BatchNorm follows get
    // rounding noise for gradient, which AdamW scales to +-lr; its step counts are checked
    // against their closed form above.)
    if (opt != "sgd") continue;
    // On one rank the two are bit for bit the same through the freeze, the thaw and after.
    // On two, the ranks' gradients meet in all-reduces whose rounding differs by a last
    // bit from the second step on, and this small random-label problem at lr 0.1 magnifies
    // that some 30 times a step: compared through the frozen steps there.
    const size_t last = d.world_size() == 1 ? plain.backbone.size() - 1 : 3;
    for (size_t k = 1; k <= last; ++k)
      for (const auto& [name, t] : plain.backbone[k]) {
        if (!t.is_floating_point()) continue;
        const double diff = (fused.backbone[k].at(name) - t).abs().max().item<double>();
        EXPECT_LE(diff, d.world_size() == 1 ? 0.0 : 1e-5) << name << " after step " << k;
      }
  }
  check_freeze(d, dir + "/whole", true, "sgd", 2, -1, 3);
}

TEST(FineTune, FrozenPartUnchangedBitForBitThenTrainsOneRank) {
  const std::string dir = testing::temp_dir("freeze1");
  testing::run_ranks(1, [&](Distributed& d) { freeze_cases(d, dir); });
}

TEST(FineTune, FrozenPartUnchangedBitForBitThenTrainsTwoRanks) {
  const std::string dir = testing::temp_dir("freeze2");
  testing::RankOptions ro;
  ro.env.emplace_back("FS_FREEZE_DIR", dir);
  testing::run_ranks(2, [&](Distributed& d) {
    const char* shared = std::getenv("FS_FREEZE_DIR");
    freeze_cases(d, shared ? shared : dir);
  }, ro);
}

// CUDA graphs capture one backward; a freeze changes it when the backbone thaws, so the
// steps run eagerly with one line saying why.
TEST(FineTune, CudaGraphsRefusedWhileFreezing) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  testing::TempDir dir;
  DistEnv env;
  env.master_port = 20000 + static_cast<int>((::getpid() + 11) % 20000);
  DistOptions o;
  o.use_cuda = true;
  std::shared_ptr<Distributed> dist = Distributed::init(env, o);
  std::string yaml = job_yaml(dir.path, true, "sgd", 2, 1);
  yaml.replace(yaml.find("device: cpu"), 11, "device: cuda");
  yaml.replace(yaml.find("train:\n"), 7, "train:\n  cuda_graph: true\n");
  const Config cfg = load_config_text(yaml, "g.yaml");
  TrainJob job = build_train_job(cfg, dist);
  make_backbone_run(job);
  const GraphStatus s = job.graph_status();
  EXPECT_TRUE(s.asked);
  EXPECT_FALSE(s.captured);
  EXPECT_EQ(s.reason, "optim.freeze_backbone_steps changes which parameters the backward reaches when the backbone thaws");
}

// ---------------------------------------------------------------------------------------
// The start-up lines

TEST(FineTuneLog, InitLoadSaysFileNetworkAndTensors) {
  testing::TempDir d;
  BackboneOptions o;
  o.name = "mbf_small";
  o.embedding_size = 64;
  auto source = make_backbone(o);
  save_backbone_weights(*source, d / "w.pt");
  auto target = make_backbone(o);
  const StateDictLoad load = load_backbone_weights(*target, d / "w.pt");
  const StateDict sd = target->state_dict();
  int64_t numbers = 0;
  for (const auto& kv : sd) numbers += kv.second.numel();
  EXPECT_EQ(load.tensors, sd.size());
  EXPECT_EQ(load.parameters, target->parameters().size());
  EXPECT_EQ(load.numbers, numbers);
  EXPECT_TRUE(load.absent_counters.empty());
  EXPECT_EQ(load.stripped_prefix, "");
  for (const auto& kv : sd) EXPECT_TRUE(torch::equal(kv.second, source->state_dict()[&kv - &sd[0]].second)) << kv.first;
  const std::string line = describe_load(*target, d / "w.pt", load);
  EXPECT_EQ(line.rfind(d / "w.pt" + ": " + std::to_string(sd.size()) + " tensors (" +
                           std::to_string(target->parameters().size()) + " parameters, ",
                       0),
            0u)
      << line;
  EXPECT_NE(line.find("M numbers) into mbf_small, embedding size 64; none missing or unexpected"), std::string::npos)
      << line;
  // A DDP file ("module." keys) of an old PyTorch (no num_batches_tracked).
  StateDict ddp;
  size_t counters = 0;
  for (const auto& kv : source->state_dict()) {
    if (kv.first.find("num_batches_tracked") != std::string::npos) {
      counters++;
      continue;
    }
    ddp.emplace_back("module." + kv.first, kv.second);
  }
  write_state_dict(ddp, d / "ddp.pt");
  const StateDictLoad old = load_backbone_weights(*target, d / "ddp.pt");
  EXPECT_EQ(old.stripped_prefix, "module.");
  EXPECT_EQ(old.absent_counters.size(), counters);
  EXPECT_EQ(old.tensors, sd.size() - counters);
  const std::string old_line = describe_load(*target, d / "ddp.pt", old);
  EXPECT_NE(old_line.find("(" + std::to_string(counters) + " BatchNorm num_batches_tracked counters absent from the file"),
            std::string::npos)
      << old_line;
  EXPECT_NE(old_line.find("keys' 'module.' prefix (DDP) stripped"), std::string::npos) << old_line;
}

TEST(FineTuneLog, LearningRatesLineShowsBothAndWhereTheClassifiersComesFrom) {
  const std::string base = "data: {rec: synthetic, num_classes: 10}\n";
  const Config same = load_config_text(base, "l.yaml", {"optim.lr=0.02"});
  EXPECT_EQ(describe_learning_rates(same.optim),
            "learning rates: backbone 0.02 (sgd, momentum 0.9, weight decay 0.0005), classifier 0.02 (sgd, momentum "
            "0.9, weight decay 0.0005); the classifier's is optim.lr (optim.fc_lr unset)");
  const Config apart = load_config_text(
      base, "l.yaml",
      {"optim.lr=0.00001", "optim.fc_lr=0.1", "optim.optimizer=adamw", "optim.weight_decay=0.05",
       "optim.fc_optimizer=sgd", "optim.freeze_backbone_steps=200"});
  EXPECT_EQ(describe_learning_rates(apart.optim),
            "learning rates: backbone 1e-05 (adamw, weight decay 0.05), classifier 0.1 (sgd, momentum 0.9, weight "
            "decay 0.05); optim.fc_lr sets the classifier's; the frozen part of the backbone takes no step for the "
            "first 200 steps");
}

// faceshard-train's own lines: what model.init loaded, both learning rates, the freeze and
// the thaw, and the frozen stem unchanged in the exported model.
TEST(FineTuneLog, TrainerPrintsInitLearningRatesFreezeAndThaw) {
  testing::TempDir d;
  BackboneOptions o;
  o.name = "mbf_small";
  o.embedding_size = 64;
  auto released = make_backbone(o);
  save_backbone_weights(*released, d / "backbone.pth");
  const std::string out = d / "run";
  testing::write_text(d / "ft.yaml", "output: " + out +
                                         "\ndata: {rec: synthetic, num_classes: 20, batch_size: 4, num_workers: 1}\n"
                                         "model: {backbone: mbf_small, embedding_size: 64, init: " +
                                         d / "backbone.pth" +
                                         "}\noptim: {lr: 0.01, fc_lr: 0.5, total_steps: 3, freeze_backbone_steps: 2, "
                                         "freeze_stages: 1}\ntrain: {verify_every: 0, tensorboard: false, "
                                         "precision: fp32}\ndist: {device: cpu}\n");
  const testing::CommandResult r = testing::run_tool("faceshard-train", "--config '" + d / "ft.yaml" + "' 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  const size_t tensors = released->state_dict().size();
  for (const std::string& want :
       {"model.init: " + d / "backbone.pth" + ": " + std::to_string(tensors) + " tensors (",
        std::string("into mbf_small, embedding size 64; none missing or unexpected; the classifier starts fresh"),
        std::string("learning rates: backbone 0.01 (sgd, momentum 0.9, weight decay 0.0005), classifier 0.5 (sgd, "
                    "momentum 0.9, weight decay 0.0005); optim.fc_lr sets the classifier's; the frozen part"),
        std::string("fine-tuning: the stem and stage 1 of mbf_small ("),
        std::string(" tensors) frozen until step 2: no update, and its BatchNorm statistics stay as loaded"),
        std::string("fine-tuning: after 2 frozen steps the whole backbone trains from step 3")})
    EXPECT_NE(r.output.find(want), std::string::npos) << want << "\n---\n" << r.output;
}

// The background checkpoint's staging is decided at the start for the whole run: a run
// resumed while its backbone is still frozen holds momentum for the trained part only, and
// the frozen part's arrives at the thaw. The staging a rank it plans equals a fresh start's
// (which counts every parameter's momentum before the first step).
TEST(FineTuneLog, StagingPlannedAtAFrozenResumeCountsTheMomentumOfTheThaw) {
  testing::TempDir d;
  const std::string out = d / "run";
  testing::write_text(d / "ft.yaml", "output: " + out +
                                         "\ndata: {rec: synthetic, num_classes: 20, batch_size: 4, num_workers: 1}\n"
                                         "model: {backbone: mbf_small, embedding_size: 64}\n"
                                         "optim: {lr: 0.01, total_steps: 4, freeze_backbone_steps: 3, freeze_stages: 1}\n"
                                         "train: {verify_every: 0, tensorboard: false, precision: fp32, checkpoint_every: 1, "
                                         "checkpoint_async: on}\ndist: {device: cpu}\n");
  const testing::CommandResult a =
      testing::run_tool("faceshard-train", "--config '" + d / "ft.yaml" + "' --set train.max_steps=1 2>&1");
  ASSERT_EQ(a.status, 0) << a.output;
  const testing::CommandResult b = testing::run_tool("faceshard-train", "--config '" + d / "ft.yaml" + "' --resume 2>&1");
  ASSERT_EQ(b.status, 0) << b.output;
  ASSERT_NE(b.output.find("resumed from"), std::string::npos) << b.output;
  const std::regex staging("staging (\\S+ \\S+) a rank");
  std::smatch ma, mb;
  ASSERT_TRUE(std::regex_search(a.output, ma, staging)) << a.output;
  ASSERT_TRUE(std::regex_search(b.output, mb, staging)) << b.output;
  EXPECT_EQ(mb[1].str(), ma[1].str()) << "the fresh start planned " << ma[1] << ", the frozen resume " << mb[1];
}

// optim.thaw_warmup_steps: the backbone's rate in metrics.jsonl, divided by the same run's
// without it, is 1 while frozen, k/N over the N steps after the thaw, then 1; the
// classifier's rate is the same in both; the key without a freeze is refused naming it.
TEST(FineTuneLog, ThawWarmupRaisesTheBackboneRateAfterTheThaw) {
  testing::TempDir d;
  auto run = [&](const std::string& name, const std::string& extra) {
    testing::write_text(d / (name + ".yaml"),
                        "output: " + d / name +
                            "\ndata: {rec: synthetic, num_classes: 20, batch_size: 4, num_workers: 1}\n"
                            "model: {backbone: mbf_small, embedding_size: 64}\n"
                            "optim: {lr: 0.01, total_steps: 7, warmup_steps: 0, freeze_backbone_steps: 2" + extra +
                            "}\ntrain: {verify_every: 0, tensorboard: false, precision: fp32, log_every: 1, "
                            "checkpoint_every: 0}\ndist: {device: cpu}\n");
    const testing::CommandResult r = testing::run_tool("faceshard-train", "--config '" + d / (name + ".yaml") + "' 2>&1");
    EXPECT_EQ(r.status, 0) << r.output;
    std::map<int64_t, std::pair<double, double>> lr;  // step -> (lr, fc_lr)
    std::ifstream f(d / name + "/metrics.jsonl");
    const std::regex row("\"step\": ?([0-9]+).*\"lr\": ?([-0-9.e+]+).*\"fc_lr\": ?([-0-9.e+]+)");
    std::smatch m;
    for (std::string line; std::getline(f, line);)
      if (std::regex_search(line, m, row)) lr[std::stoll(m[1])] = {std::stod(m[2]), std::stod(m[3])};
    return std::make_pair(lr, r.output);
  };
  const auto [plain, plain_log] = run("plain", "");
  const auto [warm, warm_log] = run("warm", ", thaw_warmup_steps: 3");
  ASSERT_EQ(plain.size(), 7u) << plain_log;
  ASSERT_EQ(warm.size(), 7u) << warm_log;
  const double want[] = {1, 1, 1.0 / 3, 2.0 / 3, 1, 1, 1};  // steps 1-7 (1-based): frozen 1-2
  for (int64_t s = 1; s <= 7; ++s) {
    EXPECT_NEAR(warm.at(s).first / plain.at(s).first, want[s - 1], 1e-9) << "step " << s;
    EXPECT_EQ(warm.at(s).second, plain.at(s).second) << "step " << s << ": the classifier's rate changed";
  }
  EXPECT_NE(warm_log.find("rises from 1/3 to all of it over 3 steps (optim.thaw_warmup_steps)"), std::string::npos)
      << warm_log;
  testing::write_text(d / "bad.yaml", "data: {rec: synthetic, num_classes: 20}\noptim: {thaw_warmup_steps: 3}\n");
  const testing::CommandResult bad = testing::run_tool("faceshard-config", "--config '" + d / "bad.yaml" + "' 2>&1");
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_NE(bad.output.find("key 'optim.thaw_warmup_steps': there is no thaw while optim.freeze_backbone_steps is 0"),
            std::string::npos)
      << bad.output;
}

}  // namespace
}  // namespace faceshard
