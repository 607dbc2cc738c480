// Socket helpers shared by the inter-host transports (the collectives' TCP mesh and the
// point-to-point engine): listening, address parsing, per-connection options.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <string>

namespace smddp::net {

struct Listener {
  int fd = -1;
  std::string address;  // "ip:port" or "[ipv6]:port", as published for peers
};

// An IPv4 or IPv6 socket address.
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t len = 0;
  int family() const { return storage.ss_family; }
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

// A listening socket on `ip` (IPv4 or IPv6 text; an ephemeral port). Throws kSystemError naming
// `rank` and `ifname`.
Listener listenOn(const std::string& ip, const std::string& ifname, int backlog, int rank);

// "a.b.c.d:port" or "[ipv6]:port" as published by rank `rank`; throws kRemoteError when malformed.
SocketAddress parseAddress(const std::string& hostPort, int rank);

// The numeric host of an IPv4 or IPv6 socket address ("" for another family).
std::string numericHost(const sockaddr* sa);

// "ip:port", or "[ipv6]:port".
std::string addressText(const SocketAddress& a);

// 127.0.0.0/8 or ::1.
bool isLoopback(const SocketAddress& a);

// No Nagle (messages are headers followed by payload; latency matters), non-blocking, and the
// congestion control SMDDP_NET_CONGESTION names (warns once per process where it cannot be had).
void tuneSocket(int fd);

// Sets fd's TCP congestion control to `name` ("" leaves it alone). Returns "" on success, else
// why not (unknown to this kernel, or not allowed for this process).
std::string setCongestionControl(int fd, const std::string& name);

}  // namespace smddp::net
