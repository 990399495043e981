// The stream a training job runs on. On a GPU every kernel of the job (its build, the steps,
// validation, checkpoints) is queued on one dedicated non-default stream, made current for the
// thread that builds the job before anything of it exists, and kept current while the job
// lives. Why: autograd tags each node with the stream that was current when the node was made,
// and a parameter's gradient accumulator (which DataParallel creates and keeps in its
// constructor) is made once, at the build. A CUDA graph must be captured on a non-default
// stream, and a backward captured on one stream whose accumulators were tagged with another
// makes the engine join the two with events, which a capture forbids on the legacy default
// stream ("operation not permitted when stream is capturing"). With one stream for the whole
// job the capture, its warm-up and the accumulators share it, and the caching allocator's
// blocks of the warm-up stay in the pool the training uses.
//
// On the CPU there are no streams: the guard does nothing.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Stream.h>
#include <torch/torch.h>

namespace faceshard {

class TrainingStream {
 public:
  // On a CUDA device: the thread's current stream where that is already a non-default stream
  // (a caller that chose its own), else a stream of LibTorch's pool, made current until this
  // object is destroyed.
  explicit TrainingStream(torch::Device device);
  ~TrainingStream();
  TrainingStream(const TrainingStream&) = delete;
  TrainingStream& operator=(const TrainingStream&) = delete;

  // The stream the job's work is queued on (the CPU's only stream on the CPU).
  c10::Stream stream() const { return stream_; }

 private:
  c10::Stream stream_;
  c10::Stream previous_;
  bool switched_ = false;
};

// The stream current on `device` for this thread.
c10::Stream current_stream(torch::Device device);

// A parameter whose gradient accumulator (autograd's node that adds into .grad) exists and was
// made while another stream than `stream` was current: "parameter 3 (shape [64, 3, 3, 3]): its
// gradient accumulator runs on stream X, the capture on stream Y". "" when every existing
// accumulator runs on `stream` (parameters without one yet make theirs when first used).
std::string accumulator_stream_mismatch(const std::vector<at::Tensor>& params, c10::Stream stream);

}  // namespace faceshard
