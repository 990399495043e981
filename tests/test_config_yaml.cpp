// Malformed YAML in a config: every case is one line naming the file, the line and the
// full key path, exit status 2, in the project's terms rather than yaml-cpp's; hostile
// documents (deep nesting, alias bombs, huge files) are refused before anything walks
// them. Plain C++ (no LibTorch): this file is also built into the AddressSanitizer target.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "app/config/cli.h"
#include "app/config/config.h"
#include "base/error.h"
#include "tests/test_files.h"

namespace faceshard {
namespace {

using testing::TempDir;

// The error of loading `text` as file `name`; checks exit status 2 and one line.
std::string config_error(const std::string& text, const std::string& name = "job.yaml",
                         const std::vector<std::string>& overrides = {}) {
  try {
    load_config_text(text, name, overrides);
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.exit_code(), 2) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    return msg;
  }
  return "<no error>";
}

#define EXPECT_CONTAINS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

const std::string kHead = "data:\n  num_classes: 10\n";  // lines 1-2

TEST(ConfigYaml, StructureErrorsNameFileLineAndKeyPath) {
  // A mapping key that is a list (yaml-cpp's own text for this was "bad conversion").
  std::string text = kHead + "  batch_size: 8\nmodel:\n  backbone: mbf\n  embedding_size: 64\nloss:\n  scale: 16\n"
                             "train:\n  log_every: 1\n  verify_every: 0\noptim:\n  [lr, momentum]: 0.1\n";
  EXPECT_EQ(config_error(text), "job.yaml:13:3: key 'optim': expected a key name, got a list");
  EXPECT_EQ(config_error(kHead + "optim: {? {a: 1} : 2}\n"), "job.yaml:3:11: key 'optim': expected a key name, got a mapping");
  EXPECT_EQ(config_error(kHead + "  ~: 3\n"), "job.yaml:3:3: key 'data': expected a key name, got an empty key");
  EXPECT_EQ(config_error(kHead + "optim:\n  lr: 0.1\n  lr: 0.2\n"),
            "job.yaml:5:3: key 'optim.lr' appears twice in one mapping (first at line 4)");
  EXPECT_EQ(config_error("- a\n- b\n"), "job.yaml:1:1: expected a mapping of keys at the top level");
}

TEST(ConfigYaml, SyntaxErrorsNameTheKeyPathOfTheirLine) {
  std::string msg = config_error(kHead + "optim:\n  lr: 0.1\n  betas: [0.9, 0.99\n  momentum: 0.9\n");
  EXPECT_CONTAINS(msg, "job.yaml:");
  EXPECT_CONTAINS(msg, "YAML syntax error");
  EXPECT_CONTAINS(msg, "key 'optim");
  msg = config_error(kHead + "  batch_size: \"8\n");
  EXPECT_CONTAINS(msg, "job.yaml:3:");
  EXPECT_CONTAINS(msg, "key 'data.batch_size'");
  msg = config_error("data:\n\tnum_classes: 10\n");
  EXPECT_CONTAINS(msg, "job.yaml:2:");
  EXPECT_CONTAINS(msg, "YAML syntax error");
  // yaml-cpp quotes the offending character raw; the message escapes it (and stays one line).
  msg = config_error(kHead + "model: {backbone: \"\\\x01\"}\n");
  EXPECT_CONTAINS(msg, "key 'model");
  EXPECT_CONTAINS(msg, "unknown escape character: \\x01");
  msg = config_error(kHead, "job.yaml", {"model.backbone=\"\\\r\""});
  EXPECT_CONTAINS(msg, "--set 'model.backbone=\"\\x5c\\x0d\"': the value is not valid YAML: unknown escape character: \\x0d");
}

TEST(ConfigYaml, ValueErrorsNameTheLine) {
  EXPECT_EQ(config_error(kHead + "optim:\n  momentum: 0.9\n  lr: fast\n"),
            "job.yaml:5: key 'optim.lr': expected a number, got 'fast'");
  EXPECT_EQ(config_error(kHead + "  batch_size: [8]\n"), "job.yaml:3: key 'data.batch_size': expected an integer, got a list");
  EXPECT_EQ(config_error(kHead + "optim:\n  learning_rate: 0.1\n"),
            "job.yaml:4: unknown key 'optim.learning_rate' (did you mean 'optim.lr'?)");
  // A scalar that holds line breaks stays on one line in the message.
  EXPECT_EQ(config_error(kHead + "train:\n  precision: \"fp\n    32\\n\\tx\"\n"),
            "job.yaml:4: key 'train.precision': expected one of {auto, fp32, bf16, fp16}, got 'fp 32\\x0a\\x09x'");
  // --set values have no line.
  EXPECT_EQ(config_error(kHead, "job.yaml", {"optim.lr=fast"}), "--set: key 'optim.lr': expected a number, got 'fast'");
}

TEST(ConfigYaml, HostileDocumentsAreRefusedCheaply) {
  // Nesting deeper than yaml-cpp's own guard (500), and deeper than ours (32).
  std::string msg = config_error(kHead + "model: " + std::string(20000, '[') + "\n");
  EXPECT_CONTAINS(msg, "job.yaml:");  // yaml-cpp marks where its guard stopped: the line after
  EXPECT_CONTAINS(msg, "key 'model'");
  EXPECT_CONTAINS(msg, "nested too deeply");
  msg = config_error(kHead + "model: " + std::string(40, '[') + std::string(40, ']') + "\n");
  EXPECT_CONTAINS(msg, "job.yaml:3:");
  EXPECT_CONTAINS(msg, "key 'model");
  EXPECT_CONTAINS(msg, "nested more than 32 levels deep");
  // An alias bomb: 9 levels of 9 references expand to 9^9 values.
  std::string bomb = "l0: &l0 {k0: 1, k1: 1, k2: 1, k3: 1, k4: 1, k5: 1, k6: 1, k7: 1, k8: 1}\n";
  for (int i = 1; i < 10; ++i) {
    bomb += "l" + std::to_string(i) + ": &l" + std::to_string(i) + " {";
    for (int j = 0; j < 9; ++j) bomb += (j ? ", k" : "k") + std::to_string(j) + ": *l" + std::to_string(i - 1);
    bomb += "}\n";
  }
  msg = config_error(bomb + kHead);
  EXPECT_CONTAINS(msg, "job.yaml:");
  EXPECT_CONTAINS(msg, "more than 100000 values once aliases are expanded");
  // A sequence that contains itself through its anchor.
  msg = config_error(kHead + "model: &a [*a]\n");
  EXPECT_NE(msg, "<no error>");
  EXPECT_CONTAINS(msg, "job.yaml");
  // A file far larger than any config.
  TempDir d;
  {
    std::ofstream f(d / "big.yaml");
    f << kHead;
    for (int i = 0; i < 20000; ++i) f << "# padding padding padding padding\n";
  }
  try {
    load_config(d / "big.yaml");
    ADD_FAILURE() << "a 700 KB config loaded";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_CONTAINS(std::string(e.what()), "a config file is at most 256 KiB");
  }
}

// What --print-config writes loads back to the same config, whatever the strings hold.
TEST(ConfigYaml, PrintedStringsLoadBackAsStrings) {
  for (const std::string v : {"null", "~", "yes", "123", "1.5", "a: b", "- x", "#x", "[x]", "'q'", "\"dq\"", "", " lead"}) {
    SCOPED_TRACE(v);
    Config c = load_config_text(kHead, "job.yaml");
    c.data.rec = v;
    c.output = v;
    c.model.init = v;
    const std::string printed = config_to_yaml(c);
    Config back;
    EXPECT_NO_THROW(back = load_config_text(printed, "printed.yaml")) << printed;
    EXPECT_EQ(back.data.rec, v) << printed;
    EXPECT_EQ(back.output, v) << printed;
    EXPECT_EQ(back.model.init, std::optional<std::string>(v)) << printed;
  }
}

}  // namespace
}  // namespace faceshard

