#include "app/train/step_recorder.h"

#include <utility>

#ifdef FACESHARD_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "partial_fc/runtime/error.h"

namespace faceshard {

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

class CudaGraphRecorder : public StepRecorder {
 public:
  explicit CudaGraphRecorder(torch::Device device)
      : device_(device),
        side_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())),
        pool_(at::cuda::graph_pool_handle()) {}

  void warm_up(const std::function<void()>& work, int times) override {
    on_side([&] {
      for (int i = 0; i < times; ++i) work();
    });
  }

  void capture(int k, const std::function<void()>& work) override {
    if (k != static_cast<int>(graphs_.size())) throw runtime_error("CUDA graphs: piece ", k, " captured out of order");
    // Nothing queued before may run inside the capture's window.
    c10::cuda::device_synchronize();
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    on_side([&] {
      // Thread-local: only this thread's unsafe calls break the capture, not the loader's
      // threads allocating pinned memory meanwhile.
      graph->capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
      try {
        work();
      } catch (...) {
        // End the capture (it is invalid) so that the stream and the allocator's pool are
        // left as they were; the error that broke it is the one reported.
        try {
          graph->capture_end();
        } catch (...) {
        }
        (void)cudaGetLastError();
        throw;
      }
      graph->capture_end();
    });
    graphs_.push_back(std::move(graph));
  }

  void replay(int k) override { graphs_.at(static_cast<size_t>(k))->replay(); }

  std::string describe() const override { return "CUDA graphs on " + device_.str(); }

 private:
  // Runs f with the side stream current, ordered after everything queued on the current
  // stream, and the current stream ordered after it.
  template <typename F>
  void on_side(F&& f) {
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device_.index());
    c10::cuda::CUDAEvent before;
    before.record(current);
    before.block(side_);
    {
      c10::cuda::CUDAStreamGuard guard(side_);
      f();
    }
    c10::cuda::CUDAEvent after;
    after.record(side_);
    after.block(current);
  }

  torch::Device device_;
  c10::cuda::CUDAStream side_;
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
