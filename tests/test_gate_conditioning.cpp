// Tests of models/gate_conditioning: an IR-SE network in the state of a run of two steps
// (arcface_torch's init, two steps' BatchNorm running statistics) has squeeze-excitation gates
// that float32 rounding decides, and the tools that embed say so in one warning line; a
// well-scaled one, an iresnet without SE, and forwards under autograd are not assessed as such.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <opencv2/core.hpp>

#include "app/eval/evaluation.h"
#include "models/backbone_registry.h"
#include "models/gate_conditioning.h"

namespace faceshard {
namespace {

std::shared_ptr<Backbone> network(const std::string& name) {
  BackboneOptions o;
  o.name = name;
  o.embedding_size = 128;
  return make_backbone(o);
}

// As after two training steps from arcface_torch's init (conv N(0, 0.1), BN statistics 0 / 1):
// two train-mode forwards move every BatchNorm's running statistics twice (momentum 0.1).
void two_steps_of_statistics(Backbone& model) {
  torch::manual_seed(21);
  model.train();
  torch::NoGradGuard no_grad;
  for (int i = 0; i < 2; ++i) model.forward(torch::randn({8, 3, 112, 112}));
  model.eval();
}

GateConditioning assess(Backbone& model, const torch::Tensor& x) {
  GateConditioning c;
  GateConditioningScope scope(c);
  torch::NoGradGuard no_grad;
  model.forward(x);
  return c;
}

TEST(GateConditioning, AnIrSeOfTwoStepsHasGatesThatRoundingDecides) {
  auto model = network("ir_se50");
  two_steps_of_statistics(*model);
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({4, 3, 112, 112});
  const GateConditioning c = assess(*model, x);
  EXPECT_EQ(c.blocks, 3 + 4 + 14 + 3);
  EXPECT_EQ(c.gates, 4 * (3 * 64 + 4 * 128 + 14 * 256 + 3 * 512));
  EXPECT_GT(c.undecided, 0);
  EXPECT_GE(c.first_block, 0);
  // The gates' inputs have grown far past the sigmoid's width: the cause, in the line.
  EXPECT_GT(c.largest_input, 1e4);
  const std::string line = describe_gate_conditioning(c, "ir_se50");
  EXPECT_NE(line.find("ir_se50: "), std::string::npos) << line;
  EXPECT_NE(line.find("float32 rounding"), std::string::npos) << line;
  EXPECT_NE(line.find("BatchNorm running statistics"), std::string::npos) << line;
}

TEST(GateConditioning, WellScaledNetworksAndOtherForwardsAreNotFlagged) {
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({4, 3, 112, 112});
  // Fan-in scaled weights: every gate is decided.
  auto scaled = network("ir_se50");
  {
    torch::NoGradGuard no_grad;
    for (auto& w : scaled->parameters())
      if (w.dim() == 4) w.normal_(0.0, std::sqrt(1.0 / (w.size(1) * w.size(2) * w.size(3))));
  }
  two_steps_of_statistics(*scaled);
  GateConditioning c = assess(*scaled, x);
  EXPECT_EQ(c.blocks, 24);
  EXPECT_EQ(c.undecided, 0) << describe_gate_conditioning(c, "ir_se50");
  EXPECT_EQ(describe_gate_conditioning(c, "ir_se50"), "");
  // r50 in the state that flags ir_se50 has no gates.
  auto plain = network("r50");
  two_steps_of_statistics(*plain);
  c = assess(*plain, x);
  EXPECT_EQ(c.blocks, 0);
  EXPECT_EQ(c.undecided, 0);
  // Under autograd (training) and outside a scope nothing is assessed.
  auto early = network("ir_se50");
  two_steps_of_statistics(*early);
  GateConditioning with_grad;
  {
    GateConditioningScope scope(with_grad);
    early->forward(x);
  }
  EXPECT_EQ(with_grad.blocks, 0);
  GateConditioning outer;
  {
    GateConditioningScope scope(outer);
    GateConditioning inner = assess(*early, x);  // the innermost scope receives
    EXPECT_GT(inner.undecided, 0);
  }
  EXPECT_EQ(outer.blocks, 0);
}

TEST(GateConditioning, EmbeddingToolsWarnOnceNamingTheCause) {
  auto model = network("ir_se50");
  two_steps_of_statistics(*model);
  torch::manual_seed(4);
  const torch::Tensor pixels = (torch::rand({3, 112, 112, 3}) * 255).to(torch::kUInt8);
  const ImageSource load = [&](int64_t i) {
    return cv::Mat(112, 112, CV_8UC3, pixels[i].data_ptr<uint8_t>()).clone();
  };
  ::testing::internal::CaptureStderr();
  embed_images(*model, 3, load, 2, torch::kCPU, true, true);
  embed_images(*model, 3, load, 2, torch::kCPU, true, true);
  const std::string err = ::testing::internal::GetCapturedStderr();
  const auto first = err.find("squeeze-excitation gate values");
  ASSERT_NE(first, std::string::npos) << err;
  EXPECT_EQ(err.find("squeeze-excitation gate values", first + 1), std::string::npos) << "warned twice:\n" << err;
  EXPECT_NE(err.find("warning: ir_se50: "), std::string::npos) << err;
}

}  // namespace
}  // namespace faceshard
