#include "models/prelu_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace faceshard {
namespace {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

constexpr int kThreads = 256;

// The sum of v over the block, returned to thread 0.
__device__ float block_sum(float v) {
  __shared__ float warp_sums[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffU, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0f;
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffU, v, o);
  __syncthreads();
  return v;
}

// One block per plane (grid-stride over planes): dx, and the plane's sum into
// plane_sums[p] (added per channel by column_sums_kernel).
template <typename T>
__global__ void planes_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                              const float* __restrict__ a, float* __restrict__ plane_sums, int64_t planes, int64_t len,
                              int64_t channels) {
  for (int64_t p = blockIdx.x; p < planes; p += gridDim.x) {
    const int64_t c = p % channels;
    const float slope = a[c];
    const int64_t base = p * len;
    float acc = 0.0f;
    for (int64_t k = threadIdx.x; k < len; k += blockDim.x) {
      const float xv = to_float(x[base + k]), g = to_float(dy[base + k]);
      const bool pos = xv > 0.0f;
      dx[base + k] = from_float<T>(pos ? g : slope * g);
      acc += pos ? 0.0f : g * xv;
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) plane_sums[p] = acc;
  }
}

// Channels-last rows: thread (tx, ty) of a (bx, by) block takes channels tx, tx + bx, ...
// (at most kSlots) of rows ty, ty + by, ... of its block's rows; its sums stay in registers,
// then the block's rows are summed in shared memory into block_sums[block][channel].
constexpr int kSlots = 8;
template <typename T>
__global__ void rows_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                            const float* __restrict__ a, float* __restrict__ block_sums, int64_t rows,
                            int64_t channels) {
  extern __shared__ float partial[];  // [by][channels]
  float acc[kSlots];
  float slope[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    acc[s] = 0.0f;
    const int64_t c = threadIdx.x + static_cast<int64_t>(s) * blockDim.x;
    slope[s] = c < channels ? a[c] : 0.0f;
  }
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.y) + threadIdx.y; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t base = r * channels;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(s) * blockDim.x;
      if (c >= channels) break;
      const float xv = to_float(x[base + c]), g = to_float(dy[base + c]);
      const bool pos = xv > 0.0f;
      dx[base + c] = from_float<T>(pos ? g : slope[s] * g);
      acc[s] += pos ? 0.0f : g * xv;
    }
  }
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int64_t c = threadIdx.x + static_cast<int64_t>(s) * blockDim.x;
    if (c < channels) partial[threadIdx.y * channels + c] = acc[s];
  }
  __syncthreads();
  // Every block writes its row of block_sums (zeros where it had no rows).
  for (int64_t c = threadIdx.y * blockDim.x + threadIdx.x; c < channels; c += blockDim.x * blockDim.y) {
    float sum = 0.0f;
    for (unsigned y = 0; y < blockDim.y; ++y) sum += partial[y * channels + c];
    block_sums[blockIdx.x * channels + c] = sum;
  }
}

// out[c] = the sum of column c of partial [rows][cols]. A block takes `tile` (blockDim.x, a
// power of two up to 8: one 32-byte sector of a row) neighbouring columns with
// kReduceThreads / tile row lanes (blockDim.y), many lanes so that a thousand rows are a few
// loads per thread; the lanes' sums are added in a fixed tree. Which thread adds what
// depends on the shape alone: the same bits on every run.
constexpr int kReduceThreads = 1024, kReduceTile = 8;
__global__ void column_sums_kernel(const float* __restrict__ partial, float* __restrict__ out, int64_t rows,
                                   int64_t cols) {
  __shared__ float lanes[kReduceThreads];
  const int tile = blockDim.x, lanes_n = blockDim.y;
  const int tid = threadIdx.y * tile + threadIdx.x;
  for (int64_t c0 = blockIdx.x * static_cast<int64_t>(tile); c0 < cols; c0 += static_cast<int64_t>(gridDim.x) * tile) {
    const int64_t c = c0 + threadIdx.x;
    float acc = 0.0f;
    if (c < cols)
      for (int64_t r = threadIdx.y; r < rows; r += lanes_n) acc += partial[r * cols + c];
    lanes[tid] = acc;
    __syncthreads();
    for (int s = lanes_n / 2; s > 0; s >>= 1) {
      if (threadIdx.y < s) lanes[tid] += lanes[tid + s * tile];
      __syncthreads();
    }
    if (threadIdx.y == 0 && c < cols) out[c] = lanes[threadIdx.x];
    __syncthreads();
  }
}

