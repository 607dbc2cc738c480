// Which local addresses the inter-host TCP mesh listens on.
#pragma once

#include <string>
#include <vector>

namespace smddp::net {

struct LocalAddress {
  std::string ifname;
  std::string ip;  // numeric IPv4 or IPv6
  bool loopback = false;
  bool ipv6 = false;
};

// NCCL_SOCKET_IFNAME semantics: a comma list of name prefixes; a leading '^' excludes instead of
// selects; a leading '=' (after any '^') matches names exactly.
bool ifnameMatches(const std::string& spec, const std::string& name);

// Most interfaces one rank uses (NCCL's MAX_IFS).
constexpr int kMaxInterfaces = 16;

// Where the TCP mesh listens, one address per interface. Among the addresses of
// SMDDP_SOCKET_FAMILY (default either, IPv4 first): with SMDDP_SOCKET_IFNAME naming interfaces
// ('eth', 'eth0,eth1', '=eth0'), every interface it matches, as NCCL uses every interface
// NCCL_SOCKET_IFNAME matches (at most kMaxInterfaces, all of the first one's family); with an
// exclusion ('^lo,docker'), the first interface it leaves; an error if it matches none. Without
// it, the one address that routes to MASTER_ADDR, else the first interface that is up, not
// loopback and not docker*, loopback only when there is nothing else. Chosen once per process
// and MASTER_ADDR.
std::vector<LocalAddress> chooseLocalAddresses();

// The interfaces' names ("eth0,eth1") and addresses ("10.0.0.1,10.1.0.1"), comma-separated.
std::string interfaceNames(const std::vector<LocalAddress>& addrs);
std::string interfaceAddresses(const std::vector<LocalAddress>& addrs);

}  // namespace smddp::net
