// Stand-in for nccl_backend.cpp in builds without CUDA.
#include "partial_fc/distributed/distributed.h"
#include "base/error.h"

namespace faceshard {

bool nccl_compiled() { return false; }

void bind_cuda_device(int, int) {
  throw usage_error("this faceshard build has no CUDA support (configure with FACESHARD_CUDA=ON)");
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int, int, int,
                                                    std::chrono::milliseconds) {
  throw usage_error("this faceshard build has no CUDA/NCCL support (configure with FACESHARD_CUDA=ON)");
}

}  // namespace faceshard
