#include "models/iresnet.h"

#include <algorithm>
#include <memory>

#include "models/prelu.h"
#include "models/activation_checkpoint.h"
#include "models/gate_conditioning.h"
#include "models/model_stats.h"
#include "base/error.h"

namespace faceshard {
namespace {
namespace nn = torch::nn;

nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
}
// NormLayer, not torch::nn::BatchNorm: app/sync_bn can give it a SyncBatchNorm forward.
NormLayer bn2d(int64_t c) { return NormLayer(c, 1e-5, 0.1); }
nn::PReLU prelu(int64_t c) { return nn::PReLU(nn::PReLUOptions().num_parameters(c)); }
}  // namespace

SqueezeExcitationImpl::SqueezeExcitationImpl(int64_t channels, int64_t reduction) {
  fc1_ = register_module("fc1", conv(channels, channels / reduction, 1, 1));
  fc2_ = register_module("fc2", conv(channels / reduction, channels, 1, 1));
}

torch::Tensor SqueezeExcitationImpl::scale(const torch::Tensor& x) {
  // The mean over H and W is the global average pool; [B, C, 1, 1] keeps the 1x1 convs.
  const torch::Tensor pooled = x.mean({2, 3}, /*keepdim=*/true);
  const torch::Tensor s = counted_conv(fc2_, torch::relu(counted_conv(fc1_, pooled)));
  assess_gates(pooled, s, fc1_->weight, fc2_->weight);  // only inside a GateConditioningScope
  return torch::sigmoid(s);
}

IBasicBlockImpl::IBasicBlockImpl(int64_t inplanes, int64_t planes, int64_t stride, int64_t se_reduction) {
  // Registration order = PyTorch's state_dict order.
  bn1_ = register_module("bn1", bn2d(inplanes));
  conv1_ = register_module("conv1", conv(inplanes, planes, 3, 1));
  bn2_ = register_module("bn2", bn2d(planes));
  prelu_ = register_module("prelu", prelu(planes));
  conv2_ = register_module("conv2", conv(planes, planes, 3, stride));
  bn3_ = register_module("bn3", bn2d(planes));
  // Between bn3 and the shortcut in the state_dict, as in the forward (the IR-SE ports'
  // order: res_layer's SE last, then the shortcut).
  if (se_reduction > 0) se_ = register_module("se", SqueezeExcitation(planes, se_reduction));
  if (stride != 1 || inplanes != planes) {
    auto down = register_module("downsample", std::make_shared<nn::Module>("Sequential"));
    down_conv_ = down->register_module("0", conv(inplanes, planes, 1, stride));
    down_bn_ = down->register_module("1", bn2d(planes));
  }
}

torch::Tensor IBasicBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor out = bn1_->forward(x);
  out = counted_conv(conv1_, out);
  out = faceshard::prelu(bn2_->forward(out), prelu_->weight);
  out = bn3_->forward(counted_conv(conv2_, out));
  // SE scales the residual branch before the addition.
  if (se_) out = out * se_->scale(out);
  // In place: bn3's output is not needed by its backward, so this saves one activation.
  if (down_conv_) return out.add_(down_bn_->forward(counted_conv(down_conv_, x)));
  return out.add_(x);
}

namespace {
const std::vector<std::pair<std::string, std::vector<int64_t>>>& iresnet_depths() {
  static const std::vector<std::pair<std::string, std::vector<int64_t>>> depths = {
      {"r18", {2, 2, 2, 2}},     {"r34", {3, 4, 6, 3}},      {"r50", {3, 4, 14, 3}},
      {"r100", {3, 13, 30, 3}}, {"r200", {6, 26, 60, 6}}, {"r2060", {3, 128, 1024 - 128, 3}},
      {"ir_se50", {3, 4, 14, 3}}, {"ir_se100", {3, 13, 30, 3}}};
  return depths;
}

std::string known_depths() {
  std::string known;
  for (const auto& d : iresnet_depths()) known += (known.empty() ? "" : ", ") + d.first;
  return known;
}
}  // namespace

std::vector<int64_t> iresnet_layers(const std::string& name) {
  for (const auto& [n, layers] : iresnet_depths())
    if (n == name) return layers;
  throw usage_error("iresnet depth '", name, "' is unknown; known: ", known_depths());
}

