// One CUDA-graph capture, and what a failed one must undo. A capture asks the caching
// allocators (the device's and the pinned host memory's) to put the capturing stream's
// allocations into the graph's private pool, and holds one use of that pool; only a capture
// that ends normally hands both back (the graph releases its use when destroyed). A capture
// that breaks (a host synchronisation inside it, an operation the stream cannot record)
// leaves LibTorch's CUDAGraph with neither done: the allocator then believes a capture is
// still under way, defers the release of every freed block that was used on another stream
// (the loader's batches, the collectives' tensors) for ever, and the pool is never freed, so
// an eager run after the failure grows by about a batch's memory every step. This runs a
// capture and, where it fails, ends the stream's capture, stops the pools recording and
// releases the use it took, before the error goes on.
#pragma once
#include <functional>

namespace faceshard {

// The steps of a capture as the device performs them (graph_capture_cuda in step_recorder.cpp;
// the tests model the allocator's bookkeeping on the CPU).
class CaptureSteps {
 public:
  enum class Pool { Device, Host };
  virtual ~CaptureSteps() = default;
  // Starts recording: each pool begins to take the stream's allocations (and is used once
  // more), then the stream starts capturing. May throw at either point.
  virtual void begin() = 0;
  // Ends the capture normally: the stream stops capturing, the pools stop recording, the
  // graph owns the pool's use. Throws where the capture was invalidated, in which case the
  // pools may still be recording.
  virtual void end() = 0;
  // After a failure: ends the stream's capture if it is still under way, discarding it.
  virtual void abandon() = 0;
  // Stops `pool` recording the stream's allocations; false where it was not recording.
  virtual bool stop_recording(Pool pool) = 0;
  // Gives back the use of `pool` that begin() took.
  virtual void release(Pool pool) = 0;
};

// Runs `work` between steps.begin() and steps.end(). Where anything throws, the capture is
// abandoned and each pool that still records is stopped and released (a pool that no longer
// records was handed to the graph by end(), which releases it); then the error is rethrown.
void capture_or_undo(CaptureSteps& steps, const std::function<void()>& work);

}  // namespace faceshard
