// Tests of models/: the iresnet, MobileFaceNet and ViT backbones, their registry, parameter
// and MAC counts against closed forms, weight interchange with Python torch both ways
// against an independent reference written here with torch.nn.functional ops, and
// activation checkpointing against the plain backward.
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include "tests/test_paths.h"
#include "models/backbone.h"
#include "models/backbone_registry.h"
#include "models/activation_checkpoint.h"
#include "models/gate_conditioning.h"
#include "models/iresnet.h"
#include "models/model_stats.h"
#include "models/norm_layer.h"
#include "models/torch_save/state_dict_io.h"
#include "models/vit.h"
#include "base/error.h"
#include "tests/harness.h"
#include "tests/reference_backbones.h"

namespace faceshard {
namespace {

// The Python reference: backbones from plain torch.nn.functional ops over a state_dict,
// whose names and shapes are spelled out from insightface's module structure.
const char* const kReferenceScript = testing::kBackboneReferencePy;

bool python_has_torch() {
  static const bool ok =
      std::system((std::string("'") + FACESHARD_PYTHON + "' -c 'import torch' >/dev/null 2>&1").c_str()) == 0;
  return ok;
}

// The references need Python's torch (configure requires it): its absence is a failure.
#define REQUIRE_PYTHON_TORCH()                                                                 \
  ASSERT_TRUE(python_has_torch()) << "no Python with torch at " << FACESHARD_PYTHON; \
  static_assert(true)

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs the reference script; returns its exit status and output.
std::pair<int, std::string> run_reference(const std::string& dir, const std::string& args) {
  const std::string script = dir + "/ref.py";
  if (!std::ifstream(script)) std::ofstream(script) << kReferenceScript;
  const std::string log = dir + "/ref.log";
  const std::string cmd = std::string("'") + FACESHARD_PYTHON + "' '" + script + "' " + args + " >'" + log + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  return {rc, read_text(log)};
}

torch::Tensor lookup(const StateDict& sd, const std::string& name) {
  for (const auto& [k, v] : sd)
    if (k == name) return v;
  ADD_FAILURE() << "no entry '" << name << "'";
  return torch::Tensor();
}

// The message of the faceshard::Error that f throws ("NO ERROR" / "WRONG TYPE: ..." else).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("WRONG TYPE: ") + e.what();
  }
  return "NO ERROR";
}

BackboneOptions opts(const std::string& name, int64_t emb = 512) {
  BackboneOptions o;
  o.name = name;
  o.embedding_size = emb;
  return o;
}

// Fills BN statistics, BN affine and PReLU slopes with non-default values, so that
// comparisons exercise them (fresh models have mean 0, var 1, weight 1, bias 0).
void randomise_state(Backbone& model, uint64_t seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : model.state_dict()) {
    auto ends = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (ends("running_mean") || ends(".bias")) t.normal_(0.0, 0.1);
    else if (ends("running_var")) t.uniform_(0.75, 1.25);
    else if (ends("num_batches_tracked")) t.fill_(17);
    else if (t.dim() == 1 && !ends("features.weight")) t.uniform_(0.1, 0.9);  // BN weight / PReLU
  }
}

// ---- closed forms (independent of the model code) -------------------------------------

const std::map<std::string, std::vector<int64_t>> kIresnetLayers = {
    {"r18", {2, 2, 2, 2}}, {"r34", {3, 4, 6, 3}}, {"r50", {3, 4, 14, 3}},
    {"r100", {3, 13, 30, 3}}, {"r200", {6, 26, 60, 6}}};

int64_t iresnet_params(const std::vector<int64_t>& layers, int64_t emb) {
  int64_t n = 3 * 64 * 9 + 2 * 64 + 64;  // stem conv, BN affine, PReLU
  int64_t in = 64;
  const int64_t planes[4] = {64, 128, 256, 512};
  for (int s = 0; s < 4; ++s) {
    const int64_t p = planes[s];
    for (int64_t b = 0; b < layers[s]; ++b) {
      n += 2 * in + in * p * 9 + 2 * p + p + p * p * 9 + 2 * p;  // bn1 conv1 bn2 prelu conv2 bn3
      if (b == 0) n += in * p + 2 * p;                           // 1x1 shortcut + BN
      in = p;
    }
  }
  return n + 2 * 512 + 512 * 49 * emb + emb + 2 * emb;  // bn2, fc, features
}

int64_t iresnet_macs(const std::vector<int64_t>& layers, int64_t emb) {
  int64_t m = 3 * 64 * 9 * 112 * 112;
  int64_t in = 64, res = 112;
  const int64_t planes[4] = {64, 128, 256, 512};
  for (int s = 0; s < 4; ++s) {
    const int64_t p = planes[s], out = res / 2;
    for (int64_t b = 0; b < layers[s]; ++b) {
      if (b == 0)  // conv1 at the input resolution, conv2 and the shortcut stride 2
        m += in * p * 9 * res * res + p * p * 9 * out * out + in * p * out * out;
      else
        m += 2 * p * p * 9 * out * out;
      in = p;
    }
    res = out;
  }
  return m + 512 * 49 * emb;
}

// dim and depth of arcface_torch's ViT variants (backbones/__init__.py).
struct VitArch {
  int64_t dim, depth;
};
const std::map<std::string, VitArch> kVitArch = {
    {"vit_t", {256, 12}},  {"vit_t_dp005_mask0", {256, 12}},    {"vit_s", {512, 12}},
    {"vit_s_dp005_mask_0", {512, 12}}, {"vit_b", {512, 24}},   {"vit_b_dp005_mask_005", {512, 24}},
    {"vit_l_dp005_mask_005", {768, 24}}, {"vit_h", {1024, 48}}};
constexpr int64_t kTokens = 144;  // (112 / 9)^2 patches

int64_t vit_params(const VitArch& a, int64_t emb) {
  const int64_t d = a.dim;
  const int64_t block = 2 * 2 * d            // norm1, norm2
                        + 3 * d * d          // qkv, no bias
                        + d * d + d          // proj
                        + 4 * d * d + 4 * d  // fc1
                        + 4 * d * d + d;     // fc2
  return kTokens * d + d                   // pos_embed, mask_token
         + 3 * 9 * 9 * d + d                // patch conv
         + a.depth * block + 2 * d          // blocks, norm
         + kTokens * d * d + 2 * d + d * emb + 2 * emb;  // feature: Linear, BN, Linear, BN
}

int64_t vit_macs(const VitArch& a, int64_t emb) {
  const int64_t d = a.dim, n = kTokens;
  // Per block: qkv 3nd^2, proj nd^2, MLP 8nd^2; q.k^T and attn.v n^2 d each.
  return n * d * 3 * 81 + a.depth * (12 * n * d * d + 2 * n * n * d) + n * d * d + d * emb;
}

// The networks too large for a CPU forward/backward in CI (3 GB and 4.5 GB of weights):
// vit_h gets an eval forward of one image, r2060 a parameter count from its blocks.
bool heavy(const std::string& name) { return name == "vit_h" || name == "r2060"; }

// ---- registry --------------------------------------------------------------------------

