// Which ranks of a group share a host, i.e. can reach each other through shared memory.
//
// A hostname is not enough: containers and network namespaces on one machine share a kernel but
// maybe not /dev/shm, or a hostname but not a kernel. So each rank creates a token segment in its
// /dev/shm and publishes its boot id; a peer is on this rank's host when it has the same boot id
// (and the same SMDDP_HOST_ID) and its token is visible here. SMDDP_HOST_ID can only split hosts,
// never join ranks that cannot share memory: it lets tests run the inter-host path on one machine.
#pragma once

#include <string>
#include <vector>

#include "core/spin.h"
#include "core/store.h"

namespace smddp {

struct Topology {
  int rank = 0;
  int size = 1;
  std::vector<int> hostOf;                // rank -> host index; hosts are numbered by their lowest rank
  std::vector<int> localOf;               // rank -> index among the ranks of its host
  std::vector<std::vector<int>> members;  // host -> its ranks, ascending
  std::vector<std::string> bootIds;       // rank -> kernel boot id (same machine <=> same boot id)
  std::vector<std::string> netNamespaces;  // rank -> its network namespace (the /proc/self/ns/net link)
  std::vector<std::string> hostnames;     // rank -> hostname, for messages
  // This rank's machine: an emulated cluster's "hosts" (network namespaces, SMDDP_HOST_ID) share
  // one machine's cores, and a rank that spins as if it had a core to itself starves the others.
  CpuShare cpuShare;

  int hosts() const { return static_cast<int>(members.size()); }
  int host() const { return hostOf[rank]; }
  int localRank() const { return localOf[rank]; }
  int localSize() const { return static_cast<int>(members[host()].size()); }
  int maxLocalSize() const;
  // Whether rank a's loopback interface reaches rank b: one kernel and one network namespace
  // (containers and namespace "hosts" of one machine share a boot id, not a loopback).
  bool sharesLoopback(int a, int b) const;
  // "hostname (host 2)" for error messages.
  std::string describeHost(int host) const;

  // Collective over the group (three rounds through `store`).
  static Topology discover(Store& store, int rank, int size);
  // The keys discover() sets for `rank`, which its peers wait for (BootstrapStore::publishFailure).
  static std::vector<std::string> keysOwedBy(int rank);
  // All ranks on one host, for groups of one and for callers that know it.
  static Topology singleHost(int rank, int size);
};

}  // namespace smddp
