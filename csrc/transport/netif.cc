#include "transport/netif.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

#include "core/env.h"
#include "core/error.h"

namespace smddp::net {
namespace {

std::vector<LocalAddress> upIPv4Interfaces() {
  std::vector<LocalAddress> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET || !(a->ifa_flags & IFF_UP)) continue;
    char ip[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, ip, sizeof(ip));
    out.push_back({a->ifa_name, ip, (a->ifa_flags & IFF_LOOPBACK) != 0});
  }
  freeifaddrs(list);
  return out;
}

// The local IPv4 address the kernel would use to reach `host` (a UDP connect sends nothing).
std::string routeTo(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res) return "";
  std::string ip;
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET_ADDRSTRLEN] = {};
      inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf));
      ip = buf;
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return ip;
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

LocalAddress chooseLocalAddress(int rank) {
  const std::vector<LocalAddress> all = upIPv4Interfaces();
  const std::string& spec = env::socketIfname();
  if (!spec.empty()) {
    for (const LocalAddress& a : all) {
      if (ifnameMatches(spec, a.ifname)) return a;
    }
    std::string names;
    for (const LocalAddress& a : all) names += (names.empty() ? "" : ", ") + a.ifname;
    throwError(ErrorCode::kInvalidUsage,
               "rank %d: SMDDP_SOCKET_IFNAME=%s matches no interface that is up with an IPv4 address (have: %s)",
               rank, spec.c_str(), names.c_str());
  }
  if (const char* master = std::getenv("MASTER_ADDR"); master && *master) {
    const std::string ip = routeTo(master);
    for (const LocalAddress& a : all) {
      if (a.ip == ip) return a;
    }
  }
  for (const LocalAddress& a : all) {
    if (!a.loopback && a.ifname.compare(0, 6, "docker") != 0) return a;
  }
  for (const LocalAddress& a : all) {
    if (a.loopback) return a;
  }
  throwError(ErrorCode::kSystemError, "rank %d: no network interface is up with an IPv4 address", rank);
}

}  // namespace smddp::net