TEST(ModelsRegistry, NamesOptionsAndErrors) {
  const std::vector<std::string> want = {"r18",
                                         "r34",
                                         "r50",
                                         "r100",
                                         "r200",
                                         "r2060",
                                         "ir_se50",
                                         "ir_se100",
                                         "mbf",
                                         "mbf_small",
                                         "mbf_large",
                                         "vit_t",
                                         "vit_t_dp005_mask0",
                                         "vit_s",
                                         "vit_s_dp005_mask_0",
                                         "vit_b",
                                         "vit_b_dp005_mask_005",
                                         "vit_l_dp005_mask_005",
                                         "vit_h"};
  EXPECT_EQ(backbone_names(), want);
  auto r18 = make_backbone(opts("r18", 128));
  EXPECT_EQ(r18->embedding_size(), 128);
  EXPECT_NE(dynamic_cast<IResNet*>(r18.get()), nullptr);
  EXPECT_FALSE(r18->checkpointing());


  std::string msg = error_of([] { make_backbone(opts("r51")); });
  EXPECT_NE(msg.find("vit_h"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'r51'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("r50"), std::string::npos) << msg;
  msg = error_of([] { make_backbone(opts("r50", 0)); });
  EXPECT_NE(msg.find("embedding size 0"), std::string::npos) << msg;
  msg = error_of([] {
    auto o = opts("r50");
    o.dropout = 1.5;
    make_backbone(o);
  });
  EXPECT_NE(msg.find("dropout"), std::string::npos) << msg;
  msg = error_of([] {
    auto o = opts("mbf");
    o.dropout = 0.2;
    make_backbone(o);
  });
  EXPECT_NE(msg.find("no dropout"), std::string::npos) << msg;
  EXPECT_EQ(parse_body_precision("bf16"), BodyPrecision::BFloat16);
  EXPECT_EQ(parse_body_precision("fp16"), BodyPrecision::Float16);
  EXPECT_EQ(parse_body_precision("fp32"), BodyPrecision::Float32);
  msg = error_of([] { parse_body_precision("fp8"); });
  EXPECT_NE(msg.find("'fp8'"), std::string::npos) << msg;
  // Wrong input shape is a named usage error, not a LibTorch shape failure.
  msg = error_of([&] { r18->forward(torch::zeros({1, 3, 64, 64})); });
  EXPECT_NE(msg.find("[1,3,64,64]"), std::string::npos) << msg;
  msg = error_of([&] { r18->forward(torch::zeros({1, 3, 112, 112})); });
  EXPECT_NE(msg.find("batch of at least 2"), std::string::npos) << msg;

  // arcface_torch's variant settings (backbones/__init__.py): drop path of the last block,
  // mask ratio, and activation checkpointing (its using_checkpoint) as the default.
  struct Want {
    std::string name;
    int64_t dim, depth;
    double drop_path, mask;
    bool checkpointing;
  };
  for (const Want& w : std::vector<Want>{{"vit_t", 256, 12, 0.1, 0.1, false},
                                         {"vit_t_dp005_mask0", 256, 12, 0.05, 0.0, false},
                                         {"vit_s", 512, 12, 0.1, 0.1, false},
                                         {"vit_s_dp005_mask_0", 512, 12, 0.05, 0.0, false},
                                         {"vit_b", 512, 24, 0.1, 0.1, true},
                                         {"vit_b_dp005_mask_005", 512, 24, 0.05, 0.1, true},
                                         {"vit_l_dp005_mask_005", 768, 24, 0.05, 0.1, true},
                                         {"vit_h", 1024, 48, 0.1, 0.0, true}}) {
    SCOPED_TRACE(w.name);
    const auto v = vit_variant(w.name);
    ASSERT_TRUE(v.has_value());
    EXPECT_EQ(v->dim, w.dim);
    EXPECT_EQ(v->depth, w.depth);
    EXPECT_EQ(v->heads, 8);
    EXPECT_EQ(v->drop_path, w.drop_path);
    EXPECT_EQ(v->mask_ratio, w.mask);
    EXPECT_EQ(v->checkpointing, w.checkpointing);
  }
  EXPECT_FALSE(vit_variant("vit_x").has_value());
  auto vit = make_backbone(opts("vit_t", 128));
  EXPECT_NE(dynamic_cast<VisionTransformer*>(vit.get()), nullptr);
  EXPECT_FALSE(vit->checkpointing());
  {
    auto o = opts("vit_t");
    o.checkpointing = true;
    EXPECT_TRUE(make_backbone(o)->checkpointing());
    o = opts("r18");
    o.checkpointing = true;
    EXPECT_TRUE(make_backbone(o)->checkpointing());
  }
  // ViTs take exactly 112x112 (144 position embeddings); no dropout layer, like MobileFaceNet.
  msg = error_of([&] { vit->forward(torch::zeros({2, 3, 108, 108})); });
  EXPECT_NE(msg.find("[2,3,108,108]"), std::string::npos) << msg;
  msg = error_of([] {
    auto o = opts("vit_s");
    o.dropout = 0.1;
    make_backbone(o);
  });
  EXPECT_NE(msg.find("no dropout"), std::string::npos) << msg;
  msg = error_of([] {
    auto o = opts("mbf");
    o.checkpointing = true;
    make_backbone(o);
  });
  EXPECT_NE(msg.find("checkpointing"), std::string::npos) << msg;
  EXPECT_EQ(iresnet_layers("r2060"), (std::vector<int64_t>{3, 128, 1024 - 128, 3}));
}

// An unknown depth is refused where the network is built, naming it and the known depths,
// not at the first forward with a BatchNorm shape error.
TEST(ModelsRegistry, IresnetUnknownDepthFailsAtConstruction) {
  std::string msg = error_of([] { iresnet_layers("r51"); });
  EXPECT_NE(msg.find("iresnet depth 'r51' is unknown; known: r18, r34, r50, r100, r200, r2060"), std::string::npos)
      << msg;
  for (const std::vector<int64_t>& layers : std::vector<std::vector<int64_t>>{{}, {2, 2, 2}, {2, 0, 2, 2}}) {
    msg = error_of([&] { IResNet(layers, opts("r51")); });
    EXPECT_NE(msg.find("iresnet 'r51': blocks per stage {"), std::string::npos) << msg;
    EXPECT_NE(msg.find("known depths: r18, r34, r50, r100, r200, r2060"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  // The smallest layout the check lets through still runs its forward.
  auto tiny = std::make_shared<IResNet>(std::vector<int64_t>{1, 1, 1, 1}, opts("r_tiny", 8));
  tiny->eval();
  torch::NoGradGuard no_grad;
  EXPECT_EQ(tiny->forward(torch::randn({1, 3, 112, 112})).sizes(), (std::vector<int64_t>{1, 8}));
}

// ---- sizes -----------------------------------------------------------------------------

TEST(ModelsStats, IresnetParameterCountsMatchClosedForm) {
  for (const auto& [name, layers] : kIresnetLayers) {
    SCOPED_TRACE(name);
    for (int64_t emb : {512, 128}) {
      auto model = make_backbone(opts(name, emb));
      const auto c = count_parameters(*model);
      EXPECT_EQ(c.total, iresnet_params(layers, emb));
      EXPECT_EQ(c.trainable, c.total - emb);  // the embedding BN's scale is frozen
      if (emb == 512) std::cout << "[models] " << name << " parameters " << c.total << "\n";
    }
  }
  // The published sizes (insightface README / model zoo), to 0.01M.
  EXPECT_NEAR(count_parameters(*make_backbone(opts("r50"))).total / 1e6, 43.59, 0.01);
  EXPECT_NEAR(count_parameters(*make_backbone(opts("r100"))).total / 1e6, 65.16, 0.01);
}

TEST(ModelsStats, IresnetMacsMatchClosedForm) {
  for (const std::string name : {"r18", "r50", "r100"}) {
    SCOPED_TRACE(name);
    auto model = make_backbone(opts(name));
    const int64_t macs = count_macs(*model);
    EXPECT_EQ(macs, iresnet_macs(kIresnetLayers.at(name), 512));
    EXPECT_TRUE(model->is_training());  // restored
    std::cout << "[models] " << name << " MACs at 112x112: " << macs << "\n";
    // insightface's published "GFLOPs" (ptflops MACs): r18 2.6, r50 6.3, r100 12.1.
    const double published = name == "r18" ? 2.6 : name == "r50" ? 6.3 : 12.1;
    EXPECT_NEAR(macs / 1e9, published, 0.05);
  }
}

TEST(ModelsStats, VitParameterCountsAndMacsMatchArcfaceTorch) {
  // sum(p.numel() for p in model.parameters()) of arcface_torch's models, num_features 512.
  const std::map<std::string, int64_t> arcface_torch = {{"vit_t", 19137792},
                                                        {"vit_s", 76023296},
                                                        {"vit_b", 113833472},
                                                        {"vit_l_dp005_mask_005", 255684352},
                                                        {"vit_h", 756393984}};
  // arcface_torch's README "GFLOPs" (MACs with the attention products): 1.5, 5.7, 11.4, 25.3.
  const std::map<std::string, double> published_g = {
      {"vit_t", 1.5}, {"vit_s", 5.7}, {"vit_b", 11.4}, {"vit_l_dp005_mask_005", 25.3}};
  for (const auto& name : vit_names()) {
    SCOPED_TRACE(name);
    const VitArch& a = kVitArch.at(name);
    if (arcface_torch.count(name)) {
      EXPECT_EQ(vit_params(a, 512), arcface_torch.at(name));
    }
    if (name == "vit_h") continue;  // built in BackboneForward.VitHugeEvalForwardOfOne
    auto model = make_backbone(opts(name));
    const auto c = count_parameters(*model);
    EXPECT_EQ(c.total, vit_params(a, 512));
    // Nothing frozen but the mask token of the variants that never mask.
    EXPECT_EQ(c.trainable, c.total - (vit_variant(name)->mask_ratio > 0 ? 0 : a.dim));
    const int64_t macs = count_macs(*model);
    EXPECT_EQ(macs, vit_macs(a, 512));
    std::cout << "[models] " << name << " parameters " << c.total << ", MACs " << macs << "\n";
    if (published_g.count(name)) {
      EXPECT_NEAR(macs / 1e9, published_g.at(name), 0.05);
    }
  }
  auto small = make_backbone(opts("vit_t", 128));
  EXPECT_EQ(count_parameters(*small).total, vit_params(kVitArch.at("vit_t"), 128));
  EXPECT_EQ(count_macs(*small), vit_macs(kVitArch.at("vit_t"), 128));
}

TEST(ModelsStats, R2060ParameterCountFromItsBlocks) {
  // r2060 is 4.5 GB of weights: its count is taken from the real modules without building
  // it whole. Layer3's 896 blocks after the first are identical 256->256 blocks, so r2060 =
  // the same network with one layer3 block + 895 such blocks.
  const std::vector<int64_t> layers = iresnet_layers("r2060");
  ASSERT_EQ(layers, (std::vector<int64_t>{3, 128, 896, 3}));
  IResNet one_in_layer3({layers[0], layers[1], 1, layers[3]}, opts("r2060"));
  IBasicBlock block(256, 256, 1);
  const int64_t total = count_parameters(one_in_layer3).total + (layers[2] - 1) * count_parameters(*block).total;
  EXPECT_EQ(total, 1122301120);  // arcface_torch's iresnet2060
  EXPECT_EQ(total, iresnet_params(layers, 512));
  const int64_t block_macs = 2 * 256 * 256 * 9 * 14 * 14;  // two 3x3 convs at 14x14
  EXPECT_EQ(count_macs(one_in_layer3) + (layers[2] - 1) * block_macs, iresnet_macs(layers, 512));
  std::cout << "[models] r2060 parameters " << total << ", MACs " << iresnet_macs(layers, 512) << "\n";
  // Checkpointed as arcface_torch: layer2 in 20 segments, layer3 in 100.
  EXPECT_EQ(IResNet::checkpoint_segments(1, 128), 20);
  EXPECT_EQ(IResNet::checkpoint_segments(2, 896), 100);
  EXPECT_EQ(IResNet::checkpoint_segments(0, 3), 0);
  EXPECT_EQ(IResNet::checkpoint_segments(3, 3), 0);
}

// ---- interchange with Python -----------------------------------------------------------

struct ArchCase {
  std::string name;
  int64_t emb;
};
std::ostream& operator<<(std::ostream& os, const ArchCase& c) { return os << c.name << "_" << c.emb; }

class BackboneInterchange : public ::testing::TestWithParam<ArchCase> {};

TEST_P(BackboneInterchange, PythonWeightsGiveSameEmbeddings) {
  REQUIRE_PYTHON_TORCH();
  const auto& p = GetParam();
  const std::string dir = testing::temp_dir("models_py2cpp");
  auto [rc, out] = run_reference(dir, "make '" + dir + "' " + p.name + " " + std::to_string(p.emb));
  ASSERT_EQ(rc, 0) << out;

  auto model = make_backbone(opts(p.name, p.emb));
  // Sizes agree with the reference's own spec and its MAC tally.
  const std::string info = read_text(dir + "/py_info.json");
  auto field = [&](const std::string& key) {
    auto at = info.find("\"" + key + "\": ");
    EXPECT_NE(at, std::string::npos) << info;
    return std::stoll(info.substr(at + key.size() + 4));
  };
  EXPECT_EQ(count_parameters(*model).total, field("params"));
  EXPECT_EQ(count_macs(*model), field("macs"));
  EXPECT_EQ(static_cast<int64_t>(model->state_dict().size()), field("keys"));
  std::cout << "[models] " << p.name << " parameters " << field("params") << ", MACs " << field("macs") << "\n";

  load_backbone_weights(*model, dir + "/py_weights.pt");
  const StateDict io = read_state_dict(dir + "/py_io.pt");
  // Compared in float64, as the reference computes (see its make()).
  model->to(torch::kDouble);
  const torch::Tensor x = lookup(io, "input").to(torch::kDouble);

  model->eval();
  torch::Tensor y_eval;
  {
    torch::NoGradGuard no_grad;
    y_eval = model->forward(x);
  }
  EXPECT_LT(testing::relative_error(y_eval, lookup(io, "eval"), testing::ErrorNorm::Max), 1e-9);

  // Train mode: batch statistics in every BN, and the same running-stat updates; the ViTs'
  // token masking and drop path draw the reference's random numbers (same seed, same order).
  model->train();
  torch::Tensor y_train;
  {
    torch::NoGradGuard no_grad;
    torch::manual_seed(77);
    y_train = model->forward(x);
  }
  EXPECT_LT(testing::relative_error(y_train, lookup(io, "train"), testing::ErrorNorm::Max), 1e-9);
  EXPECT_GT(testing::relative_error(y_train, y_eval, testing::ErrorNorm::Max), 1e-3);  // the modes really differ
  const StateDict after = read_state_dict(dir + "/py_after_train.pt");
  const StateDict mine = model->state_dict();
  ASSERT_EQ(mine.size(), after.size());
  for (size_t k = 0; k < mine.size(); ++k) {
    ASSERT_EQ(mine[k].first, after[k].first);
    if (mine[k].second.is_floating_point())
      EXPECT_LT(testing::relative_error(mine[k].second, after[k].second, testing::ErrorNorm::Max), 1e-9) << mine[k].first;
    else
      EXPECT_TRUE(torch::equal(mine[k].second, after[k].second)) << mine[k].first;
  }
}

TEST_P(BackboneInterchange, ExportLoadsInPython) {
  REQUIRE_PYTHON_TORCH();
  const auto& p = GetParam();
  const std::string dir = testing::temp_dir("models_cpp2py");
  auto model = make_backbone(opts(p.name, p.emb));
  randomise_state(*model, 7);
  {
    // Fan-in scaled convolutions: with the init's N(0, 0.1) activations grow ~7x per conv to
    // ~1e6, where an SE gate's sigmoid turns float32 rounding of its input into 1e-3 relative
    // differences; this test is about names, order and values, not conditioning.
    torch::NoGradGuard no_grad;
    for (auto& w : model->parameters())
      if (w.dim() == 4) w.normal_(0.0, std::sqrt(1.0 / (w.size(1) * w.size(2) * w.size(3))));
  }
  model->eval();
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({2, 3, 112, 112});
  torch::Tensor y;
  {
    torch::NoGradGuard no_grad;
    y = model->forward(x);
  }
  save_backbone_weights(*model, dir + "/cpp_weights.pt");
  write_state_dict({{"input", x}, {"eval", y}}, dir + "/cpp_io.pt");
  auto [rc, out] = run_reference(dir, "check '" + dir + "' " + p.name + " " + std::to_string(p.emb));
  ASSERT_EQ(rc, 0) << out;
  // Python re-saved what it loaded: same names, order and exact values.
  const StateDict back = read_state_dict(dir + "/py_resaved.pt");
  const StateDict mine = model->state_dict();
  ASSERT_EQ(back.size(), mine.size());
  for (size_t k = 0; k < mine.size(); ++k) {
    ASSERT_EQ(back[k].first, mine[k].first);
    EXPECT_EQ(back[k].second.scalar_type(), mine[k].second.scalar_type()) << mine[k].first;
    EXPECT_TRUE(torch::equal(back[k].second, mine[k].second)) << mine[k].first;
  }
}

INSTANTIATE_TEST_SUITE_P(Backbone, BackboneInterchange,
                         ::testing::Values(ArchCase{"r18", 256}, ArchCase{"r50", 512}, ArchCase{"ir_se50", 512},
                                           ArchCase{"mbf", 512}, ArchCase{"mbf_large", 128},
                                           ArchCase{"vit_t", 512}),
                         [](const auto& info) { return info.param.name + "_" + std::to_string(info.param.emb); });

// ---- every registered network declares what the project needs of it --------------------

// The reference's specs of every network it knows, written once per test binary run.
const std::string& reference_catalogue() {
  static const std::string dir = [] {
    const std::string d = testing::temp_dir("models_catalogue");
    auto [rc, out] = run_reference(d, "catalogue '" + d + "' 512");
    EXPECT_EQ(rc, 0) << out;
    return d;
  }();
  return dir;
}

struct CheckpointCase {
  std::string name;
  int segments;  // checkpointed segments in its graph
};
std::ostream& operator<<(std::ostream& os, const CheckpointCase& c) { return os << c.name; }

// The networks whose checkpointed backward is compared with the plain one (Checkpointing).
const std::vector<CheckpointCase>& checkpoint_cases() {
  static const std::vector<CheckpointCase> cases = {
      {"vit_t", 12},
      // layer2 and layer3 of r18 have 2 blocks: 2 segments each, the last plain
      {"r18", 2},
      // ir_se50's layer2 4 blocks, layer3 14: 3 + 13 recomputed, squeeze-and-excitation inside
      {"ir_se50", 16}};
  return cases;
}

class ModelsCatalogue : public ::testing::TestWithParam<std::string> {};

// A network added to the registry fails here, by name, until the Python reference spells out
// its state_dict (names and shapes, so the same parameter count) and its checkpointing
// answer holds; its ONNX lowering, planner row and onnxruntime runs are required by
// OnnxExportEveryBackbone, PlanTable.EveryRegisteredBackboneIsMeasuredOrSaysSo
// and tests/e2e/onnx_export.py (whose network lists are the reference's).
TEST_P(ModelsCatalogue, HasAReferenceAndACheckpointingAnswer) {
  REQUIRE_PYTHON_TORCH();
  const std::string name = GetParam();
  const BackboneTraits& t = backbone_traits(name);
  EXPECT_EQ(t.name, name);
  const std::string spec = read_text(reference_catalogue() + "/" + name + ".spec");
  ASSERT_FALSE(spec.empty()) << name << " has no Python reference (tests/reference_backbones.h)";
  if (!heavy(name)) {
    std::ostringstream mine;
    for (const auto& [k, v] : make_backbone(opts(name))->state_dict()) {
      mine << k << " ";
      for (int64_t i = 0; i < v.dim(); ++i) mine << (i ? "," : "") << v.size(i);
      mine << "\n";
    }
    EXPECT_EQ(mine.str(), spec) << name << ": the reference's state_dict differs from the network's";
  }
  // Checkpointing: the network has it (the family's Checkpointing case checks the backward)
  // or says why not, in one line naming the network.
  if (t.supports_checkpointing) {
    bool covered = false;
    for (const auto& c : checkpoint_cases()) covered = covered || backbone_traits(c.name).family == t.family;
    EXPECT_TRUE(covered) << name << ": its family " << t.family << " has no Checkpointing case (checkpoint_cases)";
  } else {
    auto o = opts(name);
    o.checkpointing = true;
    const std::string msg = error_of([&] { make_backbone(o); });
    EXPECT_NE(msg.find("'" + name + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(t.no_checkpointing_reason), std::string::npos) << msg;
    EXPECT_FALSE(t.no_checkpointing_reason.empty()) << name;
  }
  if (!t.dropout) EXPECT_FALSE(t.no_dropout_reason.empty()) << name;
}

INSTANTIATE_TEST_SUITE_P(Backbone, ModelsCatalogue, ::testing::ValuesIn(backbone_names()),
                         [](const auto& info) { return info.param; });

// ---- file format edge cases and bad input ----------------------------------------------

void write_raw_archive(const std::string& path, const std::string& pickle) {
  caffe2::serialize::PyTorchStreamWriter w(path);
  w.writeRecord("data.pkl", pickle.data(), pickle.size());
  w.writeEndOfFile();
}

TEST(BackboneFiles, FormatCasesBothWaysAndBadFiles) {
  REQUIRE_PYTHON_TORCH();
  const std::string dir = testing::temp_dir("models_files");
  const torch::Tensor a = torch::arange(6, torch::kFloat).reshape({2, 3});
  write_state_dict({{"a", a},
                    {"b", a.slice(1, 1)},  // non-contiguous view
                    {"h", torch::arange(4).to(torch::kHalf)},
                    {"bf", torch::arange(4).to(torch::kBFloat16)},
                    {"l", torch::tensor(7, torch::kLong)},
                    {"e", torch::empty({0, 3})},
                    {"big", torch::full({3}, 2.5)}},
                   dir + "/cpp_misc.pt");
  auto [rc, out] = run_reference(dir, "misc '" + dir + "'");
  ASSERT_EQ(rc, 0) << out;

  const StateDict m = read_state_dict(dir + "/misc.pt");
  std::vector<std::string> keys;
  for (const auto& kv : m) keys.push_back(kv.first);
  EXPECT_EQ(keys, (std::vector<std::string>{"a", "b", "p", "h", "bf", "l", "e"}));
  EXPECT_TRUE(torch::equal(lookup(m, "a"), a));
  EXPECT_TRUE(torch::equal(lookup(m, "b"), a.slice(1, 1)));  // a view at storage offset 1
  EXPECT_TRUE(torch::equal(lookup(m, "p"), torch::ones({3})));
  EXPECT_TRUE(torch::equal(lookup(m, "h"), torch::arange(4).to(torch::kHalf)));
  EXPECT_TRUE(torch::equal(lookup(m, "bf"), torch::arange(4).to(torch::kBFloat16)));
  EXPECT_EQ(lookup(m, "l").dim(), 0);
  EXPECT_EQ(lookup(m, "l").item<int64_t>(), 7);
  EXPECT_EQ(lookup(m, "e").sizes(), (std::vector<int64_t>{0, 3}));

  auto expect_error = [](const std::string& path, const std::string& needle) {
    const std::string msg = error_of([&] { read_state_dict(path); });
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  expect_error(dir + "/missing.pt", "cannot open");
  expect_error(dir + "/legacy.pt", "legacy");
  expect_error(dir + "/checkpoint.pt", "'state_dict'");
  expect_error(dir + "/nontensor.pt", "'a' is a int");
  expect_error(dir + "/list.pt", "got a list");
  std::ofstream(dir + "/garbage.pt") << "this is not a checkpoint";
  expect_error(dir + "/garbage.pt", "not a zip-format");
  const std::string bytes = read_text(dir + "/misc.pt");
  std::ofstream(dir + "/truncated.pt", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  expect_error(dir + "/truncated.pt", "cannot read");
  write_raw_archive(dir + "/badop.pt", std::string("\x80\x02\xff", 3));
  expect_error(dir + "/badop.pt", "unsupported pickle opcode 0xff");
  write_raw_archive(dir + "/shortpkl.pt", std::string("\x80\x02}(X\x05\x00", 7));
  expect_error(dir + "/shortpkl.pt", "truncated");
  // A storage record that is shorter than the tensor claims.
  {
    auto u = [](const std::string& text) {  // BINUNICODE
      std::string b = "X";
      const uint32_t n = static_cast<uint32_t>(text.size());
      for (int k = 0; k < 4; ++k) b.push_back(static_cast<char>((n >> (8 * k)) & 0xff));
      return b + text;
    };
    std::string pk = std::string("\x80\x02}", 3) + u("w") + "ctorch._utils\n_rebuild_tensor_v2\n((" +
                     u("storage") + "ctorch\nFloatStorage\n" + u("0") + u("cpu") + "K\x04tQ" +
                     std::string("K\0K\x04\x85K\x01\x85\x89)tRs.", 14);
    write_raw_archive(dir + "/nostorage.pt", pk);
  }
  expect_error(dir + "/nostorage.pt", "'data/0' is missing");
  EXPECT_NE(error_of([&] { write_state_dict({{"x", torch::ones(1)}}, dir + "/no/such/dir/x.pt"); })
                .find("cannot write"),
            std::string::npos);
}

TEST(BackboneFiles, MismatchedWeightsAreNamedAndLeaveModelUntouched) {
  const std::string dir = testing::temp_dir("models_mismatch");
  auto r18 = make_backbone(opts("r18"));
  save_backbone_weights(*r18, dir + "/r18.pt");

  auto r34 = make_backbone(opts("r34"));
  const torch::Tensor before = r34->state_dict().front().second.clone();
  std::string msg = error_of([&] { load_backbone_weights(*r34, dir + "/r18.pt"); });
  EXPECT_NE(msg.find(dir + "/r18.pt"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing key 'layer1.2.bn1.weight'"), std::string::npos) << msg;
  EXPECT_TRUE(torch::equal(r34->state_dict().front().second, before));  // nothing copied

  auto small = make_backbone(opts("r18", 128));
  msg = error_of([&] { load_backbone_weights(*small, dir + "/r18.pt"); });
  EXPECT_NE(msg.find("'fc.weight' has shape [512,25088], backbone 'r18' expects [128,25088]"), std::string::npos) << msg;

  auto mbf = make_backbone(opts("mbf"));
  msg = error_of([&] { load_backbone_weights(*mbf, dir + "/r18.pt"); });
  EXPECT_NE(msg.find("unexpected key"), std::string::npos) << msg;

  // DDP checkpoints ("module." prefix) and checkpoints without num_batches_tracked load.
  StateDict ddp;
  for (const auto& [k, v] : r18->state_dict())
    if (k.find("num_batches_tracked") == std::string::npos) ddp.emplace_back("module." + k, v);
  write_state_dict(ddp, dir + "/ddp.pt");
  auto r18b = make_backbone(opts("r18"));
  load_backbone_weights(*r18b, dir + "/ddp.pt");
  EXPECT_TRUE(torch::equal(lookup(r18b->state_dict(), "fc.weight"), lookup(r18->state_dict(), "fc.weight")));
}

// ---- forward / backward ----------------------------------------------------------------

class BackboneForward : public ::testing::TestWithParam<std::string> {};

TEST_P(BackboneForward, TrainAndEvalOnCpu) {
  torch::manual_seed(0);
  auto model = make_backbone(opts(GetParam()));
  {
    // insightface's conv init N(0, 0.1) grows activations ~7x per 3x3x512 conv; with fresh
    // running statistics (var 1) r200's eval forward overflows. Fan-in scaling keeps this
    // test about train/eval mechanics rather than the init.
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters())
      if (p.dim() == 4) p.normal_(0.0, std::sqrt(1.0 / (p.size(1) * p.size(2) * p.size(3))));
  }
  // Every BN is a NormLayer, which app/sync_bn can turn into SyncBatchNorm in place.
  int norms = 0, bn_keys = 0;
  for (const auto& m : model->modules()) {
    EXPECT_EQ(dynamic_cast<torch::nn::BatchNorm2dImpl*>(m.get()), nullptr);
    EXPECT_EQ(dynamic_cast<torch::nn::BatchNorm1dImpl*>(m.get()), nullptr);
    norms += dynamic_cast<NormLayerImpl*>(m.get()) != nullptr;
  }
  for (const auto& kv : model->state_dict()) bn_keys += kv.first.find("running_mean") != std::string::npos;
  EXPECT_EQ(norms, bn_keys);
  const torch::Tensor x = torch::randn({2, 3, 112, 112});
  // Train: batch statistics, running stats move, gradients reach every trainable tensor.
  model->train();
  const StateDict before = model->state_dict();
  std::map<std::string, torch::Tensor> saved;
  for (const auto& [k, v] : before) saved[k] = v.clone();
  torch::Tensor y = model->forward(x);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 512}));
  EXPECT_EQ(y.scalar_type(), torch::kFloat);
  ASSERT_TRUE(torch::isfinite(y).all().item<bool>());
  y.pow(2).sum().backward();
  for (const auto& kp : model->named_parameters()) {
    const std::string& k = kp.key();
    const torch::Tensor& p = kp.value();
    if (!p.requires_grad()) {
      // iresnet's frozen embedding-BN scale; the mask token of ViTs that do not mask.
      const auto vit = vit_variant(GetParam());
      if (k == "mask_token") {
        EXPECT_TRUE(vit && vit->mask_ratio == 0.0) << GetParam();
      } else {
        EXPECT_EQ(k, "features.weight");
      }
      EXPECT_FALSE(p.grad().defined());
      continue;
    }
    ASSERT_TRUE(p.grad().defined()) << k;
    EXPECT_TRUE(torch::isfinite(p.grad()).all().item<bool>()) << k;
  }
  int moved = 0;
  for (const auto& [k, v] : model->state_dict())
    if (k.find("running_mean") != std::string::npos && !torch::equal(v, saved.at(k))) ++moved;
  EXPECT_EQ(moved, bn_keys);  // every BN (the ViTs have two, in the head)
  EXPECT_EQ(lookup(model->state_dict(), before.back().first.substr(0, before.back().first.rfind('.')) +
                                            ".num_batches_tracked")
                .item<int64_t>(),
            1);
  // Eval: running statistics, deterministic, no state change, differs from train mode.
  model->eval();
  torch::NoGradGuard no_grad;
  const StateDict stats = model->state_dict();
  std::map<std::string, torch::Tensor> frozen;
  for (const auto& [k, v] : stats) frozen[k] = v.clone();
  torch::Tensor e1 = model->forward(x), e2 = model->forward(x);
  ASSERT_TRUE(torch::isfinite(e1).all().item<bool>());
  EXPECT_TRUE(torch::equal(e1, e2));
  for (const auto& [k, v] : model->state_dict()) EXPECT_TRUE(torch::equal(v, frozen.at(k))) << k;
  model->train();
  EXPECT_GT(testing::relative_error(model->forward(x), e1, testing::ErrorNorm::Max), 1e-3);
}

std::vector<std::string> ci_sized_backbones() {
  std::vector<std::string> names;
  for (const auto& n : backbone_names())
    if (!heavy(n)) names.push_back(n);
  return names;
}

INSTANTIATE_TEST_SUITE_P(Backbone, BackboneForward, ::testing::ValuesIn(ci_sized_backbones()),
                         [](const auto& info) { return info.param; });

// ---- the eval forward does not depend on the batch, the threads or the layout --------------

// Sets ATen's intra-op threads for one scope (the test binary runs on one unless told).
class IntraOpThreads {
 public:
  explicit IntraOpThreads(int n) : previous_(at::get_num_threads()) { at::set_num_threads(n); }
  ~IntraOpThreads() { at::set_num_threads(previous_); }

 private:
  int previous_;
};

// The rows of x through the model `batch` at a time.
torch::Tensor embed_in_batches(Backbone& model, const torch::Tensor& x, int64_t batch) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> parts;
  for (int64_t s = 0; s < x.size(0); s += batch) parts.push_back(model.forward(x.narrow(0, s, std::min(batch, x.size(0) - s))));
  return torch::cat(parts);
}

// Per row: max |a - b| / max |b|; the worst row.
double worst_row_error(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor d = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().amax(1);
  return (d / b.to(torch::kDouble).abs().amax(1)).max().item<double>();
}

class BackboneInvariance : public ::testing::TestWithParam<std::string> {};

TEST_P(BackboneInvariance, SameEmbeddingsAtAnyBatchThreadsAndLayout) {
  // Fan-in scaled weights and random BatchNorm statistics: a well-conditioned network, whose
  // float32 forward agrees with itself to ~1e-6 however the work is split. (A network whose
  // squeeze-excitation gates rounding decides cannot: models/gate_conditioning.h.)
  REQUIRE_PYTHON_TORCH();
  const std::string name = GetParam();
  BackboneOptions o = opts(name, 128);
  o.channels_last = false;
  auto nchw = make_backbone(o);
  randomise_state(*nchw, 11);
  {
    torch::NoGradGuard no_grad;
    for (auto& w : nchw->parameters())
      if (w.dim() == 4) w.normal_(0.0, std::sqrt(1.0 / (w.size(1) * w.size(2) * w.size(3))));
  }
  o.channels_last = true;
  auto cl = make_backbone(o);
  cl->load_state_dict(nchw->state_dict(), "the NCHW model");
  for (const auto& w : cl->parameters())
    if (w.dim() == 4 && w.size(2) * w.size(3) > 1) {
      ASSERT_TRUE(w.is_contiguous(at::MemoryFormat::ChannelsLast));
    }
  nchw->eval();
  cl->eval();
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({7, 3, 112, 112});
  GateConditioning gates;
  GateConditioningScope scope(gates);
  torch::Tensor ref;
  {
    IntraOpThreads one(1);
    ref = embed_in_batches(*nchw, x, 1);
  }
  struct Variant {
    const char* what;
    Backbone* model;
    int64_t batch;
    int threads;
  };
  // Every pair of two settings (batch x threads, batch x layout, threads x layout) is met by
  // one variant; the larger networks whose code a smaller one of their family runs in full
  // (r18/r50, ir_se50, mbf, vit_t) take the three that meet every value of each.
  std::vector<Variant> variants = {{"batch 7, 2 threads, channels-last", cl.get(), 7, 2},
                                   {"batch 4, 2 threads, NCHW", nchw.get(), 4, 2},
                                   {"batch 4, 1 thread, channels-last", cl.get(), 4, 1}};
  const std::set<std::string> full = {"r18", "r50", "ir_se50", "mbf", "mbf_small", "vit_t"};
  if (full.count(name))
    variants.insert(variants.end(), {{"batch 7, 1 thread, NCHW", nchw.get(), 7, 1},
                                     {"batch 1, 2 threads, channels-last", cl.get(), 1, 2},
                                     {"batch 1, 2 threads, NCHW", nchw.get(), 1, 2}});
  torch::Tensor for_python;  // batch 7, 2 threads, channels-last
  for (const Variant& v : variants) {
    IntraOpThreads threads(v.threads);
    const torch::Tensor y = embed_in_batches(*v.model, x, v.batch);
    EXPECT_LT(worst_row_error(y, ref), 1e-5) << name << ", " << v.what << " against batch 1, 1 thread, NCHW";
    if (!for_python.defined()) for_python = y;
  }
  settle_gate_conditioning(gates);
  EXPECT_EQ(gates.blocks > 0, name.rfind("ir_se", 0) == 0) << name;
  EXPECT_EQ(gates.undecided, 0) << describe_gate_conditioning(gates, name);
  // And both against the Python reference (plain torch.nn.functional ops on the same weights).
  const std::string dir = testing::temp_dir("models_invariance");
  save_backbone_weights(*nchw, dir + "/cpp_weights.pt");
  write_state_dict({{"input", x}, {"eval", for_python}}, dir + "/cpp_io.pt");
  auto [rc, out] = run_reference(dir, "check '" + dir + "' " + name + " 128");
  EXPECT_EQ(rc, 0) << out;
}

INSTANTIATE_TEST_SUITE_P(Backbone, BackboneInvariance, ::testing::ValuesIn(ci_sized_backbones()),
                         [](const auto& info) { return info.param; });

TEST(BackboneForward, VitHugeEvalForwardOfOne) {
  // 756M parameters: built, counted, and one eval forward (which count_macs is) on the CPU.
  auto model = make_backbone(opts("vit_h"));
  EXPECT_EQ(count_parameters(*model).total, vit_params(kVitArch.at("vit_h"), 512));
  EXPECT_EQ(count_parameters(*model).total, 756393984);
  EXPECT_TRUE(model->checkpointing());
  model->eval();
  torch::manual_seed(3);
  torch::Tensor y;
  {
    torch::NoGradGuard no_grad;
    y = model->forward(torch::randn({1, 3, 112, 112}));
  }
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{1, 512}));
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
  EXPECT_GT(y.abs().max().item<double>(), 0.0);
}

// Block i of a ViT (for its drop-path rate).
VitBlockImpl& vit_block(Backbone& m, int i) {
  auto found = m.named_modules()["blocks." + std::to_string(i)];
  return *found->as<VitBlockImpl>();
}

// Train mode everywhere but the head's BatchNorms, so that differences come from the blocks.
void train_blocks_only(Backbone& m) {
  m.train();
  for (auto& mod : m.modules())
    if (auto* bn = dynamic_cast<NormLayerImpl*>(mod.get())) bn->eval();
}

TEST(BackboneForward, VitDropPathAndMaskingOnlyInTraining) {
  // Small ViTs (dim 64, depth 4) with one regulariser at a time and the same weights.
  auto make = [](double drop_path, double mask) {
    return std::make_shared<VisionTransformer>(VitVariant{64, 4, 4, drop_path, mask, false}, opts("vit_t"));
  };
  auto plain = make(0.0, 0.0), dropping = make(0.5, 0.0), masking = make(0.0, 0.5);
  randomise_state(*plain, 21);
  {
    torch::NoGradGuard no_grad;
    for (auto* m : {dropping.get(), masking.get()})
      for (auto& [k, v] : m->state_dict()) v.copy_(lookup(plain->state_dict(), k));
  }
  // Stochastic depth rises linearly from 0 (first block) to the variant's rate (last).
  for (int i = 0; i < 4; ++i)
    EXPECT_NEAR(vit_block(*dropping, i).drop_path(), 0.5 * i / 3.0, 1e-7) << "block " << i;

  torch::manual_seed(4);
  // Four copies of one face: without randomness the four embeddings are equal.
  const torch::Tensor x = torch::randn({1, 3, 112, 112}).expand({4, 3, 112, 112}).contiguous();
  torch::NoGradGuard no_grad;
  auto run = [&](Backbone& m, uint64_t seed) {
    torch::manual_seed(seed);
    return m.forward(x);
  };
  plain->eval(), dropping->eval(), masking->eval();
  const torch::Tensor reference = run(*plain, 1);
  EXPECT_TRUE(torch::equal(run(*dropping, 1), reference));  // eval: no drop path
  EXPECT_TRUE(torch::equal(run(*masking, 1), reference));   // eval: no masking
  train_blocks_only(*plain);
  EXPECT_TRUE(torch::equal(run(*plain, 1), reference));  // nothing random without them
  auto rows_differ = [](const torch::Tensor& y) {
    return testing::relative_error(y[0], y[1], testing::ErrorNorm::Max) > 1e-3 ||
           testing::relative_error(y[0], y[2], testing::ErrorNorm::Max) > 1e-3;
  };
  EXPECT_FALSE(rows_differ(reference));
  for (auto* m : {dropping.get(), masking.get()}) {
    SCOPED_TRACE(m == dropping.get() ? "drop path" : "masking");
    train_blocks_only(*m);
    const torch::Tensor a = run(*m, 1), b = run(*m, 2), a2 = run(*m, 1);
    EXPECT_TRUE(torch::equal(a, a2));  // the randomness is the RNG's
    EXPECT_GT(testing::relative_error(a, b, testing::ErrorNorm::Max), 1e-3);
    EXPECT_TRUE(rows_differ(a));  // drawn per sample
  }
  // The learned mask token stands in for the dropped tokens, in training only.
  train_blocks_only(*masking);
  const torch::Tensor train_before = run(*masking, 1);
  masking->eval();
  const torch::Tensor eval_before = run(*masking, 1);
  masking->named_parameters()["mask_token"].add_(1.0);
  EXPECT_TRUE(torch::equal(run(*masking, 1), eval_before));
  train_blocks_only(*masking);
  EXPECT_GT(testing::relative_error(run(*masking, 1), train_before, testing::ErrorNorm::Max), 1e-3);
}

TEST(BackboneForward, DropoutOnlyInTraining) {
  auto o = opts("r18");
  o.dropout = 0.5;
  auto drop = make_backbone(o);
  auto plain = make_backbone(opts("r18"));
  const std::string dir = testing::temp_dir("models_dropout");
  save_backbone_weights(*drop, dir + "/w.pt");
  load_backbone_weights(*plain, dir + "/w.pt");
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({2, 3, 112, 112});
  torch::NoGradGuard no_grad;
  drop->eval();
  plain->eval();
  EXPECT_TRUE(torch::equal(drop->forward(x), plain->forward(x)));  // identity in eval
  drop->train();
  plain->train();
  const torch::Tensor a = drop->forward(x), b = drop->forward(x), c = plain->forward(x);
  EXPECT_GT(testing::relative_error(a, b, testing::ErrorNorm::Max), 1e-3);  // a fresh mask each step
  EXPECT_GT(testing::relative_error(a, c, testing::ErrorNorm::Max), 1e-3);
}

// A backbone in a reduced precision and/or channels-last against the same weights in fp32
// NCHW, on `dev`, in training mode: BatchNorm then normalises by the batch's statistics, so
// every activation stays O(1) whatever the random weights (random running statistics in eval
// mode let a deep network's activations grow past fp16's range, which no trained network
// does). The reduced precision must really run (the output differs from fp32's by at least
// `lo`) and stay close (at most `hi`); every trainable parameter's gradient is finite and the
// gradients together are within `grad_hi` of fp32's (relative L2).
struct PrecisionCase {
  BodyPrecision precision;
  bool channels_last;
  double lo, hi, grad_hi;
};

void check_against_fp32(const std::string& name, const torch::Device& dev, const std::vector<PrecisionCase>& cases,
                        int64_t batch) {
  SCOPED_TRACE(name + " on " + dev.str());
  torch::manual_seed(7);  // the initial weights the random state does not overwrite
  auto ref = make_backbone(opts(name));
  randomise_state(*ref, 11);
  ref->to(dev);
  ref->train();
  torch::manual_seed(2);
  const torch::Tensor x = torch::randn({batch, 3, 112, 112}).to(dev);
  // A fixed random projection of the output as the loss (the last BatchNorm normalises the
  // output over the batch, so a loss like sum(y^2) would hardly depend on the weights).
  const torch::Tensor proj = torch::randn({batch, 512}).to(dev);
  const torch::Tensor y_ref = ref->forward(x);
  (y_ref * proj).sum().backward();
  std::vector<std::string> keys;
  std::vector<torch::Tensor> ref_grads;
  for (const auto& kp : ref->named_parameters()) {
    if (!kp.value().requires_grad()) continue;
    keys.push_back(kp.key());
    ref_grads.push_back(kp.value().grad().flatten().to(torch::kDouble).cpu());
  }
  const torch::Tensor g_ref = torch::cat(ref_grads);
  ASSERT_GT(g_ref.norm().item<double>(), 0.0);
  for (const PrecisionCase& c : cases) {
    SCOPED_TRACE(to_string(c.precision) + (c.channels_last ? " channels_last" : " NCHW"));
    auto o = opts(name);
    o.precision = c.precision;
    o.channels_last = c.channels_last;
    auto model = make_backbone(o);
    model->to(dev);
    {
      torch::NoGradGuard no_grad;
      for (auto& [k, v] : model->state_dict()) v.copy_(lookup(ref->state_dict(), k));
    }
    if (c.channels_last) {
      const auto w = model->named_parameters()[backbone_traits(name).family == "mobilefacenet" ? "layers.0.layers.0.weight"
                                                                                    : "layer1.0.conv1.weight"];
      EXPECT_TRUE(w.is_contiguous(at::MemoryFormat::ChannelsLast));
    }
    model->train();
    const auto t0 = std::chrono::steady_clock::now();
    const torch::Tensor y = model->forward(x);
    EXPECT_EQ(y.scalar_type(), torch::kFloat);
    const double err = testing::relative_error(y.detach(), y_ref.detach());
    EXPECT_GE(err, c.lo) << "no trace of " << to_string(c.precision) << ": did it run in fp32?";
    EXPECT_LT(err, c.hi);
    EXPECT_FALSE(at::autocast::is_autocast_enabled(dev.type()));  // restored after the forward
    (y * proj).sum().backward();
    std::vector<torch::Tensor> grads;
    size_t k = 0;
    for (const auto& kp : model->named_parameters()) {
      if (!kp.value().requires_grad()) continue;
      ASSERT_LT(k, keys.size());
      EXPECT_EQ(kp.key(), keys[k++]);
      ASSERT_TRUE(kp.value().grad().defined()) << kp.key();
      EXPECT_EQ(kp.value().grad().scalar_type(), torch::kFloat) << kp.key();
      EXPECT_TRUE(torch::isfinite(kp.value().grad()).all().item<bool>()) << kp.key();
      grads.push_back(kp.value().grad().flatten().to(torch::kDouble).cpu());
    }
    ASSERT_EQ(k, keys.size());
    const double gerr = testing::relative_error(torch::cat(grads), g_ref);
    EXPECT_LT(gerr, c.grad_hi);
    std::cout << "[models] " << name << " " << to_string(c.precision) << (c.channels_last ? " channels_last" : "")
              << " on " << dev.str() << ": output error " << err << ", gradient error " << gerr << " ("
              << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s)\n";
  }
}

TEST(BackboneForward, ReducedPrecisionAndChannelsLastOnCpu) {
  // fp32 channels-last differs from NCHW by summation order only; bf16 keeps 8 bits of
  // mantissa (measured: output errors 0.016 (r18) and 0.042 (mbf), gradients 0.035-0.05 and
  // 0.21), fp16 11 (0.004, 0.03). CPU fp16 kernels are slow
  // reference paths: the small MobileFaceNet alone; CudaReducedPrecision runs r50 and mbf.
  // A gradient that is wrong rather than rounded is 1 or more away.
  check_against_fp32("r18", torch::kCPU,
                     {{BodyPrecision::Float32, true, 0.0, 1e-4, 1e-3},
                      {BodyPrecision::BFloat16, false, 1e-4, 0.1, 0.2},
                      {BodyPrecision::BFloat16, true, 1e-4, 0.1, 0.2}},
                     4);
  check_against_fp32("mbf", torch::kCPU, {{BodyPrecision::BFloat16, true, 1e-4, 0.1, 0.4}}, 4);
  // Squeeze-and-excitation's pooled means and sigmoid under autocast, in both layouts.
  check_against_fp32("ir_se50", torch::kCPU,
                     {{BodyPrecision::Float32, true, 0.0, 1e-4, 1e-3},
                      {BodyPrecision::BFloat16, false, 1e-4, 0.1, 0.2},
                      {BodyPrecision::BFloat16, true, 1e-4, 0.1, 0.2}},
                     4);
  check_against_fp32("mbf_small", torch::kCPU, {{BodyPrecision::Float16, true, 1e-5, 0.02, 0.2}}, 4);
  // Inside a caller's autocast region an fp32-policy model follows the caller.
  auto model = make_backbone(opts("r18"));
  model->eval();
  torch::NoGradGuard no_grad;
  AutocastScope outer(c10::DeviceType::CPU, true, torch::kBFloat16);
  EXPECT_EQ(model->forward(torch::randn({2, 3, 112, 112})).scalar_type(), torch::kBFloat16);
}

// cuBLAS's and cuDNN's TF32 off for a scope (fp32 then means fp32: TF32 rounds the inputs of
// the convolutions and GEMMs to 10 bits of mantissa), restored when it ends, however it ends.
class NoTf32Scope {
 public:
  NoTf32Scope() : blas_(at::globalContext().allowTF32CuBLAS()), dnn_(at::globalContext().allowTF32CuDNN()) {
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
  }
  ~NoTf32Scope() {
    at::globalContext().setAllowTF32CuBLAS(blas_);
    at::globalContext().setAllowTF32CuDNN(dnn_);
  }
  NoTf32Scope(const NoTf32Scope&) = delete;
  NoTf32Scope& operator=(const NoTf32Scope&) = delete;

 private:
  bool blas_, dnn_;
};

// check_against_fp32 with every tensor bounded on its own: each sample's output (relative L2
// of its embedding) and each parameter's gradient, so that one wrong layer cannot hide in the
// sum over all of them. A parameter's error is taken relative to its gradient's norm plus a
// floor of `floor` times the typical gradient element (the RMS over all parameters) per
// element: a gradient that vanishes in exact arithmetic (a bias before a training-mode
// BatchNorm) holds only rounding, which no relative bound of its own can judge.
struct TensorwiseCase {
  BodyPrecision precision;
  bool channels_last;
  double lo;       // the whole output differs from fp32's by at least this (the precision ran)
  double out_hi;   // each sample's output within this of fp32's
  double grad_hi;  // each parameter's gradient within this of fp32's
  double floor;
};

void check_each_tensor_against_fp32(const std::string& name, const torch::Device& dev,
                                    const std::vector<TensorwiseCase>& cases, int64_t batch) {
  SCOPED_TRACE(name + " on " + dev.str());
  torch::manual_seed(7);
  auto ref = make_backbone(opts(name));
  randomise_state(*ref, 11);
  ref->to(dev);
  ref->train();
  torch::manual_seed(2);
  const torch::Tensor x = torch::randn({batch, 3, 112, 112}).to(dev);
  const torch::Tensor proj = torch::randn({batch, 512}).to(dev);
  const torch::Tensor y_ref = ref->forward(x);
  (y_ref * proj).sum().backward();
  std::vector<std::string> keys;
  std::vector<torch::Tensor> ref_grads;
  double sum_sq = 0;
  int64_t count = 0;
  for (const auto& kp : ref->named_parameters()) {
    if (!kp.value().requires_grad()) continue;
    keys.push_back(kp.key());
    ref_grads.push_back(kp.value().grad().to(torch::kDouble).cpu());
    sum_sq += ref_grads.back().pow(2).sum().item<double>();
    count += ref_grads.back().numel();
  }
  const double rms = std::sqrt(sum_sq / static_cast<double>(count));
  ASSERT_GT(rms, 0.0);
  const torch::Tensor yr = y_ref.detach().to(torch::kDouble).cpu();
  for (const TensorwiseCase& c : cases) {
    SCOPED_TRACE(to_string(c.precision) + (c.channels_last ? " channels_last" : " NCHW"));
    auto o = opts(name);
    o.precision = c.precision;
    o.channels_last = c.channels_last;
    auto model = make_backbone(o);
    model->to(dev);
    {
      torch::NoGradGuard no_grad;
      for (auto& [k, v] : model->state_dict()) v.copy_(lookup(ref->state_dict(), k));
    }
    model->train();
    const torch::Tensor y = model->forward(x);
    EXPECT_EQ(y.scalar_type(), torch::kFloat);
    const torch::Tensor yd = y.detach().to(torch::kDouble).cpu();
    const double err = testing::relative_error(yd, yr);
    EXPECT_GE(err, c.lo) << "no trace of " << to_string(c.precision) << ": did it run in fp32?";
    const torch::Tensor row_err = (yd - yr).norm(2, {1}) / yr.norm(2, {1});
    const int64_t worst_row = row_err.argmax().item<int64_t>();
    EXPECT_LT(row_err[worst_row].item<double>(), c.out_hi) << "sample " << worst_row;
    (y * proj).sum().backward();
    size_t k = 0;
    double worst = 0;
    std::string worst_key;
    for (const auto& kp : model->named_parameters()) {
      if (!kp.value().requires_grad()) continue;
      ASSERT_LT(k, keys.size());
      EXPECT_EQ(kp.key(), keys[k]);
      const torch::Tensor g = kp.value().grad();
      ASSERT_TRUE(g.defined()) << kp.key();
      EXPECT_EQ(g.scalar_type(), torch::kFloat) << kp.key();
      const torch::Tensor gd = g.to(torch::kDouble).cpu(), r = ref_grads[k++];
      EXPECT_TRUE(torch::isfinite(gd).all().item<bool>()) << kp.key();
      const double e = (gd - r).norm().item<double>() /
                       (r.norm().item<double>() + c.floor * rms * std::sqrt(static_cast<double>(r.numel())));
      EXPECT_LT(e, c.grad_hi) << kp.key() << " " << g.sizes();
      if (e > worst) worst = e, worst_key = kp.key();
    }
    ASSERT_EQ(k, keys.size());
    std::cout << "[models] " << name << " " << to_string(c.precision) << (c.channels_last ? " channels_last" : "")
              << " on " << dev.str() << ": output error " << err << " (worst sample " << row_err.max().item<double>()
              << "), worst gradient error " << worst << " (" << worst_key << ")\n";
  }
}

// On a GPU: TF32 off (for the reference as for the cases), so that fp32 channels-last differs
// from fp32 NCHW by cuDNN's choice of algorithm and summation order alone; the reduced
// precisions against real fp32. Every sample's output and every parameter's gradient on its own.
// The same comparison on the CPU (batch 16) measured: fp32 channels-last, samples within 1e-5,
// the worst parameter 0.03 with a floor of 1e-3 (a BatchNorm bias whose gradient is rounding
// alone: 3.2 with no floor); bf16, samples within 0.03, the worst parameter 0.40 (r50) and 0.37
// (mbf) with a floor of 0.05. A wrong gradient is 1 or more away.
TEST(BackboneForward, CudaReducedPrecision) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  NoTf32Scope no_tf32;
  for (const std::string name : {"r50", "ir_se50", "mbf"})
    check_each_tensor_against_fp32(name, torch::Device(torch::kCUDA, 0),
                                   {{BodyPrecision::Float32, true, 0.0, 1e-3, 5e-2, 1e-2},
                                    {BodyPrecision::BFloat16, true, 1e-4, 0.15, 0.6, 0.05},
                                    {BodyPrecision::BFloat16, false, 1e-4, 0.15, 0.6, 0.05},
                                    {BodyPrecision::Float16, true, 1e-5, 0.05, 0.3, 0.05}},
                                   16);
}

