// Config system: inheritance order, --set overrides, and one-line errors naming file and key.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "tests/test_paths.h"
#include "app/config/config.h"
#include "partial_fc/classifier/head_catalogue.h"
#include "app/train/train_job.h"
#include "app/plan/job_memory_plan.h"
#include "models/backbone_registry.h"
#include "partial_fc/classifier/partial_fc.h"
#include "base/error.h"
#include "tests/harness.h"
#include "tests/test_errors.h"

namespace faceshard {
namespace {

namespace fs = std::filesystem;

struct ConfigFiles {
  std::string dir = testing::temp_dir("config");
  std::string write(const std::string& name, const std::string& text) {
    std::string p = dir + "/" + name;
    fs::create_directories(fs::path(p).parent_path());
    std::ofstream(p) << text;
    return p;
  }
  ~ConfigFiles() { fs::remove_all(dir); }
};

// Runs f, expects a faceshard::Error with exit status 2 whose one-line message contains
// every fragment.
template <typename F>
void expect_usage_error(F&& f, const std::vector<std::string>& fragments) {
  try {
    f();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_EQ(e.exit_code(), 2) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const auto& frag : fragments) EXPECT_NE(msg.find(frag), std::string::npos) << "'" << frag << "' not in: " << msg;
  }
}

// Every key of the schema (Config::visit).
class KeyLister : public FieldVisitor {
 public:
  std::vector<std::string> keys;
  void field(const std::string& p, std::string&, const FieldSpec&) override { keys.push_back(p); }
  void field(const std::string& p, int64_t&, const FieldSpec&) override { keys.push_back(p); }
  void field(const std::string& p, double&, const FieldSpec&) override { keys.push_back(p); }
  void field(const std::string& p, bool&, const FieldSpec&) override { keys.push_back(p); }
  void field(const std::string& p, std::vector<std::string>&, const FieldSpec&) override { keys.push_back(p); }
  void field(const std::string& p, std::vector<double>&, const FieldSpec&) override { keys.push_back(p); }
  void field(const std::string& p, std::optional<std::string>&, const FieldSpec&) override { keys.push_back(p); }
  void field(const std::string& p, std::optional<int64_t>&, const FieldSpec&) override { keys.push_back(p); }
  void field(const std::string& p, std::optional<double>&, const FieldSpec&) override { keys.push_back(p); }
  void field(const std::string& p, std::optional<bool>&, const FieldSpec&) override { keys.push_back(p); }
};

// docs/configuration.md lists every key of the schema, and no other (the heads' parameters,
// loss.<head>.<param>, are the head catalogue's: faceshard-head --list prints them).
TEST(Config, ReferenceDocsListEveryKey) {
  Config cfg;
  KeyLister lister;
  cfg.visit(lister);
  std::set<std::string> schema;
  for (const std::string& k : lister.keys) {
    const size_t dot = k.find('.'), second = k.find('.', dot + 1);
    if (k.rfind("loss.", 0) == 0 && second != std::string::npos && find_head_info(k.substr(dot + 1, second - dot - 1)))
      continue;
    schema.insert(k);
  }
  std::set<std::string> documented;
  std::istringstream doc(testing::read_text(std::string(FACESHARD_SOURCE_DIR) + "/docs/configuration.md"));
  for (std::string line; std::getline(doc, line);)
    if (line.rfind("| `", 0) == 0) documented.insert(line.substr(3, line.find('`', 3) - 3));
  for (const std::string& k : schema) EXPECT_TRUE(documented.count(k)) << "docs/configuration.md lacks '" << k << "'";
  for (const std::string& k : documented) EXPECT_TRUE(schema.count(k)) << "docs/configuration.md lists '" << k << "', no key";
  EXPECT_GT(schema.size(), 60u);
}

TEST(Config, DefaultsAndRequiredKey) {
  Config c = load_config_text("data:\n  num_classes: 10\n", "mem.yaml");
  EXPECT_EQ(c.data.num_classes, 10);
  EXPECT_EQ(c.model.backbone, "r50");
  EXPECT_DOUBLE_EQ(c.optim.lr, 0.1);
  EXPECT_EQ(c.loss.margin, (std::vector<double>{1.0, 0.5, 0.0}));
  // The data's counts are the data's: unset unless a config names them.
  const Config d = load_config_text("model:\n  backbone: r18\n", "mem.yaml");
  EXPECT_FALSE(d.data.num_classes.has_value());
  EXPECT_FALSE(d.data.num_images.has_value());
  EXPECT_EQ(d.data.spare_classes, 0);
  expect_usage_error([] { load_config_text("data:\n  spare_classes: -1\n", "mem.yaml"); },
                     {"mem.yaml", "data.spare_classes"});
}

TEST(Config, PrecisionAutoIsBf16WhereTheDeviceHasIt) {
  const Config c = load_config_text("data:\n  num_classes: 10\n", "mem.yaml");
  EXPECT_EQ(c.train.precision, "auto");
  EXPECT_TRUE(c.train.tf32);
  EXPECT_EQ(resolve_precision("auto", true), "bf16");
  EXPECT_EQ(resolve_precision("auto", false), "fp32");
  for (const char* p : {"fp32", "bf16", "fp16"}) {
    EXPECT_EQ(resolve_precision(p, true), p);
    EXPECT_EQ(resolve_precision(p, false), p);
  }
  EXPECT_FALSE(device_has_bf16(torch::kCPU));
  // A plan is made for a GPU: auto plans bf16's activations.
  EXPECT_EQ(job_settings(c, 1).precision, "bf16");
  EXPECT_EQ(job_settings(load_config_text("data:\n  num_classes: 10\ntrain:\n  precision: fp32\n", "m.yaml"), 1).precision,
            "fp32");
}

TEST(Config, InheritanceLaterKeysOverride) {
  ConfigFiles f;
  f.write("base.yaml", "data:\n  num_classes: 100\n  batch_size: 64\noptim:\n  lr: 0.1\n  epochs: 20\n");
  f.write("presets/mid.yaml", "base: ../base.yaml\noptim:\n  lr: 0.2\nmodel:\n  backbone: r100\n");
  std::string top = f.write("job.yaml", "base: presets/mid.yaml\noptim:\n  epochs: 5\n");
  Config c = load_config(top);
  EXPECT_EQ(c.data.num_classes, 100);
  EXPECT_EQ(c.data.batch_size, 64);
  EXPECT_DOUBLE_EQ(c.optim.lr, 0.2);  // mid overrides base
  EXPECT_EQ(c.optim.epochs, 5);       // job overrides base
  EXPECT_EQ(c.model.backbone, "r100");
  // Several bases: later ones win.
  f.write("a.yaml", "data:\n  num_classes: 1\n  batch_size: 8\n");
  f.write("b.yaml", "data:\n  num_classes: 2\n");
  Config c2 = load_config(f.write("ab.yaml", "base: [a.yaml, b.yaml]\n"));
  EXPECT_EQ(c2.data.num_classes, 2);
  EXPECT_EQ(c2.data.batch_size, 8);
}

TEST(Config, SetOverridesWin) {
  ConfigFiles f;
  std::string top = f.write("job.yaml", "data:\n  num_classes: 100\n  val_targets: [lfw]\n");
  Config c = load_config(top, {"optim.lr=0.05", "data.val_targets=[lfw, cfp_fp]", "train.precision=bf16",
                               "model.sync_bn=true", "loss.margin=[1.0, 0.0, 0.4]"});
  EXPECT_DOUBLE_EQ(c.optim.lr, 0.05);
  EXPECT_EQ(c.data.val_targets, (std::vector<std::string>{"lfw", "cfp_fp"}));
  EXPECT_EQ(c.train.precision, "bf16");
  EXPECT_TRUE(c.model.sync_bn);
  EXPECT_DOUBLE_EQ(c.loss.margin[2], 0.4);
  expect_usage_error([&] { load_config(top, {"optim.lr"}); }, {"--set 'optim.lr'", "key.path=value"});
  expect_usage_error([&] { load_config(top, {"optim.lrr=1"}); }, {"--set", "unknown key 'optim.lrr'"});
  expect_usage_error([&] { load_config(top, {"optim.lr=fast"}); }, {"--set", "optim.lr", "expected a number"});
}

TEST(Config, UnknownKeyNamesFileAndPath) {
  ConfigFiles f;
  f.write("base.yaml", "data:\n  num_classes: 100\n");
  std::string top = f.write("job.yaml", "base: base.yaml\noptim:\n  learning_rate: 0.1\n");
  expect_usage_error([&] { load_config(top); }, {"job.yaml", "unknown key 'optim.learning_rate'"});
  // A misplaced key gets a hint.
  std::string misplaced = f.write("mis.yaml", "base: base.yaml\ntrain:\n  lr: 0.1\n");
  expect_usage_error([&] { load_config(misplaced); }, {"mis.yaml", "unknown key 'train.lr'", "optim.lr"});
  // The unknown key is blamed on the file that wrote it, here the base.
  f.write("bad_base.yaml", "data:\n  num_classes: 100\n  colour: red\n");
  std::string child = f.write("child.yaml", "base: bad_base.yaml\n");
  expect_usage_error([&] { load_config(child); }, {"bad_base.yaml", "unknown key 'data.colour'"});
}

TEST(Config, WrongTypeAndRange) {
  expect_usage_error([] { load_config_text("data:\n  num_classes: many\n", "t.yaml"); },
                     {"t.yaml", "key 'data.num_classes'", "expected an integer", "'many'"});
  expect_usage_error([] { load_config_text("data:\n  num_classes: 10\n  batch_size: 1.5\n", "t.yaml"); },
                     {"key 'data.batch_size'", "expected an integer"});
  expect_usage_error([] { load_config_text("data:\n  num_classes: 10\noptim:\n  lr: [1]\n", "t.yaml"); },
                     {"key 'optim.lr'", "expected a number, got a list"});
  expect_usage_error([] { load_config_text("data:\n  num_classes: 10\nmodel:\n  sync_bn: maybe\n", "t.yaml"); },
                     {"key 'model.sync_bn'", "expected true or false"});
  expect_usage_error([] { load_config_text("data:\n  num_classes: 10\nloss:\n  sample_rate: 1.5\n", "t.yaml"); },
                     {"key 'loss.sample_rate'", "must be <= 1"});
  expect_usage_error([] { load_config_text("data:\n  num_classes: 0\n", "t.yaml"); },
                     {"key 'data.num_classes'", "must be >= 1"});
  expect_usage_error([] { load_config_text("data:\n  num_classes: 10\nloss:\n  margin: [1, 0.5]\n", "t.yaml"); },
                     {"key 'loss.margin'", "list of 3 values"});
  expect_usage_error([] { load_config_text("data:\n  num_classes: 10\ntrain:\n  precision: fp8\n", "t.yaml"); },
                     {"key 'train.precision'", "one of {auto, fp32, bf16, fp16}", "'fp8'"});
  expect_usage_error([] { load_config_text("data: 3\n", "t.yaml"); }, {"key 'data'", "mapping"});
}

// loss.margin_mode and optim.fc_update: defaults, choices, and the margins arcface_torch's
// CombinedMarginLoss cannot express (it raises for them) named at load time.
TEST(Config, MarginModeAndClassifierUpdate) {
  const Config d = load_config_text("data:\n  num_classes: 10\n", "mem.yaml");
  EXPECT_EQ(d.loss.margin_mode, "exact");
  EXPECT_EQ(d.optim.fc_update, "sampled");
  const Config t = load_config_text("data:\n  num_classes: 10\n", "mem.yaml",
                                    {"loss.margin_mode=arcface_torch", "loss.margin=[1.0, 0.3, 0.2]", "optim.fc_update=all"});
  EXPECT_EQ(t.loss.margin_mode, "arcface_torch");
  EXPECT_EQ(t.optim.fc_update, "all");
  EXPECT_EQ(config_to_yaml(t).find("margin_mode: arcface_torch") != std::string::npos, true);
  expect_usage_error([] { load_config_text("data:\n  num_classes: 10\nloss:\n  margin_mode: torch\n", "t.yaml"); },
                     {"t.yaml", "key 'loss.margin_mode'", "exact, arcface_torch", "'torch'"});
  expect_usage_error([] { load_config_text("data:\n  num_classes: 10\noptim:\n  fc_update: dense\n", "t.yaml"); },
                     {"key 'optim.fc_update'", "sampled, all"});
  // SphereFace-like m1 without m3, and a negative m3: exact takes them, arcface_torch cannot.
  for (const char* m : {"[1.35, 0.0, 0.0]", "[1.0, 0.5, -0.1]"}) {
    const std::string yaml = std::string("data:\n  num_classes: 10\nloss:\n  margin: ") + m + "\n";
    EXPECT_NO_THROW(load_config_text(yaml, "t.yaml"));
    expect_usage_error([&] { load_config_text(yaml + "  margin_mode: arcface_torch\n", "t.yaml"); },
                       {"t.yaml", "key 'loss.margin'", "no arcface_torch equivalent", "loss.margin_mode exact"});
  }
}

TEST(Config, MissingBaseFileAndCycles) {
  ConfigFiles f;
  std::string top = f.write("job.yaml", "base: nowhere.yaml\ndata:\n  num_classes: 1\n");
  expect_usage_error([&] { load_config(top); }, {"job.yaml", "key 'base'", "nowhere.yaml", "not found"});
  expect_usage_error([&] { load_config(f.dir + "/absent.yaml"); }, {"absent.yaml", "not found"});
  f.write("x.yaml", "base: y.yaml\n");
  f.write("y.yaml", "base: x.yaml\n");
  expect_usage_error([&] { load_config(f.dir + "/x.yaml"); }, {"cycle"});
  std::string broken = f.write("broken.yaml", "data:\n  num_classes: [1,\n");
  expect_usage_error([&] { load_config(broken); }, {"broken.yaml", "YAML syntax error"});
}

// Bases that fan out: a list naming one file ten times at each level stays within the
// depth and cycle checks and would load 10^depth files. The total number of files and
// bytes is bounded, and the error names the chain of bases that went past the bound.
TEST(Config, BasesThatFanOutAreBoundedInFilesAndBytes) {
  ConfigFiles f;
  const std::string ten = "[l1.yaml, l1.yaml, l1.yaml, l1.yaml, l1.yaml, l1.yaml, l1.yaml, l1.yaml, l1.yaml, l1.yaml]";
  for (int i = 1; i <= 8; ++i) {
    std::string list = ten;
    for (size_t at = list.find("l1"); at != std::string::npos; at = list.find("l1", at + 1))
      list.replace(at, 2, "l" + std::to_string(i + 1));
    f.write("l" + std::to_string(i) + ".yaml", i == 8 ? "data:\n  num_classes: 3\n" : "base: " + list + "\n");
  }
  const std::string top = f.write("top.yaml", "base: " + ten + "\n");
  expect_usage_error([&] { load_config(top); },
                     {"key 'base'", "more than 64 files", "top.yaml -> " + f.dir + "/l1.yaml -> " + f.dir + "/l2.yaml"});
  // Bytes: five 220 KB files stay under the per-file limit and go past 1 MiB in all.
  const std::string pad = "# " + std::string(220000, 'x') + "\n";
  f.write("big.yaml", pad + "data:\n  num_classes: 3\n");
  const std::string bytes = f.write("bytes.yaml", "base: [big.yaml, big.yaml, big.yaml, big.yaml, big.yaml]\n");
  expect_usage_error([&] { load_config(bytes); }, {"bytes.yaml:1", "more than 1024 KiB in all", "bytes.yaml -> "});
  // A diamond (a base included twice) within the bounds loads.
  f.write("common.yaml", "data:\n  num_classes: 3\n");
  f.write("a.yaml", "base: common.yaml\n");
  f.write("b.yaml", "base: common.yaml\noptim:\n  lr: 0.3\n");
  EXPECT_DOUBLE_EQ(load_config(f.write("diamond.yaml", "base: [a.yaml, b.yaml]\n")).optim.lr, 0.3);
  // The cycle error names the chain.
  f.write("x.yaml", "base: y.yaml\n");
  f.write("y.yaml", "base: x.yaml\n");
  expect_usage_error([&] { load_config(f.dir + "/x.yaml"); }, {"cycle", "x.yaml -> " + f.dir + "/y.yaml -> " + f.dir + "/x.yaml"});
}

// Before the classifier is allocated, the run computes what its shard needs and stops with
// one line naming the keys that size it when the device cannot hold it; the config itself
// bounds data.num_classes so that no size of the classifier overflows int64.
TEST(Config, ClassifierMemoryPlanAndItsLimit) {
  const Config cfg = load_config_text(
      "data:\n  num_classes: 1000003\n  batch_size: 8\nmodel:\n  embedding_size: 32\nloss:\n  sample_rate: 0.5\n",
      "plan.yaml");
  PartialFCOptions po;
  po.num_classes = *cfg.data.num_classes;
  po.embedding_size = cfg.model.embedding_size;
  po.sample_rate = cfg.loss.sample_rate;
  // 4 ranks: rank 0 holds 250001 classes and samples 125000 of them.
  ClassifierMemoryPlan p = classifier_memory_plan(po, 4, 0, cfg.data.batch_size);
  EXPECT_EQ(p.rows, 250001);
  EXPECT_EQ(p.sampled_rows, 125000);
  EXPECT_EQ(p.global_batch, 32);
  EXPECT_DOUBLE_EQ(p.weight_bytes, 250001.0 * 32 * 4);
  EXPECT_DOUBLE_EQ(p.state_bytes, 250001.0 * 32 * 4);          // SGD momentum
  EXPECT_DOUBLE_EQ(p.gradient_bytes, 0.0);  // the chunked step: G' in the logits buffer, one chunk
  EXPECT_DOUBLE_EQ(p.logits_bytes, 32 * 125000.0 * 4);
  po.optimizer.kind = "adamw";
  po.step_all_rows = true;
  po.gemm_dtype = at::kBFloat16;
  p = classifier_memory_plan(po, 4, 3, cfg.data.batch_size);
  EXPECT_EQ(p.rows, 250000);
  EXPECT_DOUBLE_EQ(p.state_bytes, 250000.0 * (2 * 32 * 4 + 8));
  // step_all_rows: the sampled rows' gradient and the dense one of the shard.
  EXPECT_DOUBLE_EQ(p.gradient_bytes, 125000.0 * 32 * 4 + 250000.0 * 32 * 4);
  po.sample_rate = 1;
  po.optimizer.kind = "sgd";
  po.gemm_dtype = at::kFloat;
  p = classifier_memory_plan(po, 4, 3, cfg.data.batch_size);
  EXPECT_DOUBLE_EQ(p.gradient_bytes, 0.0);  // no whole-shard gradient any more
  // The chunk temporaries (a GPU's budget: 1 GiB): the whole step fits one chunk, whose
  // logits passes take the most, 250000 columns x (6 x 32 + 12 x 32) B.
  EXPECT_DOUBLE_EQ(p.chunk_bytes, 250000.0 * (6 * 32 + 12 * 32));
  EXPECT_DOUBLE_EQ(p.total_bytes(), 2 * 250000.0 * 32 * 4 + 32 * 250000.0 * 4 + 250000.0 * (6 * 32 + 12 * 32));
  // On the CPU a cache-sized chunk: 2 MiB of fp32 rows (16384 at d = 32), the logits' the larger.
  p = classifier_memory_plan(po, 4, 3, cfg.data.batch_size, /*cuda=*/false);
  EXPECT_DOUBLE_EQ(p.chunk_bytes, 16384.0 * (6 * 32 + 12 * 32));
  // Fewer classes than ranks: PartialFC's own option error.
  po.num_classes = 3;
  EXPECT_NE(testing::error_of([&] { classifier_memory_plan(po, 4, 0, 8); }).find("at least the number of ranks"),
            std::string::npos);

  // Does not fit: one line naming the keys, what is needed and what is there.
  po = PartialFCOptions();
  po.num_classes = 1000003;
  po.embedding_size = 32;
  po.sample_rate = 0.5;
  p = classifier_memory_plan(po, 4, 0, 8);
  EXPECT_NO_THROW(check_classifier_fits(cfg, p, 4, 0, AvailableMemory{p.total_bytes(), "test"}, torch::kCPU));
  expect_usage_error(
      [&] { check_classifier_fits(cfg, p, 4, 0, AvailableMemory{p.total_bytes() - 1, "MemAvailable"}, torch::kCPU); },
      {"plan.yaml:2", "key 'data.num_classes': 1000003 classes do not fit", "rank 0's classifier shard needs at least " +
       std::to_string(static_cast<long long>(p.total_bytes())) + " bytes", "250001 rows x 32 fp32",
       "logits 32 x 125000 x 4 B = 16000000", "loss.sample_rate 0.5", "data.batch_size 8", "world size 4",
       "but cpu has " + std::to_string(static_cast<long long>(p.total_bytes() - 1)) + " bytes available (MemAvailable)"});
  // The CPU's available memory is known here (Linux).
  const auto cpu = device_available_memory(torch::kCPU);
  ASSERT_TRUE(cpu.has_value());
  EXPECT_GT(cpu->bytes, 1e6);

  // At most 2^40 classes (int64 sizes of the classifier never overflow).
  EXPECT_NO_THROW(load_config_text("data:\n  num_classes: 1099511627776\n", "big.yaml"));
  expect_usage_error([] { load_config_text("data:\n  num_classes: 1099511627777\n", "big.yaml"); },
                     {"big.yaml:2", "key 'data.num_classes'", "more than the 2^40"});
}

// Settings that default to another setting are optional: unset, their accessor gives the
// other one; a later layer's null unsets an earlier value; they round-trip through YAML.
TEST(Config, OptionalKeysResolveToWhatTheyFollow) {
  ConfigFiles f;
  f.write("base.yaml", "data: {num_classes: 10}\noptim: {lr: 0.2, weight_decay: 0.001, fc_lr: 0.5, warmup_steps: 3}\n");
  std::string top = f.write("job.yaml", "base: base.yaml\noptim: {fc_lr: null, optimizer: adamw}\n");
  Config c = load_config(top);
  EXPECT_FALSE(c.optim.fc_lr.has_value());
  EXPECT_DOUBLE_EQ(c.optim.classifier_lr(), 0.2);
  EXPECT_DOUBLE_EQ(c.optim.classifier_weight_decay(), 0.001);
  EXPECT_EQ(c.optim.classifier_optimizer(), "adamw");
  EXPECT_EQ(c.optim.warmup_steps, std::optional<int64_t>(3));
  EXPECT_EQ(c.data.verification_dir(), c.data.rec);
  c = load_config(top, {"optim.fc_lr=0.05", "optim.fc_optimizer=sgd", "optim.fc_weight_decay=0", "data.val_dir=/v"});
  EXPECT_DOUBLE_EQ(c.optim.classifier_lr(), 0.05);
  EXPECT_EQ(c.optim.classifier_optimizer(), "sgd");
  EXPECT_DOUBLE_EQ(c.optim.classifier_weight_decay(), 0.0);
  EXPECT_EQ(c.data.verification_dir(), "/v");
  Config back = load_config_text(config_to_yaml(c), "printed.yaml");
  EXPECT_EQ(back.optim.fc_lr, c.optim.fc_lr);
  EXPECT_FALSE(back.optim.total_steps.has_value());
  EXPECT_FALSE(back.model.init.has_value());
  // The old sentinels are values out of range now, named as such.
  expect_usage_error([&] { load_config(top, {"optim.warmup_steps=-1"}); }, {"--set", "'optim.warmup_steps'", ">= 0"});
  expect_usage_error([&] { load_config(top, {"optim.fc_lr=-1"}); }, {"--set", "'optim.fc_lr'", "> 0"});
}

// Components name their own options; the config layer names the file and key that set them.
TEST(Config, ComponentOptionErrorsNameTheConfigKey) {
  ConfigFiles f;
  std::string top = f.write("job.yaml", "data: {num_classes: 10}\nmodel: {backbone: r51}\n");
  Config c = load_config(top);
  BackboneOptions bo;
  bo.name = c.model.backbone;
  const std::string plain = [&] {
    try {
      make_backbone(bo);
    } catch (const Error& e) {
      EXPECT_EQ(e.option(), "backbone");
      return std::string(e.what());
    }
    return std::string();
  }();
  EXPECT_EQ(plain.find("model.backbone"), std::string::npos) << plain;  // the component's own terms
  EXPECT_NE(plain.find("backbone 'r51'"), std::string::npos) << plain;
  expect_usage_error([&] { with_config_keys(c, {{"backbone", "model.backbone"}}, [&] { return make_backbone(bo); }); },
                     {"job.yaml", "key 'model.backbone'", "'r51'", "r50"});
  // A key set by --set is named as coming from there; an unmapped option error passes as it is.
  c = load_config(top, {"loss.sample_rate=0.5"});
  PartialFCOptions po;
  po.num_classes = 10;
  po.sample_rate = 1.5;
  auto dist = Distributed::init(DistEnv{});
  expect_usage_error([&] { with_config_keys(c, {{"sample_rate", "loss.sample_rate"}}, [&] { return PartialFC(*dist, po); }); },
                     {"--set: key 'loss.sample_rate': must be in [0, 1], got 1.5"});
  expect_usage_error([&] { with_config_keys(c, {}, [&] { return PartialFC(*dist, po); }); },
                     {"sample_rate must be in [0, 1], got 1.5"});
}

TEST(Config, PrintedConfigLoadsBackToTheSameValues) {
  Config c = load_config_text("data:\n  num_classes: 7\n  val_targets: [lfw]\noptim:\n  lr: 0.0123\n", "t.yaml",
                              {"loss.margin=[1.0, 0.0, 0.4]", "train.precision=fp16"});
  std::string yaml = config_to_yaml(c);
  Config back = load_config_text(yaml, "printed.yaml");
  EXPECT_EQ(config_to_yaml(back), yaml);
  EXPECT_EQ(back.data.num_classes, 7);
  EXPECT_DOUBLE_EQ(back.optim.lr, 0.0123);
  EXPECT_EQ(back.loss.margin, (std::vector<double>{1.0, 0.0, 0.4}));
  EXPECT_EQ(back.train.precision, "fp16");
  EXPECT_EQ(back.data.val_targets, (std::vector<std::string>{"lfw"}));
}

}  // namespace
}  // namespace faceshard

