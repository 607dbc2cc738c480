#include "transport/topology.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "core/random.h"
#include "transport/shm_owner.h"

namespace smddp {
namespace {

const std::string kNonceKey = "smddp/topo/nonce";
std::string infoKey(int rank) { return "smddp/topo/info/" + std::to_string(rank); }
std::string leaderKey(int rank) { return "smddp/topo/leader/" + std::to_string(rank); }

std::string bootId() {
  std::string id;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, id);
  return id.empty() ? "unknown-boot-id" : id;
}

std::string netNamespace() {
  char link[64] = {};
  const ssize_t n = readlink("/proc/self/ns/net", link, sizeof(link) - 1);
  return n > 0 ? std::string(link, n) : "unknown-net-namespace";
}

std::string hostname() {
  char buf[256] = {};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// Record fields are separated by '\n', which none of them can contain; cpulist items by ','.
std::vector<std::string> splitOn(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, sep);) out.push_back(item);
  return out;
}

// CPU ids in the kernel's cpulist form ("0-63,128-191"): a few bytes for a pinned or whole
// machine, and every rank reads every rank's record.
std::string cpuList(const std::vector<int>& ascending) {
  std::string out;
  for (size_t i = 0; i < ascending.size();) {
    size_t j = i;
    while (j + 1 < ascending.size() && ascending[j + 1] == ascending[j] + 1) ++j;
    out += (out.empty() ? "" : ",") + std::to_string(ascending[i]);
    if (j > i) out += "-" + std::to_string(ascending[j]);
    i = j + 1;
  }
  return out;
}

void addCpuList(const std::string& list, int rank, std::set<int>& cpus) {
  for (const std::string& item : splitOn(list, ',')) {
    char* end = nullptr;
    const long lo = std::strtol(item.c_str(), &end, 10);
    const bool empty = end == item.c_str();
    const long hi = *end == '-' ? std::strtol(end + 1, &end, 10) : lo;
    if (empty || *end != '\0' || lo < 0 || hi < lo || hi >= (1 << 20)) {
      throwError(ErrorCode::kRemoteError, "rank %d published a malformed CPU list '%s'", rank, list.c_str());
    }
    for (long c = lo; c <= hi; ++c) cpus.insert(static_cast<int>(c));
  }
}

bool tokenVisible(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

}  // namespace

int Topology::maxLocalSize() const {
  size_t m = 0;
  for (const auto& h : members) m = std::max(m, h.size());
  return static_cast<int>(m);
}

bool Topology::sharesLoopback(int a, int b) const {
  return bootIds[a] == bootIds[b] && netNamespaces[a] == netNamespaces[b];
}

std::string Topology::describeHost(int h) const {
  return hostnames[members[h][0]] + " (host " + std::to_string(h) + ")";
}

Topology Topology::singleHost(int rank, int size) {
  Topology t;
  t.rank = rank;
  t.size = size;
  t.hostOf.assign(size, 0);
  t.members.assign(1, {});
  for (int r = 0; r < size; ++r) {
    t.localOf.push_back(r);
    t.members[0].push_back(r);
  }
  t.bootIds.assign(size, bootId());
  t.netNamespaces.assign(size, netNamespace());
  t.hostnames.assign(size, hostname());
  t.cpuShare = {size, usableCpus()};
  return t;
}

std::vector<std::string> Topology::keysOwedBy(int rank) {
  std::vector<std::string> keys = {infoKey(rank), leaderKey(rank)};
  if (rank == 0) keys.push_back(kNonceKey);
  return keys;
}

