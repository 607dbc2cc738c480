#include "transport/sockets.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <mutex>

#include "core/env.h"
#include "core/error.h"
#include "core/log.h"

namespace smddp::net {

Listener listenOn(const std::string& ip, const std::string& ifname, int backlog, int rank) {
  Listener l;
  l.fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, ip.c_str(), &sa.sin_addr);
  socklen_t len = sizeof(sa);
  if (l.fd < 0 || bind(l.fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || listen(l.fd, backlog) != 0 ||
      getsockname(l.fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    const int err = errno;
    if (l.fd >= 0) close(l.fd);
    throwError(ErrorCode::kSystemError, "rank %d: cannot listen on %s (%s): %s", rank, ip.c_str(), ifname.c_str(),
               errnoString(err).c_str());
  }
  l.address = ip + ":" + std::to_string(ntohs(sa.sin_port));
  return l;
}

sockaddr_in parseAddress(const std::string& hostPort, int rank) {
  const size_t colon = hostPort.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  if (colon == std::string::npos || inet_pton(AF_INET, hostPort.substr(0, colon).c_str(), &sa.sin_addr) != 1) {
    throwError(ErrorCode::kRemoteError, "rank %d published a malformed address '%s'", rank, hostPort.c_str());
  }
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(hostPort.substr(colon + 1))));
  return sa;
}

bool isLoopback(const std::string& hostPort) { return hostPort.compare(0, 4, "127.") == 0; }

std::string setCongestionControl(int fd, const std::string& name) {
  if (name.empty() || setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name.data(), name.size()) == 0) return "";
  const int err = errno;
  auto sysctl = [](const char* leaf) {
    std::string v;
    std::getline(std::ifstream(std::string("/proc/sys/net/ipv4/") + leaf), v);
    return v.empty() ? std::string("?") : v;
  };
  if (err == ENOENT) {
    return "this kernel has no '" + name + "' (available: " + sysctl("tcp_available_congestion_control") + ")";
  }
  if (err == EPERM) {
    return "'" + name + "' is not allowed for this process (net.ipv4.tcp_allowed_congestion_control = " +
           sysctl("tcp_allowed_congestion_control") + ")";
  }
  return errnoString(err);
}

void tuneSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  const std::string why = setCongestionControl(fd, env::netCongestion());
  if (!why.empty()) {
    static std::once_flag warned;
    std::call_once(warned, [&] {
      SMDDP_WARN(kNet, "SMDDP_NET_CONGESTION=%s: %s; inter-host connections keep the system's default",
                 env::netCongestion().c_str(), why.c_str());
    });
  }
}

}  // namespace smddp::net
