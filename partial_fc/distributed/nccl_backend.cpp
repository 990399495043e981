// Creates the NCCL backend (one GPU per rank, bound to the local rank's device). Compiled
// only when faceshard is built with CUDA; nccl_stub.cpp stands in otherwise.
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "partial_fc/distributed/distributed.h"
#include "base/error.h"

namespace faceshard {

bool nccl_compiled() { return true; }

void bind_cuda_device(int device, int local_rank) {
  const int n = static_cast<int>(c10::cuda::device_count());
  if (device < 0 || device >= n)
    throw usage_error("local rank ", local_rank, " needs GPU ", device, " but only ", n, " GPU(s) are visible");
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, int device, std::chrono::milliseconds timeout) {
  bind_cuda_device(device, device);
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  // A bound device lets NCCL create its communicator now and never guess the device.
  pg->setBoundDeviceId(dev);
  pg->eagerConnectSingleDevice(dev);
  return pg;
}

}  // namespace faceshard
