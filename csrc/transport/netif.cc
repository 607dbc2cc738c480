#include "transport/netif.h"

#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "core/env.h"
#include "core/error.h"
#include "transport/sockets.h"

namespace smddp::net {
namespace {

// The addresses of the interfaces that are up, IPv4 first (each group in the system's order).
// IPv6 link-local addresses are left out: they name a link, not a host, and need a scope id.
std::vector<LocalAddress> upInterfaces() {
  std::vector<LocalAddress> v4, v6;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {  // out of descriptors, say: not the same as no interface
    throwError(ErrorCode::kSystemError, "cannot list the network interfaces: %s", errnoString(errno).c_str());
  }
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || !(a->ifa_flags & IFF_UP)) continue;
    const int family = a->ifa_addr->sa_family;
    if (family == AF_INET6 && IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr)) continue;
    if (family != AF_INET && family != AF_INET6) continue;
    const bool loopback = (a->ifa_flags & IFF_LOOPBACK) != 0;
    (family == AF_INET ? v4 : v6).push_back({a->ifa_name, numericHost(a->ifa_addr), loopback, family == AF_INET6});
  }
  freeifaddrs(list);
  v4.insert(v4.end(), v6.begin(), v6.end());
  return v4;
}

// Where the process has no descriptor left, throws saying so: a route to `host` not found then is
// no missing route, and the interface picked without it may be one that does not reach the
// other hosts.
void throwIfOutOfDescriptors(const std::string& host) {
  const int probe = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (probe >= 0) {
    close(probe);
    return;
  }
  if (errno == EMFILE || errno == ENFILE) {
    throwError(ErrorCode::kSystemError, "cannot find the interface that routes to %s: socket: %s", host.c_str(),
               errnoString(errno).c_str());
  }
}

// The local address the kernel would use to reach `host` (a UDP connect sends nothing), of the
// first family `host` resolves to that `family` allows (AF_UNSPEC: either).
std::string routeTo(const std::string& host, int family) {
  addrinfo hints{};
  hints.ai_family = family;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res) {
    throwIfOutOfDescriptors(host);  // a name lookup fails so too ("Name or service not known")
    return "";
  }
  std::string ip;
  const int fd = socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    throwIfOutOfDescriptors(host);
    return "";
  }
  if (connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      ip = numericHost(reinterpret_cast<sockaddr*>(&local));
    }
  }
  close(fd);
  freeaddrinfo(res);
  return ip;
}

// SMDDP_SOCKET_FAMILY as an address family.
int familyAsked() {
  const std::string& f = env::socketFamily();
  if (f.empty()) return AF_UNSPEC;
  if (f == "AF_INET") return AF_INET;
  return AF_INET6;  // the only other value env.cc lets through
}

const char* familyText(int family) {
  return family == AF_INET ? "an IPv4 address" : family == AF_INET6 ? "an IPv6 address" : "an IPv4 or IPv6 address";
}

std::string commaList(const std::vector<LocalAddress>& addrs, std::string LocalAddress::*field) {
  std::string list;
  for (const LocalAddress& a : addrs) list += (list.empty() ? "" : ",") + a.*field;
  return list;
}

// chooseLocalAddresses() without the cache; `master`: MASTER_ADDR ("" when unset).
std::vector<LocalAddress> pickLocalAddresses(const std::string& master) {
  const int family = familyAsked();
  std::vector<LocalAddress> all = upInterfaces();
  if (family != AF_UNSPEC) {
    std::erase_if(all, [&](const LocalAddress& a) { return a.ipv6 != (family == AF_INET6); });
  }
  const std::string spec = env::socketIfname();
  if (!spec.empty()) {
    // One address per interface (its first: IPv4 before IPv6), all of one family: lane k of a
    // pair joins the two ranks' k-th interfaces, which must speak the same protocol. Names (a
    // prefix, a list) select every interface they match; an exclusion ('^lo,docker') only the
    // first one left, as it always did: "not these" does not name the NICs to use, and the rest
    // may include bridges and VPNs that do not reach the other hosts.
    const size_t most = spec[0] == '^' ? 1 : static_cast<size_t>(kMaxInterfaces);
    std::vector<LocalAddress> picked;
    for (const LocalAddress& a : all) {
      if (!ifnameMatches(spec, a.ifname) || picked.size() == most) continue;
      const bool named =
          std::any_of(picked.begin(), picked.end(), [&](const LocalAddress& p) { return p.ifname == a.ifname; });
      if (!named && (picked.empty() || picked.front().ipv6 == a.ipv6)) picked.push_back(a);
    }
    if (!picked.empty()) return picked;
    std::vector<std::string> seen;  // an interface with several addresses is named once
    std::string names;
    for (const LocalAddress& a : all) {
      if (std::find(seen.begin(), seen.end(), a.ifname) != seen.end()) continue;
      seen.push_back(a.ifname);
      names += (names.empty() ? "" : ", ") + a.ifname;
    }
    throwError(ErrorCode::kInvalidUsage, "SMDDP_SOCKET_IFNAME=%s matches no interface that is up with %s (have: %s)",
               spec.c_str(), familyText(family), names.c_str());
  }
  if (!master.empty()) {
    const std::string ip = routeTo(master, family);
    for (const LocalAddress& a : all) {
      if (a.ip == ip) return {a};
    }
  }
  for (const LocalAddress& a : all) {
    if (!a.loopback && a.ifname.compare(0, 6, "docker") != 0) return {a};
  }
  for (const LocalAddress& a : all) {
    if (a.loopback) return {a};
  }
  throwError(ErrorCode::kSystemError, "no network interface is up with %s", familyText(family));
}

}  // namespace

bool ifnameMatches(const std::string& specIn, const std::string& name) {
  std::string spec = specIn;
  const bool exclude = !spec.empty() && spec[0] == '^';
  if (exclude) spec.erase(0, 1);
  const bool exact = !spec.empty() && spec[0] == '=';
  if (exact) spec.erase(0, 1);
  bool hit = false;
  std::stringstream ss(spec);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.empty()) continue;
    if (exact ? name == item : name.compare(0, item.size(), item) == 0) hit = true;
  }
  return exclude ? !hit : hit;
}

std::string interfaceNames(const std::vector<LocalAddress>& addrs) { return commaList(addrs, &LocalAddress::ifname); }

std::string interfaceAddresses(const std::vector<LocalAddress>& addrs) { return commaList(addrs, &LocalAddress::ip); }

std::vector<LocalAddress> chooseLocalAddresses() {
  // Once per process and MASTER_ADDR (the settings are read once too, and NCCL also picks its
  // interfaces once): FSDP and DeviceMesh create many groups, and a MASTER_ADDR that is a name
  // would cost a DNS lookup for each. A failure is not kept: the next group tries again.
  static std::mutex mutex;
  static std::map<std::string, std::vector<LocalAddress>> chosen;
  const char* master = std::getenv("MASTER_ADDR");
  const std::string key = master != nullptr ? master : "";
  std::lock_guard<std::mutex> lock(mutex);
  auto it = chosen.find(key);
  if (it == chosen.end()) it = chosen.emplace(key, pickLocalAddresses(key)).first;
  return it->second;
}

}  // namespace smddp::net
