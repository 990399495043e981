#include "models/vit.h"

#include <ATen/autocast_mode.h>

#include <cmath>
#include <utility>

#include "models/activation_checkpoint.h"
#include "models/model_stats.h"

namespace faceshard {
namespace {
namespace nn = torch::nn;

struct NamedVariant {
  const char* name;
  VitVariant v;
};

// arcface_torch's backbones/__init__.py: dim, depth, heads, drop_path_rate, mask_ratio,
// using_checkpoint. The dp005/mask variants are its WebFace42M settings. The mask ratio is
// what arcface_torch's training actually did: its forward calls random_masking without the
// ratio, whose default is 0.1, so every variant that masks at all (the *_mask_005 ones
// included) drops 10% of the tokens; a run meant to reproduce a published one needs that.
const std::vector<NamedVariant>& variants() {
  static const std::vector<NamedVariant> table = {
      {"vit_t", {256, 12, 8, 0.1, 0.1, false}},
      {"vit_t_dp005_mask0", {256, 12, 8, 0.05, 0.0, false}},
      {"vit_s", {512, 12, 8, 0.1, 0.1, false}},
      {"vit_s_dp005_mask_0", {512, 12, 8, 0.05, 0.0, false}},
      {"vit_b", {512, 24, 8, 0.1, 0.1, true}},
      {"vit_b_dp005_mask_005", {512, 24, 8, 0.05, 0.1, true}},
      {"vit_l_dp005_mask_005", {768, 24, 8, 0.05, 0.1, true}},
      {"vit_h", {1024, 48, 8, 0.1, 0.0, true}},
  };
  return table;
}

nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return nn::Linear(nn::LinearOptions(in, out).bias(bias));
}
nn::LayerNorm layer_norm(int64_t dim) {
  return nn::LayerNorm(nn::LayerNormOptions({dim}).eps(1e-5));
}

// timm's trunc_normal_(std=0.02) truncates at +-2, a hundred standard deviations out: the
// plain normal with the same clamp is the same distribution and much cheaper on 700M weights.
void trunc_normal(torch::Tensor& t, double std) { t.normal_(0.0, std).clamp_(-2.0, 2.0); }

bool reduced(const torch::Tensor& t) { return t.scalar_type() == torch::kHalf || t.scalar_type() == torch::kBFloat16; }
}  // namespace

std::optional<VitVariant> vit_variant(const std::string& name) {
  for (const auto& e : variants())
    if (name == e.name) return e.v;
  return std::nullopt;
}

std::vector<std::string> vit_names() {
  std::vector<std::string> names;
  for (const auto& e : variants()) names.emplace_back(e.name);
  return names;
}

VitAttentionImpl::VitAttentionImpl(int64_t dim, int64_t heads)
    : heads_(heads), scale_(std::pow(static_cast<double>(dim / heads), -0.5)) {
  qkv_ = register_module("qkv", linear(dim, 3 * dim, false));
  proj_ = register_module("proj", linear(dim, dim, true));
}

torch::Tensor VitAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), N = x.size(1), C = x.size(2);
  // [3, B, heads, N, C/heads]
  const torch::Tensor qkv = counted_linear(qkv_, x).reshape({B, N, 3, heads_, C / heads_}).permute({2, 0, 3, 1, 4});
  torch::Tensor out;
  {
    // Scores and softmax of half-precision q/k overflow and lose the small weights.
    const auto device = x.device().type();
    AutocastScope fp32(device, false, at::autocast::get_autocast_dtype(device));
    auto up = [](torch::Tensor t) { return reduced(t) ? t.to(torch::kFloat) : t; };
    const torch::Tensor q = up(qkv[0]), k = up(qkv[1]), v = up(qkv[2]);
    torch::Tensor attn = (counted_matmul(q, k.transpose(-2, -1)) * scale_).softmax(-1);
    out = counted_matmul(attn, v).transpose(1, 2).reshape({B, N, C});
  }
  return counted_linear(proj_, out);
}

VitMlpImpl::VitMlpImpl(int64_t dim, int64_t hidden) {
  fc1_ = register_module("fc1", linear(dim, hidden, true));
  fc2_ = register_module("fc2", linear(hidden, dim, true));
}

torch::Tensor VitMlpImpl::forward(const torch::Tensor& x) {
  return counted_linear(fc2_, torch::hardtanh(counted_linear(fc1_, x), 0.0, 6.0));  // ReLU6
}

VitBlockImpl::VitBlockImpl(int64_t dim, int64_t heads, double drop_path) : drop_path_(drop_path) {
  // Registration order = PyTorch's state_dict order (norm1, norm2, attn, mlp).
  norm1_ = register_module("norm1", layer_norm(dim));
  norm2_ = register_module("norm2", layer_norm(dim));
  attn_ = register_module("attn", VitAttention(dim, heads));
  mlp_ = register_module("mlp", VitMlp(dim, 4 * dim));
}

torch::Tensor VitBlockImpl::drop(const torch::Tensor& y) const {
  // Stochastic depth (timm's DropPath): whole samples dropped, survivors scaled by 1/keep.
  if (!is_training() || drop_path_ <= 0.0) return y;
  const double keep = 1.0 - drop_path_;
  std::vector<int64_t> shape(static_cast<size_t>(y.dim()), 1);
  shape[0] = y.size(0);
  torch::Tensor mask = torch::empty(shape, y.options()).bernoulli_(keep);
  if (keep > 0.0) mask.div_(keep);
  return y * mask;
}

