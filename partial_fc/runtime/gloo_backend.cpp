// Creates the Gloo backend from torch's own ProcessGroupGloo (its header needs gloo's
// headers, which Debian's libgloo-dev provides; the implementation is in the wheel's
// libtorch_cpu.so).
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "partial_fc/runtime/distributed.h"
#include "partial_fc/runtime/error.h"

namespace faceshard {

static bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, const DistEnv& env,
                                                    std::chrono::milliseconds timeout) {
  using c10d::ProcessGroupGloo;
  auto opts = ProcessGroupGloo::Options::create(timeout);
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname && std::strlen(ifname) > 0) {
    std::string list(ifname);
    size_t start = 0;
    while (start <= list.size()) {
      size_t comma = list.find(',', start);
      std::string iface = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (!iface.empty()) opts->devices.push_back(ProcessGroupGloo::createDeviceForInterface(iface));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  } else if (is_loopback(env.master_addr) || env.local_world_size == env.world_size) {
    // All ranks on this machine: loopback needs no resolvable hostname.
    opts->devices.push_back(ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    opts->devices.push_back(ProcessGroupGloo::createDeviceForHostname(host));
  }
  opts->threads = 2 * static_cast<int>(opts->devices.size());
  c10::intrusive_ptr<c10d::Backend> backend = c10::make_intrusive<ProcessGroupGloo>(store, rank, size, opts);
  // The header and the library come from different packages: check they agree.
  if (backend->getBackendName() != "gloo")
    throw runtime_error("the Gloo backend of this LibTorch is not the expected one (name '",
                        backend->getBackendName(), "')");
  return backend;
}

}  // namespace faceshard
