#include "partial_fc/distributed/gloo_port_guard.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "base/log.h"

namespace faceshard {
namespace {

struct SocketInfo {
  int fd = -1;
  unsigned long inode = 0;
  bool listening = false;
  int port = 0;  // local
};

// This process's TCP sockets (IPv4 and IPv6).
std::vector<SocketInfo> tcp_sockets() {
  std::vector<SocketInfo> out;
  DIR* dir = ::opendir("/proc/self/fd");
  if (!dir) return out;
  const int own = ::dirfd(dir);
  while (dirent* e = ::readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (*e->d_name == '\0' || *end != '\0' || fd == own) continue;
    struct stat st {};
    if (::fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    int type = 0, domain = 0, accepting = 0;
    socklen_t len = sizeof type;
    if (::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) continue;
    len = sizeof domain;
    if (::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0 ||
        (domain != AF_INET && domain != AF_INET6))
      continue;
    len = sizeof accepting;
    ::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len);
    sockaddr_storage ss{};
    len = sizeof ss;
    if (::getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&ss), &len) != 0) continue;
    SocketInfo s;
    s.fd = static_cast<int>(fd);
    s.inode = st.st_ino;
    s.listening = accepting != 0;
    s.port = ss.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port)
                                     : ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
    out.push_back(s);
  }
  ::closedir(dir);
  return out;
}

std::string peer_of(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    return std::string(host) + ":" + std::to_string(ntohs(a->sin_port));
  }
  const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
  ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
  return "[" + std::string(host) + "]:" + std::to_string(ntohs(a->sin6_port));
}

}  // namespace

GlooPortGuard::GlooPortGuard(const std::vector<int>& other_ports, std::chrono::milliseconds period) {
  const auto all = tcp_sockets();
  for (const auto& s : all)
    if (s.listening && std::find(other_ports.begin(), other_ports.end(), s.port) == other_ports.end() &&
        std::find(ports_.begin(), ports_.end(), s.port) == ports_.end())
      ports_.push_back(s.port);
  for (const auto& s : all)
    if (!s.listening && std::find(ports_.begin(), ports_.end(), s.port) != ports_.end()) known_.insert(s.inode);
  if (ports_.empty()) return;
  thread_ = std::thread([this, period] {
    std::unique_lock<std::mutex> lock(m_);
    while (!cv_.wait_for(lock, period, [this] { return stop_; })) {
      lock.unlock();
      sweep();
      lock.lock();
    }
  });
}

GlooPortGuard::~GlooPortGuard() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void GlooPortGuard::sweep() {
  std::lock_guard<std::mutex> lock(sweep_m_);
  std::set<unsigned long> shut;  // those shut down before that are still open (Gloo keeps some)
  for (const auto& s : tcp_sockets()) {
    if (s.listening || known_.count(s.inode) || std::find(ports_.begin(), ports_.end(), s.port) == ports_.end())
      continue;
    if (shut_.count(s.inode)) {
      shut.insert(s.inode);
      continue;
    }
    // Accepted on a Gloo port after the mesh formed: nobody of the job's.
    const std::string peer = peer_of(s.fd);
    if (::shutdown(s.fd, SHUT_RDWR) != 0) continue;  // gone meanwhile
    shut.insert(s.inode);
    const int64_t n = ++closed_;
    if (n == 1 || n == 10 || n == 100 || n == 1000 || n == 10000)
      log_warn("network: closed ", n == 1 ? "a connection" : std::to_string(n) + " connections so far", " to Gloo's port ",
               s.port, n == 1 ? " from " + peer : std::string(), ": Gloo's own connections were all made at start-up");
  }
  shut_.swap(shut);
}

}  // namespace faceshard