// ---- activation checkpointing ----------------------------------------------------------

// One training forward/backward: the output, every parameter's and the input's gradient,
// and the state afterwards (BN statistics).
struct StepResult {
  torch::Tensor y, input_grad;
  std::map<std::string, torch::Tensor> grads, state;
  int checkpoint_nodes = 0, graph_nodes = 0;
  // Trainable parameters whose gradient accumulator the graph does not reach (what
  // DataParallel's unused-parameter walk would mark unused).
  std::vector<std::string> unreached;
};

StepResult train_step(Backbone& m, const torch::Tensor& x, const torch::Tensor& w, uint64_t seed) {
  m.train();
  m.zero_grad();
  torch::manual_seed(seed);
  StepResult r;
  const torch::Tensor xi = x.clone().requires_grad_(true);
  r.y = m.forward(xi);
  // The graph the backward will walk: checkpointed segments are single nodes in it.
  std::vector<torch::autograd::Node*> stack{r.y.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!stack.empty()) {
    auto* n = stack.back();
    stack.pop_back();
    if (!n || !seen.insert(n).second) continue;
    r.checkpoint_nodes += n->name().find("CheckpointFn") != std::string::npos;
    for (const auto& e : n->next_edges()) stack.push_back(e.function.get());
  }
  r.graph_nodes = static_cast<int>(seen.size());
  for (const auto& kp : m.named_parameters())
    if (kp.value().requires_grad() && !seen.count(torch::autograd::impl::grad_accumulator(kp.value()).get()))
      r.unreached.push_back(kp.key());
  (r.y * w).sum().backward();
  r.input_grad = xi.grad();
  for (const auto& kp : m.named_parameters())
    if (kp.value().requires_grad()) r.grads[kp.key()] = kp.value().grad().clone();
  for (const auto& [k, v] : m.state_dict()) r.state[k] = v.clone();
  return r;
}