namespace faceshard {
namespace {

// A near miss names the key meant: a misspelling (by edits, sections too), arcface_torch's
// name, a key in the wrong section; nothing is suggested for a name far from every key.
TEST(ConfigYaml, NearMissesNameTheKeyMeant) {
  EXPECT_EQ(config_error(kHead + "optim:\n  total_step: 10\n"),
            "job.yaml:4: unknown key 'optim.total_step' (did you mean 'optim.total_steps'?)");
  EXPECT_EQ(config_error(kHead + "trian:\n  precision: bf16\n"), "job.yaml:4: unknown key 'trian' (did you mean 'train'?)");
  EXPECT_EQ(config_error(kHead + "num_epoch: 20\n"), "job.yaml:3: unknown key 'num_epoch' (did you mean 'optim.epochs'?)");
  EXPECT_EQ(config_error(kHead + "model:\n  network: r50\n"),
            "job.yaml:4: unknown key 'model.network' (did you mean 'model.backbone'?)");
  EXPECT_EQ(config_error(kHead + "optim:\n  sample_rate: 0.1\n"),
            "job.yaml:4: unknown key 'optim.sample_rate' (did you mean 'loss.sample_rate'?)");
  EXPECT_EQ(config_error(kHead + "zebra_crossing: 1\n"), "job.yaml:3: unknown key 'zebra_crossing'");
  // A list key given one number says how a list is written.
  EXPECT_EQ(config_error(kHead, "job.yaml", {"loss.margin=0.5"}),
            "--set: key 'loss.margin': expected a list of numbers, got '0.5' (write a list as [x, y, z], e.g. --set "
            "'loss.margin=[1.0, 0.5, 0.0]')");
}

// The command line's slips get the right form back.
TEST(ConfigYaml, CommandLineSlipsGetTheRightForm) {
  auto cli_error = [](std::vector<std::string> words) -> std::string {
    std::vector<char*> argv;
    for (auto& w : words) argv.push_back(w.data());
    try {
      parse_config_args(static_cast<int>(argv.size()), argv.data());
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_EQ(cli_error({"faceshard-train", "--config", "a.yaml", "--set", "optim.lr", "0.01"}),
            "--set optim.lr 0.01: write --set optim.lr=0.01 (key and value in one word, joined by '=')");
  EXPECT_EQ(cli_error({"faceshard-train", "configs/demo.yaml"}),
            "unexpected argument 'configs/demo.yaml': give the config as --config configs/demo.yaml");
  EXPECT_EQ(cli_error({"faceshard-train", "--config", "a.yaml", "--set", "optim.lr=0.01", "--resume"}), "(no error)");
  TempDir d;
  {
    std::ofstream out(d / "job.yaml");
    out << kHead;
  }
  const std::string stem = d / "job";
  try {
    load_config(stem);
    ADD_FAILURE() << "a config path without .yaml loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not found (did you mean '" + stem + ".yaml'?)"), std::string::npos) << e.what();
  }
  try {
    load_config_text(kHead, "job.yaml", {"optim.lr"});
    ADD_FAILURE() << "--set without '=' was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected key.path=value, one word with '=' (e.g. --set optim.lr=VALUE)"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace faceshard
