#include "models/mobilefacenet.h"

#include "models/prelu.h"
#include "models/model_stats.h"

namespace faceshard {
namespace {
namespace nn = torch::nn;
}  // namespace

MbfConvBlockImpl::MbfConvBlockImpl(int64_t in, int64_t out, int64_t kernel, int64_t stride,
                                   int64_t padding, int64_t groups, bool prelu) {
  auto layers = register_module("layers", std::make_shared<nn::Module>("Sequential"));
  conv_ = layers->register_module(
      "0", nn::Conv2d(nn::Conv2dOptions(in, out, kernel).stride(stride).padding(padding).groups(groups).bias(false)));
  bn_ = layers->register_module("1", NormLayer(out, 1e-5, 0.1));
  if (prelu) prelu_ = layers->register_module("2", nn::PReLU(nn::PReLUOptions().num_parameters(out)));
}

torch::Tensor MbfConvBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor y = bn_->forward(counted_conv(conv_, x));
  return prelu_ ? faceshard::prelu(y, prelu_->weight) : y;
}

MbfDepthWiseImpl::MbfDepthWiseImpl(int64_t in, int64_t out, bool residual, int64_t stride, int64_t groups)
    : residual_(residual) {
  auto layers = register_module("layers", std::make_shared<nn::Module>("Sequential"));
  expand_ = layers->register_module("0", MbfConvBlock(in, groups, 1, 1, 0, 1, true));
  depthwise_ = layers->register_module("1", MbfConvBlock(groups, groups, 3, stride, 1, groups, true));
  project_ = layers->register_module("2", MbfConvBlock(groups, out, 1, 1, 0, 1, false));
}

torch::Tensor MbfDepthWiseImpl::forward(const torch::Tensor& x) {
  torch::Tensor y = project_->forward(depthwise_->forward(expand_->forward(x)));
  // In place on the projection BN's output (not needed by its backward).
  return residual_ ? y.add_(x) : y;
}

MobileFaceNet::MobileFaceNet(std::array<int64_t, 4> blocks, int64_t scale, BackboneOptions options)
    : Backbone("MobileFaceNet", std::move(options)) {
  auto layers = register_module("layers", nn::ModuleList());
  auto add_block = [&](auto block) {
    layers->push_back(block);
    body_.push_back([block](const torch::Tensor& x) mutable { return block->forward(x); });
  };
  // A "Residual" entry: its DepthWise blocks under "<i>.layers.<j>".
  auto add_residual = [&](int64_t channels, int64_t n, int64_t groups) {
    auto residual = std::make_shared<nn::Module>("Residual");
    auto list = residual->register_module("layers", nn::ModuleList());
    std::vector<MbfDepthWise> chain;
    for (int64_t j = 0; j < n; ++j) {
      chain.emplace_back(channels, channels, true, 1, groups);
      list->push_back(chain.back());
    }
    layers->push_back(residual);
    body_.push_back([chain](const torch::Tensor& x) mutable {
      torch::Tensor y = x;
      for (auto& b : chain) y = b->forward(y);
      return y;
    });
  };
  const int64_t c64 = 64 * scale, c128 = 128 * scale;
  add_block(MbfConvBlock(3, c64, 3, 2, 1, 1, true));  // 112 -> 56
  if (blocks[0] == 1)
    add_block(MbfConvBlock(c64, c64, 3, 1, 1, 64, true));  // grouped (64 groups), as upstream
  else
    add_residual(c64, blocks[0], 128);
  add_block(MbfDepthWise(c64, c64, false, 2, 128));  // 56 -> 28
  add_residual(c64, blocks[1], 128);
  add_block(MbfDepthWise(c64, c128, false, 2, 256));  // 28 -> 14
  add_residual(c128, blocks[2], 256);
  add_block(MbfDepthWise(c128, c128, false, 2, 512));  // 14 -> 7
  add_residual(c128, blocks[3], 256);

  conv_sep_ = register_module("conv_sep", MbfConvBlock(c128, 512, 1, 1, 0, 1, true));
  // GDC head; index 1 of upstream's Sequential is a parameter-free Flatten.
  auto features = register_module("features", std::make_shared<nn::Module>("GDC"));
  auto gdc = features->register_module("layers", std::make_shared<nn::Module>("Sequential"));
  gdc_ = gdc->register_module("0", MbfConvBlock(512, 512, 7, 1, 0, 512, false));
  gdc_fc_ = gdc->register_module("2", nn::Linear(nn::LinearOptions(512, options_.embedding_size).bias(false)));
  gdc_bn_ = gdc->register_module(
      "3", NormLayer(options_.embedding_size, 1e-5, 0.1));

  // Upstream's initialisation: Kaiming normal (fan_out, ReLU) for conv and linear weights.
  torch::NoGradGuard no_grad;
  for (auto& m : modules(/*include_self=*/false)) {
    if (auto* c = m->as<nn::Conv2d>()) nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
    if (auto* l = m->as<nn::Linear>()) nn::init::kaiming_normal_(l->weight, 0.0, torch::kFanOut, torch::kReLU);
  }
}

torch::Tensor MobileFaceNet::forward(torch::Tensor images) {
  auto body = [this](torch::Tensor x) {
    for (auto& f : body_) x = f(x);
    return x;
  };
  // conv_sep and the GDC head run in fp32 (upstream: conv_sep(x.float())).
  auto head = [this](torch::Tensor x) {
    x = gdc_->forward(conv_sep_->forward(x));
    return gdc_bn_->forward(counted_linear(gdc_fc_, torch::flatten(x, 1)));
  };
  return run_with_precision(prepare_input(images), body, head);
}

}  // namespace faceshard