class Checkpointing : public ::testing::TestWithParam<CheckpointCase> {};

TEST_P(Checkpointing, BackwardEqualsPlainInFloat64) {
  const auto& c = GetParam();
  auto plain_opts = opts(c.name), ck_opts = opts(c.name);
  plain_opts.checkpointing = false;
  ck_opts.checkpointing = true;
  auto plain = make_backbone(plain_opts), ck = make_backbone(ck_opts);
  randomise_state(*plain, 9);
  {
    torch::NoGradGuard no_grad;
    for (auto& [k, v] : ck->state_dict()) v.copy_(lookup(plain->state_dict(), k));
  }
  plain->to(torch::kDouble);
  ck->to(torch::kDouble);
  torch::manual_seed(8);
  const torch::Tensor x = torch::randn({2, 3, 112, 112}, torch::kDouble);
  const torch::Tensor w = torch::randn({2, 512}, torch::kDouble);

  // Same seed: the recomputation must redraw the forward's drop-path masks (ViT) and keep
  // BN statistics as one forward leaves them (iresnet).
  const StepResult a = train_step(*plain, x, w, 5), b = train_step(*ck, x, w, 5);
  EXPECT_EQ(a.checkpoint_nodes, 0);
  EXPECT_EQ(b.checkpoint_nodes, c.segments);
  std::cout << "[models] " << c.name << " autograd nodes: plain " << a.graph_nodes << ", checkpointed "
            << b.graph_nodes << "\n";
  EXPECT_LT(b.graph_nodes, a.graph_nodes);  // the segments' insides are not kept
  // The segments' parameters are inputs of their checkpoint nodes, so the walk reaches them.
  EXPECT_TRUE(a.unreached.empty()) << a.unreached.front();
  EXPECT_TRUE(b.unreached.empty()) << b.unreached.front();
  EXPECT_LT(testing::relative_error(b.y, a.y), 1e-12);
  EXPECT_LT(testing::relative_error(b.input_grad, a.input_grad), 1e-6);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (const auto& [k, g] : a.grads) EXPECT_LT(testing::relative_error(b.grads.at(k), g), 1e-6) << k;
  for (const auto& [k, v] : a.state) {
    if (v.is_floating_point()) {
      EXPECT_LT(testing::relative_error(b.state.at(k), v, testing::ErrorNorm::Max), 1e-12) << k;
    } else {
      EXPECT_TRUE(torch::equal(b.state.at(k), v)) << k;
    }
  }
  // Eval and no-grad forwards are plain.
  ck->eval();
  plain->eval();
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(ck->forward(x), plain->forward(x)));
  }
  if (backbone_traits(c.name).family == "vit") {
    // The comparison has teeth: another seed draws other masks and other gradients.
    const StepResult other = train_step(*plain, x, w, 6);
    EXPECT_GT(testing::relative_error(other.grads.at("blocks.11.mlp.fc2.weight"), a.grads.at("blocks.11.mlp.fc2.weight")),
              1e-3);
  }
}

