// MobileFaceNet as insightface's arcface_torch defines it (backbones/mobilefacenet.py):
// depthwise-separable stages with residuals and a GDC head; "mbf" = blocks (1,4,6,2)
// scale 2, "mbf_large" = blocks (2,8,12,4) scale 4. Names match its state_dict.
#pragma once
#include <torch/torch.h>

#include <array>
#include <functional>
#include <vector>

#include "models/backbone.h"
#include "models/norm_layer.h"

namespace faceshard {

// Conv (no bias) -> BN [-> PReLU]: arcface_torch's ConvBlock (with PReLU) and LinearBlock
// (without); both keep their layers under "layers.0/1/2".
class MbfConvBlockImpl : public torch::nn::Module {
 public:
  MbfConvBlockImpl(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t padding,
                   int64_t groups, bool prelu);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Conv2d conv_{nullptr};
  NormLayer bn_{nullptr};
  torch::nn::PReLU prelu_{nullptr};
};
TORCH_MODULE(MbfConvBlock);

// 1x1 expand to `groups` channels -> depthwise 3x3 (stride) -> 1x1 linear projection,
// with an identity shortcut when `residual`.
class MbfDepthWiseImpl : public torch::nn::Module {
 public:
  MbfDepthWiseImpl(int64_t in, int64_t out, bool residual, int64_t stride, int64_t groups);
  torch::Tensor forward(const torch::Tensor& x);
  bool residual() const { return residual_; }

 private:
  bool residual_;
  MbfConvBlock expand_{nullptr}, depthwise_{nullptr}, project_{nullptr};
};
TORCH_MODULE(MbfDepthWise);

class MobileFaceNet : public Backbone {
 public:
  MobileFaceNet(std::array<int64_t, 4> blocks, int64_t scale, BackboneOptions options);
  torch::Tensor forward(torch::Tensor images) override;

 private:
  // The entries of "layers" in order (a ConvBlock, DepthWise or Residual each).
  std::vector<std::function<torch::Tensor(const torch::Tensor&)>> body_;
  MbfConvBlock conv_sep_{nullptr};
  MbfConvBlock gdc_{nullptr};  // features.layers.0: depthwise 7x7 + BN
  torch::nn::Linear gdc_fc_{nullptr};
  NormLayer gdc_bn_{nullptr};
};

}  // namespace faceshard
