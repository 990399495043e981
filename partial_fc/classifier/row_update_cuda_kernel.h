// The classifier step's update of one chunk of rows as one CUDA kernel: the GPU's version of
// row_update_cpu.h's loop (the reference it is tested against, bit for bit where the rounding
// keys are the same and within 1e-6 otherwise). Per row, where the row lives in the shard
// (through the sampled index): the gradient from the raw product M = G'^T E and the row,
//   g = M - (w . M) / ||w||^2 * w,
// SGD with momentum and weight decay (torch.optim.SGD's update, dampening 0, no Nesterov),
// the learning rate read from the device where given (a captured step needs no host value),
// and a bf16 row written back stochastically rounded with the rows' keys (stochastic_round.h)
// or to nearest, counting the values the update moved and those rounding lost. Plain CUDA,
// no LibTorch (built as faceshard_classifier_cuda).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace faceshard {

struct RowUpdateKernelArgs {
  void* weight = nullptr;          // [rows, d] fp32 or bf16 (weight_bf16)
  void* momentum = nullptr;        // [rows, d] fp32 or bf16 (momentum_bf16); null: no momentum
  const float* raw = nullptr;      // [n, d] fp32 contiguous
  const float* inv_norm = nullptr; // [n] 1 / ||w_j|| of the forward
  const int64_t* index = nullptr;  // [n] local rows, or null: rows [first, first + n)
  int64_t first = 0, n = 0, d = 0;
  bool weight_bf16 = false, momentum_bf16 = false;
  const float* lr_device = nullptr;  // where set, the learning rate (1 element) instead of lr
  float lr = 0, momentum_factor = 0.9f, weight_decay = 0;
  // bf16 rows: the rounding's keys (sr_detail::row_key(seed, step, class_start + row)).
  uint64_t seed = 0;
  int64_t step = 0, class_start = 0;
  bool nearest = false;
  long long* lost = nullptr;  // [2] int64: += (lost, moved); may be null
};

// Queued on `stream` (a cudaStream_t); returns the launch's status (the caller raises it).
[[nodiscard]] cudaError_t sgd_projected_rows_cuda_launch(const RowUpdateKernelArgs& args, void* stream);

}  // namespace faceshard
