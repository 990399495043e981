// What captures pieces of a training step once and replays them every step (train.cuda_graph,
// graphed_backbone.h): on a GPU, CUDA graphs; on the CPU, which has none, the pieces run again
// (EagerReplay), which is how the tests check everything around the capture (static buffers,
// the autograd stitching, the warm-up leaving no trace) against the eager step.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Stream.h>
#include <torch/torch.h>

namespace faceshard {

class StepRecorder {
 public:
  virtual ~StepRecorder() = default;
  // Runs `work` `times` times where the captures will run (the training stream), before any
  // capture: cuDNN's algorithm search, cuBLAS's workspaces and the allocator's first blocks
  // happen here, not inside a graph.
  virtual void warm_up(const std::function<void()>& work, int times) = 0;
  // Records `work` as piece `k` (0, 1, ... in order); every piece shares one memory pool, so
  // that a later piece reads what an earlier one left (the forward's saved activations).
  // Throws where the work cannot be captured (a host synchronisation, an operation the
  // device cannot record); the recorder is then unusable.
  virtual void capture(int k, const std::function<void()>& work) = 0;
  // Runs piece `k` again on the current stream, on the same buffers.
  virtual void replay(int k) = 0;
  // Once every piece is captured: gives back what the warm-up left cached beside the pieces'
  // pool (a GPU: the caching allocator's unused blocks), so that what stays is what the plan
  // counts (faceshard-plan --cuda-graph on).
  virtual void settle() {}
  // The stream the warm-up and the captures run on: the stream that was current when the
  // recorder was made (the job's training stream, training_stream.h).
  virtual c10::Stream stream() const = 0;
  // Words for log lines ("CUDA graphs on cuda:0").
  virtual std::string describe() const = 0;
};

// The CPU's stand-in: capture runs the work once and keeps it; replay runs it again.
class EagerReplay : public StepRecorder {
 public:
  explicit EagerReplay(torch::Device device = torch::kCPU);
  void warm_up(const std::function<void()>& work, int times) override;
  void capture(int k, const std::function<void()>& work) override;
  void replay(int k) override;
  std::string describe() const override { return "eager replays"; }
  c10::Stream stream() const override { return stream_; }

 private:
  c10::Stream stream_;
  std::vector<std::function<void()>> pieces_;
};

// CUDA graphs on `device`, captured on the stream current when it is made (the job's training
// stream; the default stream cannot be captured, and the capture then fails with a line saying
// so), in thread-local capture mode so that the loader's threads may pin memory meanwhile; a
// failed capture leaves the allocator and the pool as they were (graph_capture.h). Throws
// where this build has no CUDA.
std::unique_ptr<StepRecorder> make_cuda_graph_recorder(torch::Device device);

}  // namespace faceshard
