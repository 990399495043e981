// The batch-normalisation layer of faceshard's backbones: BatchNorm1d/2d semantics and
// parameter names, plus a replaceable forward so that a distributed runtime can turn it
// into SyncBatchNorm after the model is built (LibTorch's BatchNorm forward is not virtual
// and parents call their members directly, so swapping modules would not be seen). When a
// checkpointed segment reruns in backward it normalises without updating its statistics.
#pragma once
#include <functional>

#include <torch/torch.h>

namespace faceshard {

class NormLayerImpl : public torch::nn::Module {
 public:
  explicit NormLayerImpl(int64_t num_features, double eps = 1e-5, double momentum = 0.1);
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  double eps, momentum;
  // When set, forward calls it instead of batch_norm (weights and statistics stay here).
  std::function<at::Tensor(NormLayerImpl& self, const at::Tensor& x)> forward_override;
};
TORCH_MODULE(NormLayer);

}  // namespace faceshard
