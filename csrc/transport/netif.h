// Which local address the inter-host TCP mesh listens on.
#pragma once

#include <string>

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

// Among the addresses of SMDDP_SOCKET_FAMILY (default either, IPv4 first): SMDDP_SOCKET_IFNAME's
// if set (an error if nothing matches); otherwise the address that routes to MASTER_ADDR;
// otherwise the first interface that is up, not loopback and not docker*; loopback only when
// there is nothing else. Chosen once per process and MASTER_ADDR.
LocalAddress chooseLocalAddress();

}  // namespace smddp::net