namespace faceshard {
namespace {
// Every shipped config must load: a preset that no longer matches the schema is a bug.
TEST(Config, ShippedConfigsLoad) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(FACESHARD_SOURCE_DIR) + "/configs")) {
    if (e.path().extension() != ".yaml") continue;
    SCOPED_TRACE(e.path().string());
    EXPECT_NO_THROW(load_config(e.path().string()));
    n++;
  }
  EXPECT_GE(n, 2);
}

// 93431 -> "93,431".
std::string thousands(int64_t n) {
  std::string d = std::to_string(n), out;
  for (size_t i = 0; i < d.size(); ++i) out += ((i && (d.size() - i) % 3 == 0) ? "," : "") + d.substr(i, 1);
  return out;
}

// A preset file and its bases, as text (their comments included).
std::string preset_chain_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const size_t at = text.find("\nbase: ") != std::string::npos ? text.find("\nbase: ") + 1 : text.rfind("base: ", 0);
  if (at == std::string::npos) return text;
  const std::string base = text.substr(at + 6, text.find('\n', at) - at - 6);
  return text + preset_chain_text((std::filesystem::path(path).parent_path() / base).string());
}

// The data-set presets: the file name says data set, sampling and backbone; the contents
// must agree (arcface_torch's margins and weight decays). The class and image counts are the
// data's, counted at start-up: a preset names the published ones only in a comment, so
// that a preset trains your own data with data.rec alone overridden.
TEST(Config, PresetsMatchTheirDataSets) {
  struct Set {
    std::string prefix;
    int64_t classes, images;
    double m2, m3, wd;
  };
  const std::vector<Set> sets = {{"ms1mv2_", 85742, 5822653, 0.5, 0.0, 5e-4},
                                 {"ms1mv3_", 93431, 5179510, 0.5, 0.0, 5e-4},
                                 {"glint360k_", 360232, 17091657, 0.0, 0.4, 1e-4},
                                 {"wf42m_", 2059906, 42474557, 0.0, 0.4, 5e-4}};
  int n = 0;
  for (const auto& set : sets) {
    const std::vector<std::string> pfcs =
        set.prefix == "wf42m_" ? std::vector<std::string>{"pfc02_", "pfc03_"} : std::vector<std::string>{""};
    for (const std::string& pfc : pfcs)
      for (const std::string& net : {std::string("r50"), std::string("r100")}) {
        const std::string name = set.prefix + pfc + net + ".yaml";
        SCOPED_TRACE(name);
        const std::string path = std::string(FACESHARD_SOURCE_DIR) + "/configs/" + name;
        ASSERT_TRUE(std::filesystem::exists(path));
        const Config c = load_config(path);
        EXPECT_FALSE(c.data.num_classes.has_value());
        EXPECT_FALSE(c.data.num_images.has_value());
        EXPECT_NE(preset_chain_text(path).find(thousands(set.classes) + " identities, " + thousands(set.images) + " images"),
                  std::string::npos);
        EXPECT_EQ(c.model.backbone, net);
        ASSERT_EQ(c.loss.margin.size(), 3u);
        EXPECT_EQ(c.loss.margin[0], 1.0);
        EXPECT_EQ(c.loss.margin[1], set.m2);
        EXPECT_EQ(c.loss.margin[2], set.m3);
        EXPECT_EQ(c.optim.weight_decay, set.wd);
        EXPECT_EQ(c.loss.sample_rate, pfc == "pfc02_" ? 0.2 : pfc == "pfc03_" ? 0.3 : 1.0);
        // arcface_torch's common settings: SGD 0.9, 8 x 128 (the pfc03 jobs: 32 x 128 at lr 0.4
        // with 2 warm-up epochs), 20 epochs, 512-d embeddings, scale 64.
        EXPECT_EQ(c.optim.optimizer, "sgd");
        EXPECT_EQ(c.optim.momentum, 0.9);
        EXPECT_EQ(c.optim.lr, pfc == "pfc03_" ? 0.4 : 0.1);
        EXPECT_EQ(c.optim.warmup_epochs, pfc == "pfc03_" ? 2.0 : 0.0);
        EXPECT_EQ(c.optim.epochs, 20);
        EXPECT_EQ(c.data.batch_size, 128);
        EXPECT_EQ(c.model.embedding_size, 512);
        EXPECT_EQ(c.loss.scale, 64.0);
        EXPECT_EQ(c.train.precision, "bf16");  // arcface_torch: fp16 + GradScaler; bf16 needs no scaler
        EXPECT_EQ(c.output, "work_dirs/" + name.substr(0, name.size() - 5));
        n++;
      }
  }
  EXPECT_EQ(n, 10);

  // The ViT jobs: arcface_torch's AdamW recipe (lr 1e-3 and weight decay 0.1 for backbone
  // and classifier, warm-up a tenth of 40 epochs), inherited from the ViT-T preset, which
  // takes WebFace42M, CosFace 0.4 and Partial FC 0.3 from wf42m_pfc03_r100.
  struct Vit {
    std::string name, backbone;
    int64_t batch, accumulation, epochs;
    double warmup, sample_rate;
  };
  const std::vector<std::string> known = backbone_names();
  for (const Vit& v : std::vector<Vit>{{"wf42m_pfc03_40epoch_8gpu_vit_t", "vit_t_dp005_mask0", 512, 1, 40, 4, 0.3},
                                       {"wf42m_pfc03_40epoch_64gpu_vit_s", "vit_s_dp005_mask_0", 384, 1, 40, 4, 0.3},
                                       {"wf42m_pfc03_40epoch_8gpu_vit_b", "vit_b_dp005_mask_005", 256, 12, 40, 4, 0.3},
                                       {"wf42m_pfc03_40epoch_64gpu_vit_l", "vit_l_dp005_mask_005", 384, 1, 40, 4, 0.3},
                                       {"wf42m_pfc02_vit_h", "vit_h", 768, 1, 16, 2, 0.5}}) {
    SCOPED_TRACE(v.name);
    const std::string path = std::string(FACESHARD_SOURCE_DIR) + "/configs/" + v.name + ".yaml";
    ASSERT_TRUE(std::filesystem::exists(path));
    const Config c = load_config(path);
    EXPECT_EQ(c.model.backbone, v.backbone);
    EXPECT_NE(std::find(known.begin(), known.end(), v.backbone), known.end());
    EXPECT_FALSE(c.model.checkpointing.has_value());  // the network's default (on for b, l, h)
    EXPECT_EQ(c.data.batch_size, v.batch);
    EXPECT_EQ(c.optim.grad_accumulation, v.accumulation);
    EXPECT_EQ(c.optim.epochs, v.epochs);
    EXPECT_EQ(c.optim.warmup_epochs, v.warmup);
    EXPECT_EQ(c.loss.sample_rate, v.sample_rate);
    EXPECT_EQ(c.optim.optimizer, "adamw");
    EXPECT_EQ(c.optim.classifier_optimizer(), "adamw");
    EXPECT_EQ(c.optim.lr, 0.001);
    EXPECT_EQ(c.optim.classifier_lr(), 0.001);
    EXPECT_EQ(c.optim.weight_decay, 0.1);
    EXPECT_EQ(c.optim.classifier_weight_decay(), 0.1);
    EXPECT_EQ(c.optim.grad_clip, 5.0);
    EXPECT_FALSE(c.data.num_classes.has_value());
    EXPECT_NE(preset_chain_text(path).find("2,059,906 identities, 42,474,557 images"), std::string::npos);
    EXPECT_EQ(c.loss.margin, (std::vector<double>{1.0, 0.0, 0.4}));
    EXPECT_EQ(c.loss.scale, 64.0);
    EXPECT_EQ(c.model.embedding_size, 512);
    EXPECT_TRUE(c.data.val_targets.empty());
    EXPECT_EQ(c.train.precision, "bf16");
    EXPECT_EQ(c.output, "work_dirs/" + v.name);
  }
}

