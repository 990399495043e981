#include "models/model_stats.h"

#include "models/backbone.h"

namespace faceshard {
namespace {
// Non-null only inside count_macs on this thread.
thread_local int64_t* g_mac_tally = nullptr;

struct TallyScope {
  explicit TallyScope(int64_t* tally) : prev(g_mac_tally) { g_mac_tally = tally; }
  ~TallyScope() { g_mac_tally = prev; }
  int64_t* prev;
};
}  // namespace

ParameterCount count_parameters(const torch::nn::Module& model) {
  ParameterCount c;
  for (const auto& p : model.parameters()) {
    c.total += p.numel();
    if (p.requires_grad()) c.trainable += p.numel();
  }
  for (const auto& b : model.buffers()) c.buffers += b.numel();
  return c;
}

torch::Tensor counted_conv(const torch::nn::Conv2d& conv, const torch::Tensor& x) {
  torch::Tensor y = conv.ptr()->forward(x);
  if (g_mac_tally) {
    // Each output element is a dot product over (C_in / groups) * kh * kw inputs.
    const auto& w = conv->weight;
    *g_mac_tally += y.numel() / y.size(0) * w.size(1) * w.size(2) * w.size(3);
  }
  return y;
}

torch::Tensor counted_linear(const torch::nn::Linear& fc, const torch::Tensor& x) {
  torch::Tensor y = fc.ptr()->forward(x);
  if (g_mac_tally) *g_mac_tally += y.numel() / y.size(0) * fc->weight.size(1);
  return y;
}

torch::Tensor counted_matmul(const torch::Tensor& a, const torch::Tensor& b) {
  torch::Tensor y = torch::matmul(a, b);
  // Each output element is a dot product of length a.size(-1).
  if (g_mac_tally) *g_mac_tally += y.numel() / y.size(0) * a.size(-1);
  return y;
}

int64_t count_macs(Backbone& model, int64_t height, int64_t width) {
  const bool was_training = model.is_training();
  model.eval();
  int64_t tally = 0;
  {
    TallyScope scope(&tally);
    torch::NoGradGuard no_grad;
    auto p = model.parameters();
    auto opts = torch::TensorOptions().device(p.empty() ? torch::kCPU : p.front().device());
    model.forward(torch::zeros({1, 3, height, width}, opts));
  }
  model.train(was_training);
  return tally;
}

}  // namespace faceshard
