// Model size statistics: parameter counts and multiply-accumulates (MACs) per image.
// MACs are measured, not derived: the backbones route every conv/linear through
// counted_conv/counted_linear, which add to a thread-local tally while count_macs runs.
#pragma once
#include <torch/torch.h>

#include <cstdint>

namespace faceshard {

class Backbone;

struct ParameterCount {
  int64_t total = 0;      // every parameter, frozen ones included (as insightface counts)
  int64_t trainable = 0;  // requires_grad
  int64_t buffers = 0;    // BN running statistics etc.
};
ParameterCount count_parameters(const torch::nn::Module& model);

// Conv2d, Linear and attention-matmul MACs of one forward of a single height x width image
// (BN, LayerNorm, activations, softmax and additions are not counted). For the CNNs this is
// the "GFLOPs" insightface publishes from ptflops; for the ViTs it adds the q.k and attn.v
// products as arcface_torch's extra_gflops does.
// Runs one eval-mode forward without autograd on the model's device; restores train mode.
int64_t count_macs(Backbone& model, int64_t height = 112, int64_t width = 112);

// The layer calls the backbones use; identical to conv->forward(x) / fc->forward(x) /
// torch::matmul(a, b) except for the tally. Batched inputs count per sample (dim 0).
torch::Tensor counted_conv(const torch::nn::Conv2d& conv, const torch::Tensor& x);
torch::Tensor counted_linear(const torch::nn::Linear& fc, const torch::Tensor& x);
torch::Tensor counted_matmul(const torch::Tensor& a, const torch::Tensor& b);

}  // namespace faceshard
