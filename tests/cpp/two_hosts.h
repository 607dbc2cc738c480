// A group of two ranks, each its own "host", for the tests of the inter-host transports (both
// on this machine, so loopback is allowed).
#pragma once

#include "transport/topology.h"

namespace smddp::test {

inline Topology twoHosts(int rank) {
  Topology t = Topology::singleHost(rank, 2);
  t.hostOf = {0, 1};
  t.localOf = {0, 0};
  t.members = {{0}, {1}};
  return t;
}

}  // namespace smddp::test
