#include "base/designed_host_sync.h"

#include <mutex>

#ifdef FACESHARD_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace faceshard {
namespace {
std::mutex g_mutex;
std::map<std::string, int64_t>& counts() {
  static auto* c = new std::map<std::string, int64_t>();
  return *c;
}
}  // namespace

DesignedHostSync::DesignedHostSync(const char* what) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    ++counts()[what];
  }
#ifdef FACESHARD_WITH_CUDA
  // The mode is process-wide in LibTorch; the step's thread is the one that sets and reads it.
  previous_mode_ = static_cast<int>(c10::cuda::warning_state().get_sync_debug_mode());
  if (previous_mode_ != static_cast<int>(c10::cuda::SyncDebugMode::L_DISABLED))
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
#endif
}

DesignedHostSync::~DesignedHostSync() {
#ifdef FACESHARD_WITH_CUDA
  if (previous_mode_ != static_cast<int>(c10::cuda::SyncDebugMode::L_DISABLED))
    c10::cuda::warning_state().set_sync_debug_mode(static_cast<c10::cuda::SyncDebugMode>(previous_mode_));
#endif
}

std::map<std::string, int64_t> designed_host_syncs() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return counts();
}

void reset_designed_host_syncs() {
  std::lock_guard<std::mutex> lock(g_mutex);
  counts().clear();
}

}  // namespace faceshard
