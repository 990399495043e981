// The status of one of the project's CUDA kernel launchers (plain CUDA, *_cuda.cu) raised on
// the C++ side right after the launch, naming the kernel: a launch that fails (no image for
// this GPU, a bad configuration) must not leave its output unwritten for a later, unrelated
// operation to report. Only for translation units built with FACESHARD_WITH_CUDA.
#pragma once
#include <cuda_runtime_api.h>

#include "base/error.h"

namespace faceshard {

inline void check_cuda_kernel(cudaError_t status, const char* kernel) {
  if (status == cudaSuccess) return;
  std::string hint;
  if (status == cudaErrorNoKernelImageForDevice || status == cudaErrorUnsupportedPtxVersion) {
    int device = 0, major = 0, minor = 0;
    if (cudaGetDevice(&device) == cudaSuccess &&
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess)
      hint = detail::concat("; this build has no code for compute capability ", major, ".", minor, ": add ", major,
                            minor, " to -DCMAKE_CUDA_ARCHITECTURES and rebuild");
  }
  throw runtime_error("CUDA kernel ", kernel, " failed: ", cudaGetErrorString(status), " (",
                      cudaGetErrorName(status), ")", hint);
}

}  // namespace faceshard
