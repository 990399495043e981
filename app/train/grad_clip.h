// Gradient-norm clipping of the backbone (arcface_torch clips the backbone's gradients to
// an L2 norm of 5 after unscaling, every optimiser step), done with multi-tensor kernels
// and without a host synchronisation so it does not stall the GPU queue.
#pragma once
#include <vector>

#include <ATen/ATen.h>

namespace faceshard {

// torch.nn.utils.clip_grad_norm_(params, max_norm) with norm_type 2: the total L2 norm over
// the gradients of all params (params without a gradient are ignored) is computed per
// (device, dtype) group with at::_foreach_norm (fp16/bf16 gradients are reduced in fp32);
// every gradient is then multiplied in place by min(1, max_norm / (norm + 1e-6)).
// Returns the total norm before clipping as a 0-dim fp32 tensor on the device of the first
// gradient (0 on the CPU when no param has a gradient); reading it is the caller's sync.
// A non-finite norm is not an error (the multiplier is then 0 or NaN, as in torch): under
// fp16 the loss scaler's skip decision covers that step.
at::Tensor clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

}  // namespace faceshard
