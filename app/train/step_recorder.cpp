#include "app/train/step_recorder.h"

#include <utility>

#ifdef FACESHARD_WITH_CUDA
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "app/train/graph_capture.h"
#include "app/train/training_stream.h"
#include "base/error.h"

namespace faceshard {

EagerReplay::EagerReplay(torch::Device device) : stream_(current_stream(device)) {}

void EagerReplay::warm_up(const std::function<void()>& work, int times) {
  for (int i = 0; i < times; ++i) work();
}

void EagerReplay::capture(int k, const std::function<void()>& work) {
  if (k != static_cast<int>(pieces_.size())) throw runtime_error("EagerReplay: piece ", k, " captured out of order");
  work();
  pieces_.push_back(work);
}

void EagerReplay::replay(int k) { pieces_.at(static_cast<size_t>(k))(); }

#ifdef FACESHARD_WITH_CUDA
namespace {

// LibTorch's CUDAGraph as CaptureSteps: its capture_begin/capture_end, and the undoing of what
// capture_end skips when cudaStreamEndCapture reports an invalidated capture.
class CudaCaptureSteps : public CaptureSteps {
 public:
  CudaCaptureSteps(at::cuda::CUDAGraph& graph, c10::MempoolId_t pool, c10::DeviceIndex device, cudaStream_t stream)
      : graph_(graph), pool_(pool), device_(device), stream_(stream) {}

  void begin() override { graph_.capture_begin(pool_, cudaStreamCaptureModeThreadLocal); }
  void end() override { graph_.capture_end(); }
  void abandon() override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
      cudaGraph_t discarded = nullptr;
      if (cudaStreamEndCapture(stream_, &discarded) == cudaSuccess && discarded != nullptr)
        (void)cudaGraphDestroy(discarded);
    }
    (void)cudaGetLastError();  // the broken capture's error is reported by the caller
  }
  bool stop_recording(Pool pool) override {
    try {
      if (pool == Pool::Device) c10::cuda::CUDACachingAllocator::endAllocateToPool(device_, pool_);
      else at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool_);
      return true;
    } catch (const c10::Error&) {  // "not currently recording to mempool_id"
      return false;
    }
  }
  void release(Pool pool) override {
    if (pool == Pool::Device) c10::cuda::CUDACachingAllocator::releasePool(device_, pool_);
    else at::getHostAllocator(at::kCUDA)->release_pool(pool_);
  }

 private:
  at::cuda::CUDAGraph& graph_;
  c10::MempoolId_t pool_;
  c10::DeviceIndex device_;
  cudaStream_t stream_;
};

class CudaGraphRecorder : public StepRecorder {
 public:
  explicit CudaGraphRecorder(torch::Device device)
      : device_(device.has_index() ? device.index() : c10::cuda::current_device()),
        stream_(c10::cuda::getCurrentCUDAStream(device_)),
        pool_(at::cuda::graph_pool_handle()) {}

  void warm_up(const std::function<void()>& work, int times) override {
    check_stream();
    for (int i = 0; i < times; ++i) work();
  }

  void capture(int k, const std::function<void()>& work) override {
    if (k != static_cast<int>(graphs_.size())) throw runtime_error("CUDA graphs: piece ", k, " captured out of order");
    check_stream();
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    CudaCaptureSteps steps(*graph, pool_, device_, stream_.stream());
    // Thread-local mode: only this thread's unsafe calls break the capture, not the loader's
    // threads allocating pinned memory meanwhile.
    capture_or_undo(steps, work);
    graphs_.push_back(std::move(graph));
  }

  void replay(int k) override { graphs_.at(static_cast<size_t>(k))->replay(); }

  void settle() override {
    // The warm-up's activations, cached on the training stream, beside the graphs' pool that
    // now holds the same activations for good.
    c10::cuda::CUDACachingAllocator::emptyCache();
  }

  std::string describe() const override { return "CUDA graphs on cuda:" + std::to_string(device_); }
  c10::Stream stream() const override { return stream_.unwrap(); }

 private:
  void check_stream() const {
    if (stream_ == c10::cuda::getDefaultCUDAStream(device_))
      throw runtime_error("the training runs on the default stream, which CUDA cannot capture");
    if (c10::cuda::getCurrentCUDAStream(device_) != stream_)
      throw runtime_error("the current stream is not the one the graphs were set up on (", stream_.unwrap(), ")");
  }

  c10::DeviceIndex device_;
  c10::cuda::CUDAStream stream_;
  c10::MempoolId_t pool_;
  std::vector<std::unique_ptr<at::cuda::CUDAGraph>> graphs_;
};

}  // namespace

std::unique_ptr<StepRecorder> make_cuda_graph_recorder(torch::Device device) {
  if (!device.is_cuda()) throw runtime_error("CUDA graphs need a CUDA device, not ", device.str());
  return std::make_unique<CudaGraphRecorder>(device);
}
#else
std::unique_ptr<StepRecorder> make_cuda_graph_recorder(torch::Device device) {
  throw runtime_error("CUDA graphs: this build has no CUDA (", device.str(), ")");
}
#endif

}  // namespace faceshard