unsigned grid_for(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  // Enough blocks to fill a large GPU several times over; more only add partial sums.
  return static_cast<unsigned>(blocks < 1024 ? (blocks > 0 ? blocks : 1) : 1024);
}

cudaError_t column_sums(const float* partial, float* out, int64_t rows, int64_t cols, cudaStream_t s) {
  int tile = 1;
  while (tile < cols && tile < kReduceTile) tile *= 2;
  const int64_t blocks = (cols + tile - 1) / tile;
  column_sums_kernel<<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), dim3(tile, kReduceThreads / tile), 0,
                       s>>>(partial, out, rows, cols);
  return cudaGetLastError();
}

template <typename T>
cudaError_t planes(const void* x, const void* dy, void* dx, const float* a, float* plane_sums, int64_t n, int64_t len,
                   int64_t c, cudaStream_t s) {
  planes_kernel<T><<<grid_for(n, 1), kThreads, 0, s>>>(static_cast<const T*>(x), static_cast<const T*>(dy),
                                                       static_cast<T*>(dx), a, plane_sums, n, len, c);
  return cudaGetLastError();
}

// Rows path: bx, the channels rounded up to a warp, at most the block; by, rows per block.
struct RowsLayout {
  int64_t bx, by;
  unsigned grid;
};
RowsLayout rows_layout(int64_t n, int64_t c) {
  const int64_t bx = c >= kThreads ? kThreads : ((c + 31) / 32) * 32;
  const int64_t by = kThreads / bx;
  return {bx, by, grid_for(n, by * 8)};
}

template <typename T>
cudaError_t rows(const void* x, const void* dy, void* dx, const float* a, float* block_sums, int64_t n, int64_t c,
                 cudaStream_t s) {
  const RowsLayout l = rows_layout(n, c);
  const dim3 block(static_cast<unsigned>(l.bx), static_cast<unsigned>(l.by));
  const size_t shared = static_cast<size_t>(l.by * c) * sizeof(float);
  rows_kernel<T><<<l.grid, block, shared, s>>>(static_cast<const T*>(x), static_cast<const T*>(dy),
                                               static_cast<T*>(dx), a, block_sums, n, c);
  return cudaGetLastError();
}

}  // namespace

int64_t prelu_backward_planes_workspace(int64_t planes) { return planes; }

cudaError_t prelu_backward_planes_cuda(PReLUCudaType type, const void* x, const void* dy, void* dx, const float* a,
                                       float* dw, float* workspace, int64_t n, int64_t len, int64_t channels,
                                       void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (n == 0 || len == 0) return cudaMemsetAsync(dw, 0, static_cast<size_t>(channels) * sizeof(float), s);
  cudaError_t e = cudaErrorInvalidValue;
  switch (type) {
    case PReLUCudaType::Float: e = planes<float>(x, dy, dx, a, workspace, n, len, channels, s); break;
    case PReLUCudaType::BFloat16: e = planes<__nv_bfloat16>(x, dy, dx, a, workspace, n, len, channels, s); break;
    case PReLUCudaType::Half: e = planes<__half>(x, dy, dx, a, workspace, n, len, channels, s); break;
  }
  if (e != cudaSuccess) return e;
  // Plane p = i * channels + c: the sums as [n / channels][channels], added down each column.
  return column_sums(workspace, dw, n / channels, channels, s);
}

int64_t prelu_backward_rows_workspace(int64_t rows, int64_t channels) {
  return channels > 0 ? static_cast<int64_t>(rows_layout(rows, channels).grid) * channels : 0;
}

cudaError_t prelu_backward_rows_cuda(PReLUCudaType type, const void* x, const void* dy, void* dx, const float* a,
                                     float* dw, float* workspace, int64_t n, int64_t channels, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (n == 0 || channels == 0) return cudaMemsetAsync(dw, 0, static_cast<size_t>(channels) * sizeof(float), s);
  cudaError_t e = cudaErrorInvalidValue;
  switch (type) {
    case PReLUCudaType::Float: e = rows<float>(x, dy, dx, a, workspace, n, channels, s); break;
    case PReLUCudaType::BFloat16: e = rows<__nv_bfloat16>(x, dy, dx, a, workspace, n, channels, s); break;
    case PReLUCudaType::Half: e = rows<__half>(x, dy, dx, a, workspace, n, channels, s); break;
  }
  if (e != cudaSuccess) return e;
  return column_sums(workspace, dw, rows_layout(n, channels).grid, channels, s);
}

}  // namespace faceshard
