// SyncBatchNorm: batch normalisation over the union of all ranks' batches (ranks may have
// different batch sizes, zero rows included). Training-mode statistics are merged across
// ranks in forward; backward all-reduces the two per-channel gradient sums. Eval mode uses
// the running statistics and never communicates.
#pragma once
#include <torch/torch.h>

#include "partial_fc/distributed/distributed.h"

namespace faceshard {

// The functional form. running_mean/running_var (and num_batches_tracked, if defined) are
// updated in place exactly as BatchNorm over the concatenated batch would (the running
// variance takes the unbiased estimate). weight/bias may be undefined (no affine).
// Gradients of weight/bias are this rank's share; DDP's averaging completes them.
at::Tensor sync_batch_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           at::Tensor& running_mean, at::Tensor& running_var, at::Tensor& num_batches_tracked,
                           bool training, double momentum, double eps, Distributed& dist);

// A module with BatchNorm's parameter and buffer names (weight, bias, running_mean,
// running_var, num_batches_tracked), so state dicts are interchangeable with BatchNorm.
class SyncBatchNormImpl : public torch::nn::Module {
 public:
  SyncBatchNormImpl(int64_t num_features, Distributed& dist, double eps = 1e-5, double momentum = 0.1);
  at::Tensor forward(const at::Tensor& x);
  // Copies weight, bias and running statistics from an existing BatchNorm.
  void load_from(const torch::nn::Module& batch_norm);

  at::Tensor weight, bias, running_mean, running_var, num_batches_tracked;
  double eps, momentum;

 private:
  Distributed* dist_;
};
TORCH_MODULE(SyncBatchNorm);

}  // namespace faceshard