IResNet::IResNet(std::vector<int64_t> layers, BackboneOptions options, int64_t se_reduction)
    : Backbone("IResNet", std::move(options)) {
  // Four stages of at least one block each: with fewer, the network has no stage to reach
  // 512 channels at 7 x 7 and would fail only at its first forward.
  const bool four_stages =
      layers.size() == 4 && std::all_of(layers.begin(), layers.end(), [](int64_t n) { return n >= 1; });
  if (!four_stages) {
    std::string given;
    for (int64_t n : layers) given += (given.empty() ? "" : ", ") + std::to_string(n);
    throw usage_error("iresnet '", options_.name, "': blocks per stage {", given,
                      "} are not four stages of at least one block; known depths: ", known_depths());
  }
  conv1_ = register_module("conv1", conv(3, 64, 3, 1));
  bn1_ = register_module("bn1", bn2d(64));
  prelu_ = register_module("prelu", prelu(64));
  const int64_t planes[4] = {64, 128, 256, 512};
  int64_t inplanes = 64;
  for (size_t s = 0; s < layers.size(); ++s) {
    // A ModuleList gives the children the names "0", "1", ... like nn.Sequential.
    auto stage = register_module("layer" + std::to_string(s + 1), nn::ModuleList());
    std::vector<IBasicBlock> blocks;
    for (int64_t b = 0; b < layers[s]; ++b) {
      // Every stage halves the resolution, layer1 included (112 -> 56 -> 28 -> 14 -> 7).
      blocks.emplace_back(inplanes, planes[s], b == 0 ? 2 : 1, se_reduction);
      stage->push_back(blocks.back());
      inplanes = planes[s];
    }
    stages_.push_back(std::move(blocks));
  }
  bn2_ = register_module("bn2", bn2d(512));
  fc_ = register_module("fc", nn::Linear(nn::LinearOptions(512 * 7 * 7, options_.embedding_size)));
  features_ = register_module(
      "features", NormLayer(options_.embedding_size, 1e-5, 0.1));

  // arcface_torch's initialisation: conv N(0, 0.1), BN weight 1 / bias 0 (the C++ default),
  // Linear keeps PyTorch's default; the embedding BN's scale is fixed at 1.
  torch::NoGradGuard no_grad;
  for (auto& m : modules(/*include_self=*/false))
    if (auto* c = m->as<nn::Conv2d>()) c->weight.normal_(0.0, 0.1);
  features_->weight.fill_(1.0);
  features_->weight.set_requires_grad(false);
}

int64_t IResNet::checkpoint_segments(size_t stage, int64_t blocks) {
  if (stage == 1) return std::min<int64_t>(20, blocks);
  if (stage == 2) return std::min<int64_t>(100, blocks);
  return 0;
}

torch::Tensor IResNet::run_stage(std::vector<IBasicBlock>& stage, int64_t segments, torch::Tensor x) {
  const auto n = static_cast<int64_t>(stage.size());
  int64_t start = 0;
  if (segments > 1) {
    const int64_t size = n / segments;
    for (; start < size * (segments - 1); start += size) {
      std::vector<std::shared_ptr<IBasicBlockImpl>> run;
      std::vector<torch::Tensor> params;
      for (int64_t i = start; i < start + size; ++i) {
        run.push_back(stage[static_cast<size_t>(i)].ptr());
        for (auto& p : run.back()->parameters()) params.push_back(p);
      }
      x = checkpointed(
          [run](const torch::Tensor& t) {
            torch::Tensor y = t;
            for (const auto& b : run) y = b->forward(y);
            return y;
          },
          x, params);
    }
  }
  for (int64_t i = start; i < n; ++i) x = stage[static_cast<size_t>(i)]->forward(x);
  return x;
}

torch::Tensor IResNet::forward(torch::Tensor images) {
  auto body = [this](torch::Tensor x) {
    x = faceshard::prelu(bn1_->forward(counted_conv(conv1_, x)), prelu_->weight);
    const bool recompute = checkpointing() && is_training();
    for (size_t s = 0; s < stages_.size(); ++s)
      x = run_stage(stages_[s], recompute ? checkpoint_segments(s, static_cast<int64_t>(stages_[s].size())) : 0, x);
    // BN2d -> flatten -> dropout (in that order). flatten is a view for NCHW; for
    // channels-last it is the one copy that puts features in the fc's (C,H,W) order.
    x = torch::flatten(bn2_->forward(x), 1);
    if (options_.dropout > 0 && is_training()) x = torch::dropout_(x, options_.dropout, true);
    return x;
  };
  auto head = [this](torch::Tensor x) { return features_->forward(counted_linear(fc_, x)); };
  return run_with_precision(prepare_input(images), body, head);
}

}  // namespace faceshard
