// iresnet18/34/50/100/200 and iresnet2060: the "improved" pre-activation ResNets of
// insightface's arcface_torch (backbones/iresnet.py, iresnet2060.py), with identical
// parameter and buffer names so released PyTorch weights load unchanged; and IR-SE50/100,
// the same network with squeeze-and-excitation in every block (insightface's fresnet
// use_se=True), its SE weights named as the PyTorch IR-SE ports' SEModule (se.fc1, se.fc2).
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "models/backbone.h"
#include "models/norm_layer.h"

namespace faceshard {

// Squeeze-and-excitation: x * sigmoid(fc2(relu(fc1(mean over H, W of x)))), fc1 and fc2
// 1x1 convolutions without bias (channels -> channels / reduction -> channels), named as
// the SEModule of the PyTorch IR-SE ports (TreB1eN's InsightFace_Pytorch: se.fc1, se.fc2).
class SqueezeExcitationImpl : public torch::nn::Module {
 public:
  SqueezeExcitationImpl(int64_t channels, int64_t reduction);
  // The per-channel scale [B, C, 1, 1] (the caller multiplies).
  torch::Tensor scale(const torch::Tensor& x);
  const torch::nn::Conv2d& fc1() const { return fc1_; }
  const torch::nn::Conv2d& fc2() const { return fc2_; }

 private:
  torch::nn::Conv2d fc1_{nullptr};
  torch::nn::Conv2d fc2_{nullptr};
};
TORCH_MODULE(SqueezeExcitation);

// BN -> conv3x3 -> BN -> PReLU -> conv3x3(stride) -> BN [-> SE scale], plus the shortcut
// (1x1 conv + BN when the shape changes); no activation after the addition.
class IBasicBlockImpl : public torch::nn::Module {
 public:
  // se_reduction > 0: a squeeze-and-excitation branch ("se") reducing planes by it.
  IBasicBlockImpl(int64_t inplanes, int64_t planes, int64_t stride, int64_t se_reduction = 0);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  NormLayer bn1_{nullptr};
  torch::nn::Conv2d conv1_{nullptr};
  NormLayer bn2_{nullptr};
  torch::nn::PReLU prelu_{nullptr};
  torch::nn::Conv2d conv2_{nullptr};
  NormLayer bn3_{nullptr};
  // "downsample.0" (conv) and "downsample.1" (BN); null when the block keeps the shape.
  torch::nn::Conv2d down_conv_{nullptr};
  NormLayer down_bn_{nullptr};
  SqueezeExcitation se_{nullptr};
};
TORCH_MODULE(IBasicBlock);

class IResNet : public Backbone {
 public:
  // blocks per stage, e.g. {3, 4, 14, 3} for r50: four stages of at least one block each,
  // else usage_error naming options.name, the stages given and the known depths.
  // se_reduction > 0: IR-SE, every block with squeeze-and-excitation reducing by it (16).
  IResNet(std::vector<int64_t> layers, BackboneOptions options, int64_t se_reduction = 0);
  torch::Tensor forward(torch::Tensor images) override;

  // With checkpointing, stage `stage` (0-based) runs as this many segments, all but the last
  // recomputed in backward (torch.utils.checkpoint_sequential's split): layer2 in 20 and
  // layer3 in 100 as arcface_torch's r2060, at most one block per segment; 0: not split.
  static int64_t checkpoint_segments(size_t stage, int64_t blocks);

 private:
  torch::Tensor run_stage(std::vector<IBasicBlock>& stage, int64_t segments, torch::Tensor x);

  torch::nn::Conv2d conv1_{nullptr};
  NormLayer bn1_{nullptr};
  torch::nn::PReLU prelu_{nullptr};
  std::vector<std::vector<IBasicBlock>> stages_;  // layer1..layer4
  NormLayer bn2_{nullptr};
  torch::nn::Linear fc_{nullptr};
  NormLayer features_{nullptr};
};

// Blocks per stage of a named iresnet ("r18", "r34", "r50", "r100", "r200", "r2060",
// "ir_se50", "ir_se100"); usage_error naming the depth and the known ones for any other name.
std::vector<int64_t> iresnet_layers(const std::string& name);

}  // namespace faceshard
