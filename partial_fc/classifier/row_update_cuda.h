// The GPU's one-pass update of a chunk of the classifier's rows (row_update_cuda_kernel.h),
// with the arguments of row_update_cpu.h's sgd_projected_rows_cpu, which is its reference.
// ShardOptimizer::update_projected_rows calls it for a weight on a GPU.
#pragma once
#include <torch/torch.h>

#include "partial_fc/classifier/row_update_cpu.h"
#include "partial_fc/classifier/stochastic_round.h"

namespace faceshard {

// Whether this build has the kernel (a CUDA build).
bool sgd_projected_rows_cuda_available();

// As sgd_projected_rows_cpu, for contiguous tensors on one GPU, queued on its current stream
// (no host synchronisation). `lr_device`, where defined (1 fp32 element on the GPU), is the
// learning rate instead of sgd.lr. Throws without a CUDA build.
void sgd_projected_rows_cuda(at::Tensor& weight, at::Tensor& momentum, const at::Tensor& raw, const at::Tensor& inv_norm,
                             int64_t first, const at::Tensor& index, const RowSgd& sgd, const RowRounding& rounding,
                             const at::Tensor& lr_device = at::Tensor());

}  // namespace faceshard
