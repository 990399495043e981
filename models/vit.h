// Vision Transformers as insightface's arcface_torch defines them (backbones/vit.py):
// 9x9 patches of the 112x112 face (144 tokens), learned position embedding, no class
// token, pre-norm blocks (LayerNorm, multi-head attention with qkv without bias, MLP x4
// with ReLU6), stochastic depth, random token masking in training, and a flatten ->
// Linear -> BN -> Linear -> BN head. Parameter names match its state_dict.
#pragma once
#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include "models/backbone.h"
#include "models/norm_layer.h"

namespace faceshard {

// One named variant of arcface_torch's backbones/__init__.py.
struct VitVariant {
  int64_t dim = 0, depth = 0, heads = 0;
  double drop_path = 0.0;   // stochastic depth of the last block (linear from 0 over depth)
  double mask_ratio = 0.0;  // fraction of tokens dropped before the blocks in training
  bool checkpointing = false;  // arcface_torch's using_checkpoint
};
// vit_t, vit_t_dp005_mask0, vit_s, vit_s_dp005_mask_0, vit_b, vit_b_dp005_mask_005,
// vit_l_dp005_mask_005, vit_h; nullopt for other names.
std::optional<VitVariant> vit_variant(const std::string& name);
std::vector<std::string> vit_names();

// Multi-head self-attention: qkv (no bias) and proj under the ambient precision; scores,
// softmax and the weighted sum in at least fp32 with autocast off, as arcface_torch does.
class VitAttentionImpl : public torch::nn::Module {
 public:
  VitAttentionImpl(int64_t dim, int64_t heads);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  int64_t heads_;
  double scale_;
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr};
};
TORCH_MODULE(VitAttention);

class VitMlpImpl : public torch::nn::Module {
 public:
  VitMlpImpl(int64_t dim, int64_t hidden);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(VitMlp);

// x + drop_path(attn(norm1(x))), then x + drop_path(mlp(norm2(x))).
class VitBlockImpl : public torch::nn::Module {
 public:
  VitBlockImpl(int64_t dim, int64_t heads, double drop_path);
  torch::Tensor forward(const torch::Tensor& x);
  double drop_path() const { return drop_path_; }

 private:
  torch::Tensor drop(const torch::Tensor& y) const;
  double drop_path_;
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  VitAttention attn_{nullptr};
  VitMlp mlp_{nullptr};
};
TORCH_MODULE(VitBlock);

class VisionTransformer : public Backbone {
 public:
  VisionTransformer(const VitVariant& variant, BackboneOptions options);
  torch::Tensor forward(torch::Tensor images) override;

  const VitVariant& variant() const { return variant_; }
  static constexpr int64_t kImageSize = 112, kPatch = 9, kTokens = (kImageSize / kPatch) * (kImageSize / kPatch);

 protected:
  bool accepts_input_size(int64_t height, int64_t width) const override;

 private:
  VitVariant variant_;
  torch::Tensor pos_embed_, mask_token_;
  torch::nn::Conv2d patch_embed_{nullptr};  // "patch_embed.proj"
  std::vector<VitBlock> blocks_;
  torch::nn::LayerNorm norm_{nullptr};
  torch::nn::Linear feature_fc1_{nullptr}, feature_fc2_{nullptr};  // feature.0, feature.2
  NormLayer feature_bn1_{nullptr}, feature_bn2_{nullptr};          // feature.1, feature.3
};

}  // namespace faceshard
