// Socket helpers shared by the inter-host transports (the collectives' TCP mesh and the
// point-to-point engine): listening, address parsing, per-connection options.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "transport/netif.h"

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

// Listeners on each of `addrs` (one per interface, as chooseLocalAddresses() gives them); those
// made are closed if a later one fails.
std::vector<Listener> listenOnEach(const std::vector<LocalAddress>& addrs, int backlog, int rank);

// The listeners' addresses as a rank publishes them: space-separated, in interface order.
std::string publishedAddresses(const std::vector<Listener>& listeners);

// What rank `rank` published (publishedAddresses); throws kRemoteError when malformed or empty.
std::vector<SocketAddress> parseAddresses(const std::string& published, int rank);

// A non-blocking socket for lane `lane` of a connection to a peer that listens on `peer`, to be
// connected to the peer's (lane mod count)-th address, which it returns in `to`; where both ranks
// have several interfaces and the lane's index is the same on both sides, it is bound to this
// rank's one of that index, so that lane k joins the two hosts' k-th NICs (a rail). Throws
// kSystemError naming `rank`.
int laneSocket(const std::vector<SocketAddress>& peer, const std::vector<LocalAddress>& local, int lane, int rank,
               const SocketAddress** to);

// No Nagle (messages are headers followed by payload; latency matters), non-blocking, and the
// congestion control SMDDP_NET_CONGESTION names (warns once per process where it cannot be had).
void tuneSocket(int fd);

// Whether a failed accept4's errno means this process ran out of descriptors or memory: the
// connection stays queued, so the listener stays readable and a poll loop would spin on it.
bool outOfResources(int err);

// Milliseconds from now to `deadline`, for poll(): 0 once past.
int msLeft(std::chrono::steady_clock::time_point deadline);
// Sends all of [buf, buf + n) on fd, or receives that many bytes into it, waiting for the socket
// (blocking or not) as needed until `deadline`; a signal or a partial transfer goes on. False at
// the deadline, or once the connection failed (or, receiving, closed).
bool sendWithin(int fd, const void* buf, size_t n, std::chrono::steady_clock::time_point deadline);
bool recvWithin(int fd, void* buf, size_t n, std::chrono::steady_clock::time_point deadline);

// Closes a connection, first sending `frame` (a farewell, wire::farewellFrame; nothing if empty)
// and a FIN after it. Call it only where the stream to the peer is between two messages.
void closeWithFarewell(int fd, const std::string& frame);
// The reason in a whole farewell waiting unread at the front of fd's stream (left there), if
// one is; call it only where the stream from the peer is between two messages.
std::optional<std::string> peekFarewell(int fd);

// Sets fd's TCP congestion control to `name` ("" leaves it alone). Returns "" on success, else
// why not (unknown to this kernel, or not allowed for this process).
std::string setCongestionControl(int fd, const std::string& name);

}  // namespace smddp::net
