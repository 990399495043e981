#include "partial_fc/classifier/row_update_cuda_kernel.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "partial_fc/classifier/sr_hash.h"

namespace faceshard {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }

// The sum of one value per thread over the block (every thread gets it).
template <typename T>
__device__ T block_sum(T v, T* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffU, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // scratch may still be read from the last call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  return total;
}

// bf16 of v: stochastically with the random bits r (inf keeps its bits, NaN becomes 0x7fc0,
// as stochastic_round.h's sr_round), or to nearest.
__device__ __forceinline__ uint16_t to_bf16_bits(float v, uint32_t r, bool nearest) {
  uint32_t bits = __float_as_uint(v);
  if ((bits & 0x7f800000U) == 0x7f800000U) return (bits & 0x007fffffU) ? 0x7fc0U : static_cast<uint16_t>(bits >> 16);
  if (nearest) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return static_cast<uint16_t>(((bits + r) & 0xffff0000U) >> 16);
}

template <typename WT, typename ST>
__global__ void __launch_bounds__(kThreads) sgd_rows(RowUpdateKernelArgs a) {
  __shared__ float fscratch[kThreads / 32];
  __shared__ long long iscratch[kThreads / 32];
  WT* W = static_cast<WT*>(a.weight);
  ST* M = static_cast<ST*>(a.momentum);
  const float lr = a.lr_device ? *a.lr_device : a.lr;
  long long lost = 0, moved = 0;
  for (int64_t r = blockIdx.x; r < a.n; r += gridDim.x) {
    const int64_t row = a.index ? a.index[r] : a.first + r;
    WT* w = W + row * a.d;
    const float* g = a.raw + r * a.d;
    float part = 0;
    for (int64_t k = threadIdx.x; k < a.d; k += kThreads) part += load(w, k) * g[k];
    const float inv = a.inv_norm[r];
    const float c = block_sum(part, fscratch) * inv * inv;
    const uint32_t key = sr_detail::row_key(a.seed, a.step, a.class_start + row);
    for (int64_t k = threadIdx.x; k < a.d; k += kThreads) {
      const float wk = load(w, k);
      float step = (g[k] - c * wk) + a.weight_decay * wk;
      if (M != nullptr) {
        ST* m = M + row * a.d;
        step = a.momentum_factor * load(m, k) + step;
        if constexpr (sizeof(ST) == 2) m[k] = __float2bfloat16_rn(step);
        else m[k] = step;
      }
      const float nw = wk - lr * step;
      if constexpr (sizeof(WT) == 2) {
        const uint16_t old = __bfloat16_as_ushort(w[k]);
        const uint16_t stored = to_bf16_bits(nw, sr_detail::element_bits(key, static_cast<uint32_t>(k)), a.nearest);
        const bool m = nw != wk;
        moved += m;
        lost += m && stored == old;
        w[k] = __ushort_as_bfloat16(stored);
      } else {
        w[k] = nw;
      }
    }
  }
  if constexpr (sizeof(WT) == 2) {
    if (a.lost != nullptr) {
      const long long l = block_sum(lost, iscratch), mv = block_sum(moved, iscratch);
      if (threadIdx.x == 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(a.lost), static_cast<unsigned long long>(l));
        atomicAdd(reinterpret_cast<unsigned long long*>(a.lost + 1), static_cast<unsigned long long>(mv));
      }
    }
  }
}

template <typename WT>
cudaError_t launch_for_state(const RowUpdateKernelArgs& a, unsigned grid, cudaStream_t s) {
  if (a.momentum == nullptr || !a.momentum_bf16) sgd_rows<WT, float><<<grid, kThreads, 0, s>>>(a);
  else sgd_rows<WT, __nv_bfloat16><<<grid, kThreads, 0, s>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t sgd_projected_rows_cuda_launch(const RowUpdateKernelArgs& a, void* stream) {
  if (a.n == 0 || a.d == 0) return cudaSuccess;
  // One block per row, up to a grid that fills any current GPU; the blocks stride over the rest.
  const unsigned grid = static_cast<unsigned>(a.n < 65535 * 4 ? a.n : 65535 * 4);
  const auto s = static_cast<cudaStream_t>(stream);
  return a.weight_bf16 ? launch_for_state<__nv_bfloat16>(a, grid, s) : launch_for_state<float>(a, grid, s);
}

}  // namespace faceshard
