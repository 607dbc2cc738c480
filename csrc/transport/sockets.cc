#include "transport/sockets.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "transport/wire.h"

namespace smddp::net {

namespace {

// `ip` (IPv4 or IPv6 text) and `port` as a socket address; len 0 when `ip` is neither.
SocketAddress socketAddress(const std::string& ip, uint16_t port) {
  SocketAddress a;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&a.storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
  if (inet_pton(AF_INET, ip.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    a.len = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, ip.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(port);
    a.len = sizeof(sockaddr_in6);
  }
  return a;
}

uint16_t portOf(const SocketAddress& a) {
  return ntohs(a.family() == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(&a.storage)->sin6_port
                                      : reinterpret_cast<const sockaddr_in*>(&a.storage)->sin_port);
}

}  // namespace

std::string numericHost(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (sa->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, buf, sizeof(buf));
  } else if (sa->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

std::string addressText(const SocketAddress& a) {
  const std::string host = numericHost(a.get());
  return (a.family() == AF_INET6 ? "[" + host + "]" : host) + ":" + std::to_string(portOf(a));
}

bool isLoopback(const SocketAddress& a) {
  if (a.family() == AF_INET6) {
    return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(&a.storage)->sin6_addr);
  }
  return a.family() == AF_INET &&
         (ntohl(reinterpret_cast<const sockaddr_in*>(&a.storage)->sin_addr.s_addr) >> 24) == 127;
}

Listener listenOn(const std::string& ip, const std::string& ifname, int backlog, int rank) {
  Listener l;
  SocketAddress a = socketAddress(ip, 0);
  l.fd = a.len == 0 ? -1 : socket(a.family(), SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (l.fd < 0 || bind(l.fd, a.get(), a.len) != 0 || listen(l.fd, backlog) != 0 ||
      getsockname(l.fd, reinterpret_cast<sockaddr*>(&a.storage), &a.len) != 0) {
    const int err = a.len == 0 ? EINVAL : errno;
    if (l.fd >= 0) close(l.fd);
    throwError(ErrorCode::kSystemError, "rank %d: cannot listen on %s (%s): %s", rank, ip.c_str(), ifname.c_str(),
               errnoString(err).c_str());
  }
  l.address = addressText(a);
  return l;
}

std::vector<Listener> listenOnEach(const std::vector<LocalAddress>& addrs, int backlog, int rank) {
  std::vector<Listener> listeners;
  try {
    for (const LocalAddress& a : addrs) listeners.push_back(listenOn(a.ip, a.ifname, backlog, rank));
  } catch (...) {
    for (const Listener& l : listeners) close(l.fd);
    throw;
  }
  return listeners;
}

std::string publishedAddresses(const std::vector<Listener>& listeners) {
  std::string text;
  for (const Listener& l : listeners) text += (text.empty() ? "" : " ") + l.address;
  return text;
}

std::vector<SocketAddress> parseAddresses(const std::string& published, int rank) {
  std::vector<SocketAddress> addrs;
  std::istringstream words(published);
  for (std::string w; words >> w;) addrs.push_back(parseAddress(w, rank));
  if (addrs.empty()) throwError(ErrorCode::kRemoteError, "rank %d published no address", rank);
  return addrs;
}

int laneSocket(const std::vector<SocketAddress>& peer, const std::vector<LocalAddress>& local, int lane, int rank,
               const SocketAddress** to) {
  const SocketAddress& dst = peer[static_cast<size_t>(lane) % peer.size()];
  *to = &dst;
  const int fd = socket(dst.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throwError(ErrorCode::kSystemError, "rank %d: socket: %s", rank, errnoString(errno).c_str());
  // The source is pinned only where both ranks have several interfaces and the lane joins their
  // interfaces of the same index (a rail): a peer with one NIC, or fewer than this rank, may
  // have no route back to this rank's other rails, so there the kernel's choice of source stands.
  const size_t mine = static_cast<size_t>(lane) % local.size(), theirs = static_cast<size_t>(lane) % peer.size();
  if (local.size() > 1 && peer.size() > 1 && mine == theirs) {
    const LocalAddress& from = local[mine];
    const SocketAddress src = socketAddress(from.ip, 0);
    if (src.len == 0 || bind(fd, src.get(), src.len) != 0) {
      const int err = src.len == 0 ? EINVAL : errno;
      close(fd);
      throwError(ErrorCode::kSystemError, "rank %d: cannot connect from %s (%s) to %s: %s", rank, from.ip.c_str(),
                 from.ifname.c_str(), addressText(dst).c_str(), errnoString(err).c_str());
    }
  }
  return fd;
}

SocketAddress parseAddress(const std::string& hostPort, int rank) {
  const size_t colon = hostPort.rfind(':');
  std::string host = colon == std::string::npos ? "" : hostPort.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string::npos) {
    host.clear();  // an IPv6 host must be bracketed, or its last group would pass for the port
  }
  int port = -1;
  try {
    port = colon == std::string::npos ? -1 : std::stoi(hostPort.substr(colon + 1));
  } catch (const std::exception&) {
  }
  const SocketAddress a = socketAddress(host, static_cast<uint16_t>(port));
  if (a.len == 0 || port <= 0 || port > 65535) {
    throwError(ErrorCode::kRemoteError, "rank %d published a malformed address '%s'", rank, hostPort.c_str());
  }
  return a;
}

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

namespace {

bool transferWithin(int fd, char* p, size_t n, bool sending, std::chrono::steady_clock::time_point deadline) {
  while (n > 0) {
    pollfd pfd{fd, static_cast<short>(sending ? POLLOUT : POLLIN), 0};
    const int ready = poll(&pfd, 1, msLeft(deadline));
    if (ready < 0 && errno == EINTR) continue;  // a signal: the deadline still bounds the wait
    if (ready <= 0) return false;
    const ssize_t k = sending ? send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, p, n, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

}  // namespace

int msLeft(std::chrono::steady_clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

bool sendWithin(int fd, const void* buf, size_t n, std::chrono::steady_clock::time_point deadline) {
  return transferWithin(fd, const_cast<char*>(static_cast<const char*>(buf)), n, true, deadline);
}

bool recvWithin(int fd, void* buf, size_t n, std::chrono::steady_clock::time_point deadline) {
  return transferWithin(fd, static_cast<char*>(buf), n, false, deadline);
}

void closeWithFarewell(int fd, const std::string& frame) {
  if (!frame.empty()) {
    // Whole if the socket takes it within a moment (a nearly full buffer may take part of it
    // first); a peer that stopped reading gets a cut farewell, which it reads as a closed
    // connection, or none.
    sendWithin(fd, frame.data(), frame.size(), std::chrono::steady_clock::now() + std::chrono::milliseconds(20));
    shutdown(fd, SHUT_WR);
    // Closing a socket that holds unread data resets the connection at once, and a reset drops
    // whatever is still queued to go out, the farewell too: take what is there first (bounded,
    // for a peer that keeps sending as fast as this reads).
    char sink[64 << 10];
    for (int i = 0; i < 256 && recv(fd, sink, sizeof(sink), MSG_DONTWAIT) > 0; ++i) {
    }
  }
  close(fd);
}

std::optional<std::string> peekFarewell(int fd) {
  char buf[wire::kHeaderBytes + wire::kMaxFarewellBytes];
  // The farewell left in one send, but may arrive in two segments, and a peek may show less
  // than has arrived: give the rest of one that has begun a moment (a failure path only).
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  for (;;) {
    const ssize_t k = recv(fd, buf, sizeof(buf), MSG_PEEK | MSG_DONTWAIT);
    if (k > 0) {
      if (std::optional<std::string> why = wire::farewellIn(buf, static_cast<size_t>(k))) return why;
      if (!wire::farewellBegins(buf, static_cast<size_t>(k))) return std::nullopt;
    } else if (k == 0 || errno != EINTR) {  // nothing there (EAGAIN): nothing has begun
      return std::nullopt;
    }
    if (std::chrono::steady_clock::now() >= until) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool outOfResources(int err) { return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM; }

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
