// Socket helpers shared by the inter-host transports (the collectives' TCP mesh and the
// point-to-point engine): listening, address parsing, per-connection options.
#pragma once

#include <netinet/in.h>

#include <string>

namespace smddp::net {

struct Listener {
  int fd = -1;
  std::string address;  // "ip:port", as published for peers
};

// A listening socket on `ip` (an ephemeral port). Throws kSystemError naming `rank` and `ifname`.
Listener listenOn(const std::string& ip, const std::string& ifname, int backlog, int rank);

// "a.b.c.d:port" as published by rank `rank`; throws kRemoteError when malformed.
sockaddr_in parseAddress(const std::string& hostPort, int rank);

bool isLoopback(const std::string& hostPort);

// No Nagle (messages are headers followed by payload; latency matters), non-blocking, and the
// congestion control SMDDP_NET_CONGESTION names (warns once per process where it cannot be had).
void tuneSocket(int fd);

// Sets fd's TCP congestion control to `name` ("" leaves it alone). Returns "" on success, else
// why not (unknown to this kernel, or not allowed for this process).
std::string setCongestionControl(int fd, const std::string& name);

}  // namespace smddp::net