TEST(Config, CheckpointingIsOptional) {
  EXPECT_FALSE(load_config_text("data:\n  num_classes: 10\n", "mem.yaml").model.checkpointing.has_value());
  const Config on = load_config_text("data:\n  num_classes: 10\nmodel:\n  checkpointing: true\n", "mem.yaml");
  ASSERT_TRUE(on.model.checkpointing.has_value());
  EXPECT_TRUE(*on.model.checkpointing);
  const Config off = load_config_text("data:\n  num_classes: 10\n", "mem.yaml", {"model.checkpointing=false"});
  ASSERT_TRUE(off.model.checkpointing.has_value());
  EXPECT_FALSE(*off.model.checkpointing);
  expect_usage_error([] { load_config_text("data:\n  num_classes: 10\nmodel:\n  checkpointing: sometimes\n", "mem.yaml"); },
                     {"mem.yaml", "model.checkpointing", "true or false"});
  // Printed and read back: set stays set, unset stays unset (null).
  for (const Config* c : {&on, &off}) {
    const Config back = load_config_text(config_to_yaml(*c), "printed.yaml");
    EXPECT_EQ(back.model.checkpointing, c->model.checkpointing);
  }
  EXPECT_FALSE(load_config_text(config_to_yaml(load_config_text("data:\n  num_classes: 10\n", "m.yaml")), "p.yaml")
                   .model.checkpointing.has_value());
  // The backbone's refusal names the config key.
  const Config mbf = load_config_text("data:\n  num_classes: 10\nmodel:\n  backbone: mbf\n  checkpointing: true\n", "job.yaml");
  BackboneOptions bo;
  bo.name = mbf.model.backbone;
  bo.checkpointing = mbf.model.checkpointing;
  expect_usage_error(
      [&] { with_config_keys(mbf, {{"checkpointing", "model.checkpointing"}}, [&] { return make_backbone(bo); }); },
      {"job.yaml", "key 'model.checkpointing'", "MobileFaceNet"});
}
}  // namespace
}  // namespace faceshard

