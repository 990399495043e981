// iresnet18/34/50/100/200 and iresnet2060: the "improved" pre-activation ResNets of
// insightface's arcface_torch (backbones/iresnet.py, iresnet2060.py), with identical
// parameter and buffer names so released PyTorch weights load unchanged.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "models/backbone.h"
#include "models/norm_layer.h"

namespace faceshard {

// BN -> conv3x3 -> BN -> PReLU -> conv3x3(stride) -> BN, plus the shortcut (1x1 conv + BN
// when the shape changes); no activation after the addition.
class IBasicBlockImpl : public torch::nn::Module {
 public:
  IBasicBlockImpl(int64_t inplanes, int64_t planes, int64_t stride);
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
};
TORCH_MODULE(IBasicBlock);

class IResNet : public Backbone {
 public:
  // blocks per stage, e.g. {3, 4, 14, 3} for r50: four stages of at least one block each,
  // else usage_error naming options.name, the stages given and the known depths.
  IResNet(std::vector<int64_t> layers, BackboneOptions options);
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

// Blocks per stage of a named iresnet ("r18", "r34", "r50", "r100", "r200", "r2060");
// usage_error naming the depth and the known ones for any other name.
std::vector<int64_t> iresnet_layers(const std::string& name);

}  // namespace faceshard
