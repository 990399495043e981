// Which local address the ranks of a job use to reach each other. On one host every rank
// talks over loopback. Across hosts a rank must advertise an address the other hosts
// reach, and a container's hostname often resolves to 127.0.0.1: so the address is taken
// from the kernel's route to MASTER_ADDR (the local end of that route), unless the user
// named interfaces (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME always win).
#pragma once
#include <string>
#include <vector>

#include "partial_fc/distributed/dist_env.h"

namespace faceshard {

struct LocalInterface {
  std::string name;     // "eth0"
  std::string address;  // "10.78.0.2"
};

// The IPv4 address of `host` (a dotted quad or a name); a usage error naming it when it
// does not resolve.
std::string resolve_ipv4(const std::string& host);
bool is_loopback_ipv4(const std::string& address);
// The local end of the route to `address` (a UDP socket connected to it: the kernel picks
// the source address; no packet is sent) and the interface holding it.
LocalInterface route_to(const std::string& address);
// A TCP socket bound to `ipv4`:`port` and listening (close-on-exec; the caller owns it): the
// rendezvous store listens on the address it was given, never on every interface. Runtime
// error naming the address and the cause when it cannot be bound (in use, not local).
int listen_socket(const std::string& ipv4, int port);
// Interfaces that are up, not loopback, with an IPv4 address.
std::vector<LocalInterface> external_interfaces();

struct NetworkPlan {
  // Gloo: one device per named interface (GLOO_SOCKET_IFNAME), else one on `gloo_address`.
  std::vector<std::string> gloo_interfaces;
  std::string gloo_address;
  // NCCL_SOCKET_IFNAME to set before the communicator is created ("" = leave it alone).
  std::string nccl_interface;
  std::string reason;  // one line for the log: what was chosen and why
};

// Decides from the job's place and the two variables (nullptr or "" = unset). Usage error
// when the job spans hosts and no address the other hosts could reach can be found.
NetworkPlan plan_network(const DistEnv& env, const char* gloo_socket_ifname, const char* nccl_socket_ifname);

// The non-empty items of a comma-separated list ("eth0,,ib0" -> eth0, ib0).
std::vector<std::string> split_list(const std::string& list);

}  // namespace faceshard
