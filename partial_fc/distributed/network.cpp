#include "partial_fc/distributed/network.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "base/error.h"

namespace faceshard {
namespace {

std::string ntop(const in_addr& a) {
  char buf[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &a, buf, sizeof(buf));
  return buf;
}

bool set(const char* v) { return v && *v; }

}  // namespace

std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

std::string resolve_ipv4(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res) throw usage_error("MASTER_ADDR '", host, "' does not resolve to an IPv4 address: ", gai_strerror(rc));
  const std::string ip = ntop(reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr);
  freeaddrinfo(res);
  return ip;
}

int listen_socket(const std::string& ipv4, int port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, ipv4.c_str(), &sa.sin_addr) != 1) throw runtime_error("'", ipv4, "' is not an IPv4 address");
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw runtime_error("cannot make a socket: ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0 || ::listen(fd, 1024) != 0) {
    const int e = errno;
    ::close(fd);
    throw runtime_error("cannot listen on ", ipv4, ":", port, ": ", std::strerror(e));
  }
  return fd;
}

bool is_loopback_ipv4(const std::string& address) { return address.rfind("127.", 0) == 0; }

std::vector<LocalInterface> external_interfaces() {
  std::vector<LocalInterface> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    if (!(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
    out.push_back({i->ifa_name, ntop(reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr)});
  }
  freeifaddrs(list);
  return out;
}

LocalInterface route_to(const std::string& address) {
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(9);  // any port: connect() on UDP only picks the route
  if (inet_pton(AF_INET, address.c_str(), &dst.sin_addr) != 1)
    throw usage_error("'", address, "' is not an IPv4 address");
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd < 0) throw runtime_error("cannot open a socket to find the route to ", address, ": ", std::strerror(errno));
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof(dst)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  const int err = errno;
  close(fd);
  if (!ok) throw runtime_error("this host has no route to ", address, ": ", std::strerror(err));
  LocalInterface li{"", ntop(local.sin_addr)};
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i; i = i->ifa_next)
      if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET &&
          reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == local.sin_addr.s_addr) {
        li.name = i->ifa_name;
        break;
      }
    freeifaddrs(list);
  }
  return li;
}

NetworkPlan plan_network(const DistEnv& env, const char* gloo_ifname, const char* nccl_ifname) {
  NetworkPlan plan;
  const bool spans_hosts = env.local_world_size < env.world_size;
  LocalInterface chosen;
  if (spans_hosts) {
    const std::string master = resolve_ipv4(env.master_addr);
    chosen = route_to(master);
    plan.reason = "the local end of the route to MASTER_ADDR " + env.master_addr +
                  (master != env.master_addr ? " (" + master + ")" : "");
    if (is_loopback_ipv4(chosen.address)) {
      // MASTER_ADDR names this very host through a loopback address (a hostname mapped to
      // 127.0.x.x): the other hosts reach it through its one external interface, if it
      // has exactly one.
      auto ext = external_interfaces();
      if (ext.size() != 1 && !set(gloo_ifname)) {
        std::string names;
        for (const auto& e : ext) names += (names.empty() ? "" : ", ") + e.name + " " + e.address;
        throw usage_error("MASTER_ADDR '", env.master_addr, "' is ", master, " (loopback) on this host, but the job spans ",
                          "several hosts: set MASTER_ADDR to an address the other hosts reach, or name this host's ",
                          "interface with GLOO_SOCKET_IFNAME (interfaces: ", names.empty() ? "none" : names, ")");
      }
      chosen = ext.size() == 1 ? ext.front() : LocalInterface{};
      plan.reason = "MASTER_ADDR " + env.master_addr + " is loopback here; this host's only external interface";
    }
  }
  if (set(gloo_ifname)) {
    plan.gloo_interfaces = split_list(gloo_ifname);
    plan.reason = std::string("GLOO_SOCKET_IFNAME=") + gloo_ifname;
  } else if (spans_hosts) {
    plan.gloo_address = chosen.address;
  } else {
    plan.gloo_address = "127.0.0.1";
    plan.reason = "all ranks on this host";
  }
  if (spans_hosts && !set(nccl_ifname) && !chosen.name.empty()) plan.nccl_interface = chosen.name;
  return plan;
}

}  // namespace faceshard
