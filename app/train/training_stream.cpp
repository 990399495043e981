#include "app/train/training_stream.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <sstream>

#ifdef FACESHARD_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace faceshard {

c10::Stream current_stream(torch::Device device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

TrainingStream::TrainingStream(torch::Device device) : stream_(current_stream(device)), previous_(stream_) {
#ifdef FACESHARD_WITH_CUDA
  if (!device.is_cuda()) return;
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(index);
  previous_ = current.unwrap();
  if (current != c10::cuda::getDefaultCUDAStream(index)) {
    stream_ = current.unwrap();
    return;
  }
  const c10::cuda::CUDAStream mine = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
  c10::cuda::setCurrentCUDAStream(mine);
  stream_ = mine.unwrap();
  switched_ = true;
#endif
}

TrainingStream::~TrainingStream() {
#ifdef FACESHARD_WITH_CUDA
  if (switched_) c10::cuda::setCurrentCUDAStream(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, previous_));
#endif
}

std::string accumulator_stream_mismatch(const std::vector<at::Tensor>& params, c10::Stream stream) {
  for (size_t i = 0; i < params.size(); ++i) {
    const std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::try_get_grad_accumulator(params[i]);
    if (!acc || acc->num_inputs() == 0) continue;
    const c10::Stream s = acc->input_metadata(0).stream();
    if (s == stream) continue;
    std::ostringstream os;
    os << "parameter " << i << " (shape " << params[i].sizes() << "): its gradient accumulator runs on " << s
       << ", the capture on " << stream;
    return os.str();
  }
  return "";
}

}  // namespace faceshard
