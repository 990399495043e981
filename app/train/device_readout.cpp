#include "app/train/device_readout.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "base/error.h"

namespace faceshard {

void DeviceReadout::post(const std::vector<at::Tensor>& scalars, Callback then) {
  at::NoGradGuard ng;
  std::optional<at::Device> device;
  std::vector<at::Tensor> flat;
  for (const at::Tensor& t : scalars) {
    if (!t.defined()) continue;
    if (t.numel() != 1) throw runtime_error("device readout: a value of ", t.numel(), " elements (one expected)");
    if (device && *device != t.device())
      throw runtime_error("device readout: values on ", device->str(), " and ", t.device().str());
    device = t.device();
  }
  const at::Device dev = device.value_or(at::Device(at::kCPU));
  for (const at::Tensor& t : scalars)
    flat.push_back(t.defined() ? t.detach().reshape({1}).to(at::kDouble) : at::zeros({1}, at::TensorOptions(dev).dtype(at::kDouble)));
  Post p;
  p.then = std::move(then);
  if (flat.empty()) {
    p.host = at::empty({0}, at::kDouble);
  } else if (dev.is_cpu()) {
    p.host = at::cat(flat);
  } else {
    const at::Tensor packed = at::cat(flat);
    p.host = at::empty(packed.sizes(), at::TensorOptions(at::kCPU).dtype(at::kDouble).pinned_memory(true));
    p.host.copy_(packed, /*non_blocking=*/true);
    const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(dev.type());
    p.done = std::make_unique<c10::Event>(dev.type());
    p.done->record(impl->getStream(dev));
  }
  queue_.push_back(std::move(p));
}

int DeviceReadout::deliver(bool wait) {
  int ran = 0;
  while (!queue_.empty()) {
    Post& p = queue_.front();
    if (p.done) {
      if (!wait && !p.done->query()) break;
      p.done->synchronize();
    }
    const double* v = p.host.data_ptr<double>();
    const std::vector<double> values(v, v + p.host.numel());
    Callback then = std::move(p.then);
    queue_.pop_front();
    then(values);
    ran++;
  }
  return ran;
}

}  // namespace faceshard