INSTANTIATE_TEST_SUITE_P(Backbone, Checkpointing, ::testing::ValuesIn(checkpoint_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(Checkpointing, RecomputesUnderTheForwardsAutocast) {
  // bf16 body: the rerun must use bf16 as the forward did. A rerun in fp32 would differ from
  // the plain bf16 backward by bf16 rounding (~1e-2), far above the tolerance.
  auto o = opts("vit_t");
  o.precision = BodyPrecision::BFloat16;
  o.checkpointing = false;
  auto plain = make_backbone(o);
  o.checkpointing = true;
  auto ck = make_backbone(o);
  o.precision = BodyPrecision::Float32;
  auto fp32 = make_backbone(o);
  {
    torch::NoGradGuard no_grad;
    for (auto* m : {ck.get(), fp32.get()})
      for (auto& [k, v] : m->state_dict()) v.copy_(lookup(plain->state_dict(), k));
  }
  torch::manual_seed(8);
  const torch::Tensor x = torch::randn({2, 3, 112, 112});
  const torch::Tensor w = torch::randn({2, 512});
  const StepResult a = train_step(*plain, x, w, 5), b = train_step(*ck, x, w, 5), f = train_step(*fp32, x, w, 5);
  EXPECT_EQ(b.checkpoint_nodes, 12);
  const std::string probe = "blocks.5.attn.qkv.weight";
  const double same = testing::relative_error(b.grads.at(probe), a.grads.at(probe));
  const double other = testing::relative_error(f.grads.at(probe), a.grads.at(probe));
  std::cout << "[models] bf16 checkpointed vs plain " << same << ", fp32 vs bf16 " << other << "\n";
  EXPECT_LT(same, 1e-5);
  EXPECT_GT(other, 1e-3);
  for (const auto& [k, g] : a.grads) EXPECT_LT(testing::relative_error(b.grads.at(k), g), 1e-5) << k;
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
}

}  // namespace
}  // namespace faceshard
