#include "models/norm_layer.h"

#include "models/activation_checkpoint.h"

namespace faceshard {

NormLayerImpl::NormLayerImpl(int64_t num_features, double eps_, double momentum_) : eps(eps_), momentum(momentum_) {
  weight = register_parameter("weight", torch::ones({num_features}));
  bias = register_parameter("bias", torch::zeros({num_features}));
  running_mean = register_buffer("running_mean", torch::zeros({num_features}));
  running_var = register_buffer("running_var", torch::ones({num_features}));
  num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
}

at::Tensor NormLayerImpl::forward(const at::Tensor& x) {
  if (is_training() && recomputing()) {
    // A checkpointed segment reruns in backward: the same batch statistics, but the running
    // statistics were already updated when it first ran (PyTorch's checkpoint updates them
    // twice). Without running tensors batch_norm (and SyncBatchNorm) only normalise.
    if (!forward_override)
      return torch::batch_norm(x, weight, bias, {}, {}, true, momentum, eps, at::globalContext().userEnabledCuDNN());
    struct Hide {
      NormLayerImpl& s;
      at::Tensor mean, var, count;
      explicit Hide(NormLayerImpl& self)
          : s(self), mean(std::move(self.running_mean)), var(std::move(self.running_var)),
            count(std::move(self.num_batches_tracked)) {}
      ~Hide() {
        s.running_mean = std::move(mean);
        s.running_var = std::move(var);
        s.num_batches_tracked = std::move(count);
      }
    } hide(*this);
    return forward_override(*this, x);
  }
  if (forward_override) return forward_override(*this, x);
  if (is_training()) {
    torch::NoGradGuard ng;
    num_batches_tracked.add_(1);
  }
  return torch::batch_norm(x, weight, bias, running_mean, running_var, is_training(), momentum, eps,
                           at::globalContext().userEnabledCuDNN());
}

}  // namespace faceshard
