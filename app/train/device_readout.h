// Values of the device that the host reads without waiting for the device: post() queues
// one asynchronous copy of some scalars into pinned host memory and records an event after
// it; deliver() hands the values of every post whose copy is done to its callback, in the
// order they were posted (with `wait`, all of them, waiting for the last copy). A training
// loop posts its log step's loss and metrics and delivers them a step or two later, when
// the device has long finished them: the log costs the step no host synchronisation. On
// the CPU a post's values are ready at once.
#pragma once
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>

namespace faceshard {

class DeviceReadout {
 public:
  using Callback = std::function<void(const std::vector<double>& values)>;

  // `scalars`: tensors of one element each, all on one device (undefined ones read as 0).
  void post(const std::vector<at::Tensor>& scalars, Callback then);
  // Runs the callbacks of the posts that are ready (all of them with `wait`), oldest
  // first; a post that is not ready holds back the ones after it. A callback that throws
  // leaves the posts after it queued. Returns how many ran.
  int deliver(bool wait);
  size_t pending() const { return queue_.size(); }

 private:
  struct Post {
    at::Tensor host;  // float64, pinned on a GPU run
    std::unique_ptr<c10::Event> done;
    Callback then;
  };
  std::deque<Post> queue_;
};

}  // namespace faceshard
