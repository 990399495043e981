#include "partial_fc/classifier/row_update_cuda.h"

#include "base/error.h"

#ifdef FACESHARD_WITH_CUDA
#include <ATen/record_function.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "partial_fc/classifier/row_update_cuda_kernel.h"
#include "base/cuda_kernel_check.h"
#endif

namespace faceshard {

#ifdef FACESHARD_WITH_CUDA
bool sgd_projected_rows_cuda_available() { return true; }

void sgd_projected_rows_cuda(at::Tensor& weight, at::Tensor& momentum, const at::Tensor& raw, const at::Tensor& inv_norm,
                             int64_t first, const at::Tensor& index, const RowSgd& sgd, const RowRounding& rounding,
                             const at::Tensor& lr_device) {
  RECORD_USER_SCOPE("faceshard::sgd_projected_rows");
  TORCH_CHECK(weight.is_cuda() && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "sgd_projected_rows_cuda: the weight must be a contiguous fp32 or bf16 GPU tensor");
  const c10::cuda::CUDAGuard device_guard(weight.device());
  const at::Tensor r = raw.contiguous(), inv = inv_norm.contiguous();
  TORCH_CHECK(r.device() == weight.device() && r.scalar_type() == at::kFloat && r.dim() == 2 &&
                  r.size(1) == weight.size(1),
              "sgd_projected_rows_cuda: raw rows ", r.sizes(), " do not match the weight ", weight.sizes());
  TORCH_CHECK(inv.device() == weight.device() && inv.scalar_type() == at::kFloat && inv.numel() == r.size(0),
              "sgd_projected_rows_cuda: one fp32 inverse norm per row, on the weight's device");
  const int64_t n = r.size(0);
  const at::Tensor ix = index.defined() ? index.to(weight.device(), at::kLong).contiguous() : at::Tensor();
  TORCH_CHECK(!ix.defined() || ix.numel() == n, "sgd_projected_rows_cuda: ", ix.numel(), " indices for ", n, " rows");
  TORCH_CHECK(ix.defined() || (first >= 0 && first + n <= weight.size(0)), "sgd_projected_rows_cuda: rows out of range");
  const bool with_momentum = sgd.momentum != 0 && momentum.defined();
  if (with_momentum)
    TORCH_CHECK(momentum.device() == weight.device() && momentum.is_contiguous() &&
                    momentum.sizes() == weight.sizes() &&
                    (momentum.scalar_type() == at::kFloat || momentum.scalar_type() == at::kBFloat16),
                "sgd_projected_rows_cuda: the momentum must be a contiguous fp32 or bf16 tensor shaped like the weight");
  if (lr_device.defined())
    TORCH_CHECK(lr_device.device() == weight.device() && lr_device.scalar_type() == at::kFloat && lr_device.numel() == 1,
                "sgd_projected_rows_cuda: the learning rate must be one fp32 element on the weight's device");
  RowUpdateKernelArgs a;
  a.weight = weight.data_ptr();
  a.momentum = with_momentum ? momentum.data_ptr() : nullptr;
  a.raw = r.data_ptr<float>();
  a.inv_norm = inv.data_ptr<float>();
  a.index = ix.defined() ? ix.data_ptr<int64_t>() : nullptr;
  a.first = first;
  a.n = n;
  a.d = r.size(1);
  a.weight_bf16 = weight.scalar_type() == at::kBFloat16;
  a.momentum_bf16 = with_momentum && momentum.scalar_type() == at::kBFloat16;
  a.lr_device = lr_device.defined() ? lr_device.data_ptr<float>() : nullptr;
  a.lr = static_cast<float>(sgd.lr);
  a.momentum_factor = static_cast<float>(sgd.momentum);
  a.weight_decay = static_cast<float>(sgd.weight_decay);
  a.seed = rounding.seed;
  a.step = rounding.step;
  a.class_start = rounding.class_start;
  a.nearest = rounding.nearest;
  if (a.weight_bf16 && rounding.lost.defined()) {
    TORCH_CHECK(rounding.lost.device() == weight.device() && rounding.lost.scalar_type() == at::kLong &&
                    rounding.lost.is_contiguous() && rounding.lost.numel() == 2,
                "sgd_projected_rows_cuda: the lost-update counts must be [2] int64 on the weight's device");
    a.lost = reinterpret_cast<long long*>(rounding.lost.data_ptr<int64_t>());
  }
  check_cuda_kernel(sgd_projected_rows_cuda_launch(a, c10::cuda::getCurrentCUDAStream(weight.device().index()).stream()),
                    "sgd_projected_rows (partial_fc/classifier/row_update_cuda_kernel.cu)");
}
#else
bool sgd_projected_rows_cuda_available() { return false; }

void sgd_projected_rows_cuda(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                             const RowSgd&, const RowRounding&, const at::Tensor&) {
  throw runtime_error("sgd_projected_rows_cuda: this build has no CUDA");
}
#endif

}  // namespace faceshard