Topology Topology::discover(Store& store, int rank, int size) {
  Topology t;
  t.rank = rank;
  t.size = size;
  // Names a process killed during an earlier set-up left in /dev/shm (shm_owner.h).
  static std::once_flag swept;
  std::call_once(swept, [rank] { shm::sweepStaleNames(rank); });
  if (rank == 0) store.set(kNonceKey, randomHex(8));
  const std::string token = "/smddp-" + store.get(kNonceKey) + "-host-" + std::to_string(rank);
  const int fd = shm_open(token.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    throwError(ErrorCode::kSystemError, "rank %d: cannot create the topology token %s in /dev/shm: %s", rank,
               token.c_str(), errnoString(errno).c_str());
  }
  // Only its name matters to the peers; the stamp lets a later sweep remove it if we are killed
  // before the set-up ends. A failed write (a full /dev/shm) leaves an empty token, still valid.
  const shm::OwnerStamp stamp = shm::OwnerStamp::mine();
  [[maybe_unused]] const ssize_t wrote = write(fd, &stamp, sizeof(stamp));
  close(fd);
  struct Unlink {
    std::string name;
    ~Unlink() { shm_unlink(name.c_str()); }
  } unlinkToken{token};

  // Round 1: who am I.
  const std::string myKey = env::hostId(), myBoot = bootId();
  store.set(infoKey(rank),
            myBoot + "\n" + myKey + "\n" + hostname() + "\n" + token + "\n" + cpuList(usableCpuIds()) + "\n" +
                netNamespace());
  std::vector<std::string> keys(size), tokens(size);
  int machineRanks = 0;
  std::set<int> machineCpus;
  t.bootIds.resize(size);
  t.netNamespaces.resize(size);
  t.hostnames.resize(size);
  const std::vector<std::string> records = store.multiGet(keysOf(size, infoKey));
  for (int r = 0; r < size; ++r) {
    const auto f = splitOn(records[r], '\n');
    if (f.size() != 6) throwError(ErrorCode::kRemoteError, "rank %d published a malformed topology record", r);
    t.bootIds[r] = f[0];
    keys[r] = f[1];
    t.hostnames[r] = f[2];
    tokens[r] = f[3];
    t.netNamespaces[r] = f[5];
    if (t.bootIds[r] == myBoot) {
      ++machineRanks;
      addCpuList(f[4], r, machineCpus);
    }
  }
  t.cpuShare = {machineRanks, static_cast<int>(machineCpus.size())};
  // Round 2: my host's leader is the lowest rank I can share memory with.
  int leader = rank;
  for (int r = 0; r < rank; ++r) {
    if (t.bootIds[r] == t.bootIds[rank] && keys[r] == myKey && tokenVisible(tokens[r])) {
      leader = r;
      break;
    }
  }
  store.set(leaderKey(rank), std::to_string(leader));
  std::vector<int> leaders(size);
  const std::vector<std::string> leaderRecords = store.multiGet(keysOf(size, leaderKey));
  for (int r = 0; r < size; ++r) leaders[r] = std::stoi(leaderRecords[r]);
  // Every rank has checked its peers' tokens by now (it published its leader after doing so).

  std::vector<int> hostOfLeader(size, -1);
  t.hostOf.assign(size, -1);
  t.localOf.assign(size, -1);
  for (int r = 0; r < size; ++r) {
    const int l = leaders[r];
    if (l < 0 || l > r || leaders[l] != l) {
      throwError(ErrorCode::kRemoteError, "inconsistent topology: rank %d names rank %d as its host leader", r, l);
    }
    if (hostOfLeader[l] < 0) {
      hostOfLeader[l] = static_cast<int>(t.members.size());
      t.members.emplace_back();
    }
    t.hostOf[r] = hostOfLeader[l];
    t.localOf[r] = static_cast<int>(t.members[t.hostOf[r]].size());
    t.members[t.hostOf[r]].push_back(r);
  }
  // Sharing memory must be an equivalence: every peer I can see belongs to my host.
  for (int r = 0; r < size; ++r) {
    if (r == rank || t.hostOf[r] == t.hostOf[rank]) continue;
    if (t.bootIds[r] == t.bootIds[rank] && keys[r] == myKey && tokenVisible(tokens[r])) {
      throwError(ErrorCode::kSystemError,
                 "rank %d shares /dev/shm with rank %d but not with the others of its host: cannot split the group "
                 "into hosts consistently",
                 rank, r);
    }
  }
  SMDDP_INFO(kInit,
             "rank %d/%d: %d host(s); this host (%s) has %d rank(s), local rank %d; the machine has %d of the "
             "group's ranks on %d CPU(s)",
             rank, size, t.hosts(), t.hostnames[rank].c_str(), t.localSize(), t.localRank(), t.cpuShare.ranks,
             t.cpuShare.cpus);
  return t;
}

}  // namespace smddp
