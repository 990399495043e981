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

// Conv2d and Linear MACs of one forward of a single height x width image (BN, PReLU and
// additions are not counted, matching the "GFLOPs" insightface publishes from ptflops).
// Runs one eval-mode forward without autograd on the model's device; restores train mode.
int64_t count_macs(Backbone& model, int64_t height = 112, int64_t width = 112);

// The layer calls the backbones use; identical to conv->forward(x) / fc->forward(x)
// except for the tally.
torch::Tensor counted_conv(const torch::nn::Conv2d& conv, const torch::Tensor& x);
torch::Tensor counted_linear(const torch::nn::Linear& fc, const torch::Tensor& x);

}  // namespace faceshard
