#include "models/norm_layer.h"

namespace faceshard {

NormLayerImpl::NormLayerImpl(int64_t num_features, double eps_, double momentum_) : eps(eps_), momentum(momentum_) {
  weight = register_parameter("weight", torch::ones({num_features}));
  bias = register_parameter("bias", torch::zeros({num_features}));
  running_mean = register_buffer("running_mean", torch::zeros({num_features}));
  running_var = register_buffer("running_var", torch::ones({num_features}));
  num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
}

at::Tensor NormLayerImpl::forward(const at::Tensor& x) {
  if (forward_override) return forward_override(*this, x);
  if (is_training()) {
    torch::NoGradGuard ng;
    num_batches_tracked.add_(1);
  }
  return torch::batch_norm(x, weight, bias, running_mean, running_var, is_training(), momentum, eps,
                           at::globalContext().userEnabledCuDNN());
}

}  // namespace faceshard