torch::Tensor VitBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = x + drop(attn_->forward(norm1_->forward(x)));
  return h + drop(mlp_->forward(norm2_->forward(h)));
}

VisionTransformer::VisionTransformer(const VitVariant& variant, BackboneOptions options)
    : Backbone("VisionTransformer", std::move(options)), variant_(variant) {
  const int64_t D = variant_.dim;
  // Own parameters first, then the children: the order of Python's state_dict.
  pos_embed_ = register_parameter("pos_embed", torch::zeros({1, kTokens, D}));
  mask_token_ = register_parameter("mask_token", torch::zeros({1, 1, D}));
  auto patch = register_module("patch_embed", std::make_shared<nn::Module>("PatchEmbed"));
  patch_embed_ = patch->register_module("proj", nn::Conv2d(nn::Conv2dOptions(3, D, kPatch).stride(kPatch)));
  auto blocks = register_module("blocks", nn::ModuleList());
  // Stochastic depth rises linearly over depth, from 0 at the first block (torch.linspace
  // in float32, as arcface_torch computes it).
  const torch::Tensor dpr = torch::linspace(0.0, variant_.drop_path, variant_.depth);
  for (int64_t i = 0; i < variant_.depth; ++i) {
    blocks_.emplace_back(D, variant_.heads, dpr[i].item<double>());
    blocks->push_back(blocks_.back());
  }
  norm_ = register_module("norm", layer_norm(D));
  auto feature = register_module("feature", std::make_shared<nn::Module>("Sequential"));
  feature_fc1_ = feature->register_module("0", linear(kTokens * D, D, false));
  feature_bn1_ = feature->register_module("1", NormLayer(D, 2e-5, 0.1));
  feature_fc2_ = feature->register_module("2", linear(D, options_.embedding_size, false));
  feature_bn2_ = feature->register_module("3", NormLayer(options_.embedding_size, 2e-5, 0.1));

  // arcface_torch's initialisation: mask token N(0, 0.02), position embedding and every
  // Linear weight truncated N(0, 0.02), Linear biases 0; LayerNorm/BN 1 and 0 and the patch
  // conv PyTorch's default (as constructed).
  torch::NoGradGuard no_grad;
  mask_token_.normal_(0.0, 0.02);
  // Without masking the token is never used: frozen, it stays what arcface_torch leaves it
  // (no gradient, so its optimiser skips it), and DataParallel needs no unused-parameter walk.
  mask_token_.set_requires_grad(variant_.mask_ratio > 0.0);
  trunc_normal(pos_embed_, 0.02);
  for (auto& m : modules(/*include_self=*/false))
    if (auto* l = m->as<nn::Linear>()) {
      trunc_normal(l->weight, 0.02);
      if (l->bias.defined()) l->bias.zero_();
    }
}

bool VisionTransformer::accepts_input_size(int64_t height, int64_t width) const {
  return height == kImageSize && width == kImageSize;  // the position embedding has 144 entries
}

torch::Tensor VisionTransformer::forward(torch::Tensor images) {
  const bool masking = is_training() && variant_.mask_ratio > 0.0;
  torch::Tensor ids_restore;  // per sample: where each token went in the shuffled order
  auto body = [&](torch::Tensor x) {
    x = counted_conv(patch_embed_, x).flatten(2).transpose(1, 2);  // [B, 144, D]
    x = x + pos_embed_;
    if (masking) {
      // arcface_torch's random_masking: a random permutation per sample (argsort of uniform
      // noise), the first `keep` tokens go through the blocks.
      const int64_t B = x.size(0), L = x.size(1), D = x.size(2);
      const auto keep = static_cast<int64_t>(static_cast<double>(L) * (1.0 - variant_.mask_ratio));
      const torch::Tensor noise = torch::rand({B, L}, torch::TensorOptions().device(x.device()));
      const torch::Tensor ids_shuffle = torch::argsort(noise, 1, /*descending=*/false);
      ids_restore = torch::argsort(ids_shuffle, 1, /*descending=*/false);
      x = torch::gather(x, 1, ids_shuffle.narrow(1, 0, keep).unsqueeze(-1).expand({B, keep, D}));
    }
    const bool recompute = checkpointing() && is_training();
    for (auto& block : blocks_) {
      if (recompute)
        x = checkpointed([b = block.ptr()](const torch::Tensor& t) { return b->forward(t); }, x, block->parameters());
      else
        x = block->forward(x);
    }
    return x;
  };
  auto head = [&](torch::Tensor x) {
    x = norm_->forward(x);
    const int64_t B = x.size(0), D = x.size(2), L = kTokens;
    if (ids_restore.defined()) {
      // Dropped tokens come back as the learned mask token, in their original places.
      const torch::Tensor fill = mask_token_.to(x.scalar_type()).expand({B, L - x.size(1), D});
      x = torch::gather(torch::cat({x, fill}, 1), 1, ids_restore.unsqueeze(-1).expand({B, L, D}));
    }
    x = x.reshape({B, L * D});
    x = feature_bn1_->forward(counted_linear(feature_fc1_, x));
    return feature_bn2_->forward(counted_linear(feature_fc2_, x));
  };
  return run_with_precision(prepare_input(images), body, head);
}

}  // namespace faceshard