namespace faceshard {
namespace {

// The head presets: the head the file names, with its authors' published parameters and
// their batch of 512 and epochs.
TEST(Config, HeadPresetsCarryTheAuthorsSettings) {
  struct Preset {
    std::string file, head;
    std::map<std::string, double> params;
    int64_t classes;
    std::string backbone;
    double epochs;
  };
  const std::vector<Preset> presets = {
      {"ms1mv3_r100_adaface", "adaface", {{"m", 0.4}, {"h", 0.333}, {"s", 64}, {"t_alpha", 0.01}}, 93431, "r100", 24},
      {"webface4m_r50_adaface", "adaface", {{"m", 0.4}, {"h", 0.333}, {"s", 64}, {"t_alpha", 0.01}}, 205990, "r50", 26},
      {"ms1mv3_r50_curricularface", "curricularface", {{"m", 0.5}, {"s", 64}}, 93431, "r50", 24},
      {"ms1mv3_r100_magface",
       "magface",
       {{"l_a", 10}, {"u_a", 110}, {"l_m", 0.45}, {"u_m", 0.8}, {"lambda_g", 35}, {"s", 64}, {"easy_margin", 1}},
       93431,
       "r100",
       25},
      {"ms1mv3_r50_elasticface_cos", "elasticface_cos", {{"m", 0.35}, {"sigma", 0.05}, {"s", 64}, {"plus", 1}}, 93431,
       "r50", 26},
  };
  for (const auto& p : presets) {
    SCOPED_TRACE(p.file);
    const Config c = load_config(std::string(FACESHARD_SOURCE_DIR) + "/configs/" + p.file + ".yaml");
    EXPECT_EQ(c.loss.head, p.head);
    EXPECT_EQ(c.loss.chosen_head_params(), p.params);
    EXPECT_FALSE(c.data.num_classes.has_value());
    EXPECT_NE(preset_chain_text(std::string(FACESHARD_SOURCE_DIR) + "/configs/" + p.file + ".yaml")
                  .find(thousands(p.classes) + " identities"),
              std::string::npos);
    EXPECT_EQ(c.model.backbone, p.backbone);
    EXPECT_EQ(c.optim.epochs, p.epochs);
    EXPECT_EQ(c.data.batch_size * 4, 512);
    EXPECT_EQ(c.optim.lr, 0.1);
    EXPECT_EQ(c.optim.momentum, 0.9);
    EXPECT_EQ(c.optim.weight_decay, 5e-4);
    EXPECT_EQ(c.output, "work_dirs/" + p.file);
  }
  // A head's keys are validated like the rest, with the key in the error.
  EXPECT_THROW(load_config_text("data: {num_classes: 2}\nloss: {head: adaface, adaface: {t_alpha: 3}}\n", "t.yaml"),
               Error);
  EXPECT_THROW(load_config_text("data: {num_classes: 2}\nloss: {head: adaface, adaface: {q: 3}}\n", "t.yaml"), Error);
  EXPECT_THROW(load_config_text("data: {num_classes: 2}\nloss: {head: no_such_head}\n", "t.yaml"), Error);
}

}  // namespace
}  // namespace faceshard

namespace faceshard {
namespace {

// faceshard-config checks what faceshard-train checks before it starts: a backbone name it
// does not know is refused naming the key and the nearest name, as the trainer refuses it.
TEST(Config, ModelChecksAreTheTrainersOwn) {
  const Config bad = load_config_text("data: {num_classes: 10}\nmodel: {backbone: r51}\n", "job.yaml");
  expect_usage_error([&] { check_model_config(bad); },
                     {"key 'model.backbone'", "'r51' is not a network faceshard knows (did you mean 'r50'?)"});
  const Config mbf_dropout = load_config_text("data: {num_classes: 10}\nmodel: {backbone: mbf, dropout: 0.2}\n", "job.yaml");
  expect_usage_error([&] { check_model_config(mbf_dropout); }, {"key 'model.dropout'", "MobileFaceNet has no dropout"});
  EXPECT_NO_THROW(check_model_config(load_config_text("data: {num_classes: 10}\nmodel: {backbone: r100}\n", "job.yaml")));
}

}  // namespace
}  // namespace faceshard
