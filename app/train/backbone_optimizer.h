// The optimiser of the replicated backbone: SGD with momentum or AdamW over a flat list of
// parameters, updated with LibTorch's multi-tensor kernels (one launch per op for all
// tensors) instead of torch::optim's loop of small per-parameter kernels.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "models/torch_save/tensor_source.h"
#include "partial_fc/data_parallel/flat_params.h"

namespace faceshard {

struct BackboneOptimizerOptions {
  std::string kind = "sgd";  // sgd | adamw
  // SGD: torch's SGD with dampening 0 and nesterov false (arcface_torch hard-codes 0.9).
  double momentum = 0.9;
  // SGD: added to the gradient (L2); AdamW: decoupled, p *= 1 - lr * weight_decay.
  double weight_decay = 5e-4;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // AdamW (amsgrad off)
};

// SGD follows torch::optim::SGD step for step: d = g + wd * p; the first step of a param
// sets its buffer to d (a copy), later steps buf = momentum * buf + d; p -= lr * buf.
// AdamW follows torch::optim::AdamW (per-param step counts, bias correction) and runs on
// at::_fused_adamw_ (one kernel for all of a device's params, CPU and CUDA).
// A param whose grad is undefined is left alone, and its state does not advance, as in
// torch.optim (so a param unused in a step keeps its AdamW step count). So is a param that
// does not require grad (frozen for a while: fine-tuning), whatever its grad holds.
//
// Over flat buffers (the second constructor) a step is one fused kernel per buffer
// (at::_fused_sgd_ / at::_fused_adamw_, the learning rate a tensor on the buffer's
// device), the state lives in buffers laid out like the parameters', and every parameter
// steps every time (a parameter that got no gradient has a zero one there: weight decay
// and momentum still move it; the trainer uses the flat buffers only where every
// parameter gets a gradient). A group whose parameters do not require grad is not
// stepped at all (FlatParameters' partition keeps a frozen part in groups of its own; a
// group that mixes frozen and trained parameters is an error). The checkpoint state is the
// same, per parameter.
class BackboneOptimizer {
 public:
  BackboneOptimizer(std::vector<at::Tensor> params, BackboneOptimizerOptions opts);
  // The parameters of `flat` (which must outlive the optimiser).
  BackboneOptimizer(FlatParameters& flat, BackboneOptimizerOptions opts);

  void step(double lr);
  // Sets every gradient to undefined (torch's set_to_none): the next backward allocates
  // fresh ones, and step() then skips params that got none.
  void zero_grad();

  // Checkpoint state, in param order: "num_params" (int64, 1 element), then for each
  // param i that has been stepped: SGD "momentum.<i>" (when momentum != 0); AdamW
  // "exp_avg.<i>", "exp_avg_sq.<i>", "step.<i>" (fp32, 0-dim). The tensors are the live
  // state, not copies: serialise or copy them before the next step().
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  // Replaces the whole state with `state` (a param absent from it starts afresh, as in a
  // new optimiser). Validates every name, index, shape and the param count before touching
  // anything; throws faceshard::Error (usage) naming source and key. Tensors are copied onto
  // the params' device and dtype.
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state, const std::string& source);
  // The same from any source of named tensors: a checkpoint file's values are read
  // straight into the new state (no copy of the file, no second copy of the state).
  void load_state(const TensorSource& state, const std::string& source);

  const BackboneOptimizerOptions& options() const { return opts_; }
  const std::vector<at::Tensor>& params() const { return params_; }

 private:
  void step_sgd(const std::vector<size_t>& idx, double lr);
  void step_adamw(const std::vector<size_t>& idx, double lr);
  void step_flat(double lr);
  void validate_options() const;
  // Flat buffers: the per-param state above are views into these (one per group).
  void make_flat_state();
  void load_flat_state(std::vector<at::Tensor>& mom, std::vector<at::Tensor>& ea, std::vector<at::Tensor>& eas,
                       std::vector<at::Tensor>& st, const std::string& source);

  std::vector<at::Tensor> params_;
  BackboneOptimizerOptions opts_;
  bool adamw_ = false;
  // Per param; undefined until the param's first step (torch creates state lazily too).
  std::vector<at::Tensor> momentum_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_, steps_;
  FlatParameters* flat_ = nullptr;
  std::vector<at::Tensor> flat_momentum_, flat_exp_avg_, flat_exp_avg_sq_, flat_step_, flat_lr_;
  std::vector<char> flat_stepped_;  // per group: its state exists (stepped, or loaded)
};

}  // namespace faceshard
