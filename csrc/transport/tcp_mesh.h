// The inter-host transport: one TCP connection per pair of ranks that exchange data across
// hosts, driven by a poll() loop on the calling (progress) thread, no thread of its own.
//
// Bootstrap (collective over the group, through the store): every rank listens on the addresses
// chosen by netif (one per interface), publishes them, connects to its peers of higher rank and
// accepts those of lower rank. connect() adds peers later, for ops that need more of them; the
// listeners stay open. A connection must open with the group's secret (random, from the store)
// and the ranks it links, so a stray or stale client is refused, never mistaken for a peer.
//
// Data: exchange() moves a set of sends and receives to completion. Each message carries a
// 24-byte header (tag, bytes, op) and lands straight in its destination buffer; a header that
// does not match what the receiver expects is an error naming both sides (mismatched
// collectives).
// With SMDDP_NET_SOCKETS_PER_PEER > 1, or several interfaces, two ranks hold several connections
// ("lanes": at least one per interface) and large messages are striped over them
// (wire::stripeOf), each lane paced by its own window. Lane k joins the two ranks' k-th
// interfaces (counted modulo each rank's number of them), so a host's NICs share the traffic.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/store.h"
#include "transport/netif.h"
#include "transport/shm_domain.h"
#include "transport/topology.h"
#include "transport/wire.h"

namespace smddp::net {

// How exchange() hands data to the sockets of several peers.
enum class Schedule {
  // Rate-controlled: chunks go out round-robin over the peers, starting from a shifted peer
  // (rank r first serves the peer after it), and a peer's socket never holds more than its
  // window of unsent and unacknowledged bytes. The window starts at two chunks and doubles each
  // time the peer has acknowledged a whole window, so every peer is fed as fast as it absorbs
  // and a peer that stops reading holds at most one window of this rank's data.
  kMesh,
  // Everything handed to the sockets as fast as they take it, peers in rank order.
  kNaive,
};

class TcpMesh {
 public:
  // Collective over the group. `addrs`: where this rank listens, one address per interface
  // (chooseLocalAddresses()). `peers`: the ranks this rank exchanges with (the relation must be
  // symmetric across ranks).
  static std::unique_ptr<TcpMesh> create(Store& store, const Topology& topo, const std::vector<LocalAddress>& addrs,
                                         const std::vector<int>& peers, std::chrono::milliseconds timeout);
  // The keys create() sets for `rank`, which its peers wait for (BootstrapStore::publishFailure).
  static std::vector<std::string> keysOwedBy(int rank);
  // Those of them read after the set-up too (connect() reads addresses at a group's first
  // all_to_all), which must stay in the store as long as the group lives.
  static std::vector<std::string> keysReadLater(int rank);
  ~TcpMesh();

  // Connects to those of `peers` not connected yet; they call it too, at the same point of their
  // ops (the relation must again be symmetric). Ends with kRemoteError as soon as a peer turns
  // out to be gone (refused, or an existing connection closed), kAborted or kTimeout.
  void connect(Store& store, const std::vector<int>& peers, const shm::WaitContext& wait);
  bool connected(int rank) const;
  int connections() const;  // TCP connections held, every lane of every peer (any thread may ask)
  int lanes() const { return lanes_; }  // connections per peer, the same on every rank

  const std::vector<LocalAddress>& addresses() const { return addrs_; }

  // Messages to one peer leave in list order and arrive in list order. `tag` identifies the op,
  // its step and the collective; both sides must use the same. `onReceived(i)`, when given, runs
  // on this thread as soon as recvs[i] has fully arrived; it may open the `ready` gates of later
  // messages, which is how one exchange carries data computed from what it received (a streamed
  // reduction).
  // Throws kRemoteError when a peer closes its connection, kTimeout at the deadline, kAborted
  // when the wait context is aborted.
  void exchange(Tag tag, const std::vector<Send>& sends, const std::vector<Recv>& recvs,
                const shm::WaitContext& wait, Schedule schedule,
                const std::function<void(size_t)>& onReceived = {});

  // Closes every connection and the listeners. With a `farewell` (why this rank gives up the
  // group), first sends it on each connection that is between messages, so that peers report
  // the reason, not just a closed connection. Interrupts nothing by itself; the next poll tick
  // sees the abort flag of the wait context.
  void closeAll(std::string_view farewell = {});

 private:
  struct Conn;
  explicit TcpMesh(const Topology& topo);
  std::vector<std::unique_ptr<Conn>>& lanesTo(int rank);
  // What a peer that gave up the group said as it left, if it did (see closeAll).
  static std::optional<std::string> farewellOf(const Conn& c);
  [[noreturn]] void peerGaveUp(const Conn& c, const char* what, const std::string& why);
  // peerGaveUp where the peer said farewell, else a closed or failed connection (`err`, 0: closed).
  [[noreturn]] void peerFailed(const Conn& c, const char* what, int err);
  // For a connection whose next receive is held (so at a message boundary), once its peer has
  // closed: whether the socket holds every byte the exchange still expects on it. `farewell` gets
  // the reason of a peer that gave up, found where one of those messages would start or behind
  // the last.
  static bool holdsRest(const Conn& c, std::optional<std::string>& farewell);
  // What an exchange that timed out still waits for, peer by peer.
  std::string stallReport(const std::vector<Conn*>& active) const;

  Topology topo_;
  std::vector<LocalAddress> addrs_;
  std::vector<std::vector<std::unique_ptr<Conn>>> conns_;  // [rank][lane]; empty where no connection
  // The non-null entries of conns_, for connections(): diagnostics may ask from any thread while
  // connect() fills conns_ on the thread running an op.
  std::atomic<int> connCount_{0};
  int lanes_ = 1;  // connections per peer (SMDDP_NET_SOCKETS_PER_PEER, rank 0's value)
  std::vector<int> listenFds_;  // one per address
  // Connections from peers below that arrived before this rank's connect() wanted them (the peer
  // reached a later round, e.g. all_to_all's, while this rank waited in an earlier one for a slower
  // rank): accepted and introduced, their 'K' deferred to the round that wants them.
  struct EarlyDial {
    int fd, from, lane;
  };
  std::vector<EarlyDial> early_;
  std::string secret_;
  size_t chunkBytes_;
};

}  // namespace smddp::net
