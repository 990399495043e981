// Creates the Gloo backend. The torch wheel exports ProcessGroupGloo from libtorch_cpu.so
// but does not ship the gloo headers that ProcessGroupGloo.hpp includes, so this file
// declares just the exported entry points it calls (same names and parameter types, hence
// the same linker symbols) instead of including that header:
//   ProcessGroupGloo::Options (layout: Backend::Options, devices, threads - as in the header),
//   createDeviceForHostname/Interface, the constructor and the destructor.
// The object is only used through c10d::Backend's virtual interface afterwards.
#include <cstdlib>
#include <cstring>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "partial_fc/distributed.h"
#include "partial_fc/error.h"

namespace gloo::transport {
class Device;
}

namespace c10d {
class ProcessGroupGloo : public Backend {
 public:
  struct Options : public Backend::Options {
    explicit Options(std::chrono::milliseconds timeout);
    std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
    int threads{2};
  };
  static std::shared_ptr<::gloo::transport::Device> createDeviceForInterface(const std::string& iface,
                                                                             bool lazy_init);
  static std::shared_ptr<::gloo::transport::Device> createDeviceForHostname(const std::string& host,
                                                                            bool lazy_init);
  ProcessGroupGloo(const c10::intrusive_ptr<Store>& store, int rank, int size, c10::intrusive_ptr<Options> options);
  ~ProcessGroupGloo() override;

 private:
  // The real object is smaller than this; `new` below reserves room for it, the library's
  // constructor fills it in.
  alignas(64) unsigned char storage_[64 * 1024];
};
}  // namespace c10d

namespace faceshard {

static bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, const DistEnv& env,
                                                    std::chrono::milliseconds timeout) {
  using c10d::ProcessGroupGloo;
  auto opts = c10::make_intrusive<ProcessGroupGloo::Options>(timeout);
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname && std::strlen(ifname) > 0) {
    std::string list(ifname);
    size_t start = 0;
    while (start <= list.size()) {
      size_t comma = list.find(',', start);
      std::string iface = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (!iface.empty()) opts->devices.push_back(ProcessGroupGloo::createDeviceForInterface(iface, false));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  } else if (is_loopback(env.master_addr) || env.local_world_size == env.world_size) {
    // All ranks on this machine: loopback needs no resolvable hostname.
    opts->devices.push_back(ProcessGroupGloo::createDeviceForHostname("127.0.0.1", false));
  } else {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    opts->devices.push_back(ProcessGroupGloo::createDeviceForHostname(host, false));
  }
  opts->threads = 2 * static_cast<int>(opts->devices.size());
  auto* raw = new ProcessGroupGloo(store, rank, size, opts);
  auto backend = c10::intrusive_ptr<c10d::Backend>::unsafe_steal_from_new(raw);
  if (backend->getBackendName() != "gloo")
    throw runtime_error("the Gloo backend of this LibTorch is not the expected one (name '",
                        backend->getBackendName(), "')");
  return backend;
}

}  // namespace faceshard
