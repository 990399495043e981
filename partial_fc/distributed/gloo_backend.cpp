// Creates the Gloo backend from torch's own ProcessGroupGloo (its header needs gloo's
// headers, which Debian's libgloo-dev provides; the implementation is in the wheel's
// libtorch_cpu.so).
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "partial_fc/distributed/distributed.h"
#include "base/error.h"
#include "partial_fc/distributed/network.h"

namespace faceshard {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, const NetworkPlan& net,
                                                    std::chrono::milliseconds rendezvous_timeout) {
  using c10d::ProcessGroupGloo;
  // The options' timeout bounds the full-mesh connection at construction; every collective
  // passes its own timeout.
  auto opts = ProcessGroupGloo::Options::create(rendezvous_timeout);
  for (const auto& iface : net.gloo_interfaces) opts->devices.push_back(ProcessGroupGloo::createDeviceForInterface(iface));
  if (opts->devices.empty()) opts->devices.push_back(ProcessGroupGloo::createDeviceForHostname(net.gloo_address));
  opts->threads = 2 * static_cast<int>(opts->devices.size());
  c10::intrusive_ptr<c10d::Backend> backend = c10::make_intrusive<ProcessGroupGloo>(store, rank, size, opts);
  // The header and the library come from different packages: check they agree.
  if (backend->getBackendName() != "gloo")
    throw runtime_error("the Gloo backend of this LibTorch is not the expected one (name '",
                        backend->getBackendName(), "')");
  return backend;
}

}  // namespace faceshard
