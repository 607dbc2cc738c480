// Collectives for groups that span several hosts: shared memory inside each host, the TCP mesh
// between hosts, every local rank driving the network at once with its share of the data.
//
//   allreduce:      reduce-scatter inside the host (local rank l gets the l-th range of the
//                   message, cut into S = max ranks per host segments, so hosts of different sizes
//                   still agree on segment boundaries) -> per segment, an allreduce among the
//                   segment's owners, one per host (mesh: reduce-scatter + all-gather in one hop
//                   each, streamed piece by piece through one exchange, or for small messages
//                   one-shot: every owner sends its segment whole to the others; or a ring) ->
//                   all-gather inside the host.
//   allgather:      rank g sends its block straight to one rank on every other host (the one
//                   whose local index matches g's, modulo that host's size) -> all-gather rounds
//                   inside each host.
//   reduce_scatter: reduce rounds inside the host (block g is reduced at the local rank matching
//                   g's local index) -> each partial goes straight to rank g in one streamed
//                   exchange, in pieces -> g reduces piece k of the hosts' partials as soon as
//                   the last of them is in, while later pieces still arrive.
//   broadcast:      the root sends to the first rank of every other host -> broadcast in hosts;
//                   with 3 hosts or more, a large message goes relayed: the root sends each of
//                   those ranks one segment, which it forwards to the others as it arrives.
//   barrier:        host barrier, then an all-to-all of empty messages among the hosts' first
//                   ranks, then host barrier.
//   all_to_all:     one hop: every block for a rank of another host straight to it over TCP
//                   (its header carries the size, which the receiver checks), then the blocks
//                   between ranks of one host through shared memory; it needs every pair of
//                   ranks on different hosts connected (alltoallPeers), which the group's first
//                   all_to_all does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "algo/collectives.h"
#include "transport/tcp_mesh.h"
#include "transport/topology.h"

namespace smddp::algo {

enum class NetAlgo { kMesh, kNaive, kRing };
NetAlgo netAlgoFromName(const std::string& name);  // a value of SMDDP_NET_ALGO
const char* netAlgoName(NetAlgo algo);

struct HierContext {
  const Topology* topo = nullptr;
  OpContext local;  // this host's shared-memory domain; local.rank / local.size are host-local
  net::TcpMesh* mesh = nullptr;
  NetAlgo algo = NetAlgo::kMesh;
  std::vector<uint8_t>* scratch = nullptr;  // reused receive buffer, grown on demand
  size_t bufferBytes = 16u << 20;           // at most this much of `scratch` per piece (reductions)
  size_t oneShotBytes = 0;                  // SMDDP_NET_ONESHOT_BYTES
  net::Schedule schedule() const { return algo == NetAlgo::kNaive ? net::Schedule::kNaive : net::Schedule::kMesh; }
  // The tag of the op's network step `step`: its sequence number and the caller's collective.
  net::Tag tag(uint32_t step) const { return {net::makeTag(local.seq, step), local.signature, local.shape}; }
  uint8_t* scratchBytes(size_t n);
};

// The ranks this rank exchanges data with over TCP (symmetric across ranks): those of every
// collective but all_to_all, connected when the group is made ...
std::vector<int> hierarchicalPeers(const Topology& topo);
// ... and those of all_to_all: every rank of the other hosts.
std::vector<int> alltoallPeers(const Topology& topo);

void hierAllreduce(HierContext& ctx, const AllreduceOptions& opts);  // root >= 0: a reduce
void hierBroadcast(HierContext& ctx, const BroadcastOptions& opts);
void hierAllgather(HierContext& ctx, const AllgatherOptions& opts);  // root must be -1
void hierGather(HierContext& ctx, const AllgatherOptions& opts);     // root >= 0
void hierScatter(HierContext& ctx, const ScatterOptions& opts);
void hierReduceScatter(HierContext& ctx, const ReduceScatterOptions& opts);
void hierAlltoall(HierContext& ctx, const AlltoallOptions& opts, const std::vector<int>& remote);  // alltoallPeers()
void hierBarrier(HierContext& ctx);

}  // namespace smddp::algo
