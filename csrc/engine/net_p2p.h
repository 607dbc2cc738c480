// Point-to-point send/recv between ranks on different hosts, over TCP, on a thread of its own
// (like the shared-memory P2pEngine, so a send waiting for its receiver never blocks the group's
// collectives); submit() also moves what it can at once on the caller's thread when the engine's
// thread is not making a pass, so a send the socket takes whole does not wait for that thread to
// wake, and a caller blocked in a wait makes the passes itself (driveUntil()), so that the
// message it waits for wakes it directly rather than the engine's thread, which then wakes it.
// Each rank listens from the start; a pair connects at its first message, the lower
// rank dialling, the higher accepting, both sides non-blocking inside one poll() loop, so no
// order of first messages can deadlock. A connection opens with the group's secret, the two
// ranks and its lane (wire::Hello), as the collectives' mesh does, and a pair holds as many
// connections ("lanes", SMDDP_NET_SOCKETS_PER_PEER) as the mesh: large messages are striped over
// them alike (wire::stripeOf).
//
// Messages meet their receives by sender and tag (p2p_matching.h, as the shared-memory engine
// does); each lane that carries a part of a message starts it with a 32-byte header (tag, the
// whole message's bytes, op and shape words of 0), lane 0's picks the receive, and a size that differs
// from the receive's is an error, never a truncation. A message is read only once a receive
// waits (for it, or for another tag: then it is read aside), so TCP's flow control holds back a
// sender that runs ahead (while a recv from any source waits, the next header on lane 0 of every
// idle pair is read, so that the recv can be matched; a rank that may be its sender is dialled if
// it waits to be called).
//
// A rank that gives up on a peer for a reason of its own (a timeout, a mismatched message, its
// group shut down) ends each of that pair's connections that is between two messages with a
// farewell (wire::farewellFrame), as the collectives' mesh does: the peer's next receive from it,
// or a send that finds the connection closed, reports that reason instead of a bare "closed".
#pragma once

#include <poll.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/store.h"
#include "engine/p2p_engine.h"
#include "transport/netif.h"
#include "transport/topology.h"

namespace smddp::engine {

class NetP2p : public P2pDriver {
 public:
  // Collective over the group (a group that spans hosts): listens on `addrs` (one per interface),
  // publishes them and reads those of the ranks on other hosts. `lanes`: connections per pair, the
  // same on every rank; lane k joins the two ranks' k-th interfaces (net::laneSocket). `linger`:
  // how long a driver polls its sockets before it sleeps in poll().
  NetP2p(Store& store, const Topology& topo, const std::vector<net::LocalAddress>& addrs, int lanes,
         std::chrono::microseconds linger, std::string name);
  // The keys the constructor sets for `rank`, which its peers wait for
  // (BootstrapStore::publishFailure).
  static std::vector<std::string> keysOwedBy(int rank);
  ~NetP2p() override;  // shutdown()

  // `op.peer`: a rank on another host, or -1 for a receive from any of them (see
  // P2pOp::sharedAnySource). `done` runs on whichever thread moves the op.
  void submit(P2pOp op);
  // Polls the sockets and makes the passes on the calling thread until `done()` holds (the
  // engine's thread goes on meanwhile; both serialise on the state). One thread drives at a
  // time: another returns at once, to wait for the first or the engine's thread to finish its op.
  void driveUntil(const std::function<bool()>& done) override;
  // Fails every pending and future op promptly. Idempotent.
  void abort();
  // abort(), waits for a driver to leave, joins the thread, ends the connections (with a
  // farewell where they are between messages) and closes every socket. Idempotent; afterwards
  // driveUntil() returns at once (a Work may still hold the engine).
  void shutdown();
  int connections() const { return connections_.load(); }  // open lanes, all peers
  // Before the first op: where stalled ops are posted and peers looked up (StallBoard).
  void setStallBoard(StallBoard board) { board_ = std::move(board); }

 private:
  struct Lane;
  struct Peer;
  struct Incoming;  // an accepted connection that has not introduced itself yet
  struct Completion {
    P2pOp op;
    std::exception_ptr error;
    int source;
  };
  // What one poll() watches: its poller's bell (wakeFd_ or driverBellFd_), the listeners,
  // connections still introducing themselves, then lanes (polled[i]: the peer and lane of
  // fds[incomingAt + incoming + i]), and the fdGeneration_ it was built at.
  struct PollSet {
    std::vector<pollfd> fds;
    size_t incomingAt = 0;
    std::vector<std::pair<Peer*, size_t>> polled;
    uint64_t generation = 0;
  };
  void loop();
  // One pass under the lock (intake, matching, progress) and the poll set for the poller whose
  // bell is `bellFd` (the engine's thread or the driver); true if ops are pending.
  bool passBeforePoll(PollSet& ps, int bellFd);
  // What poll() returned (`polled`), then deadlines, under the lock; completions after it.
  void passAfterPoll(const PollSet& ps, int polled);
  void intake();
  void progressReady();  // sends and receives of every connected peer, as far as the sockets take them
  void buildPollSet(PollSet& ps, int bellFd) const;  // bellFd: the poller's own eventfd, first
  void processPolled(const PollSet& ps);  // what poll() found, if the set is not stale
  void complete(P2pOp op, std::exception_ptr error, int source);  // done() once the lock is released
  void runCompletions(bool byDriver = false);  // rings the driver's bell unless it ran them
  void dial(Peer& p);
  // accept() on `listenFd` failed for want of descriptors or memory (errno `err`): the connection
  // is taken on the reserve descriptor and refused (refuseOutOfDescriptors), or else
  // cannotAccept.
  void turnAway(int listenFd, int err);
  void refuseOutOfDescriptors(Incoming& in, bool introduced);
  void cannotAccept(int err);
  std::string outOfDescriptors(int err) const;
  // Closes an accepted connection not (or no longer) wanted; gives the reserve back if it was on it.
  void dropIncoming(Incoming& in);
  void connectLane(Peer& p, Lane& l, short revents);
  void introduce(Incoming& in);
  bool progressSends(Peer& p);
  // Before `op`, a message to p, begins: whether p has said farewell or closed a connection, so
  // that the send fails (p failed) rather than completing into a socket whose reader is gone.
  bool peerLeft(Peer& p, const P2pOp& op);
  bool progressRecvs(Peer& p);
  bool serve(Peer& p);  // waiting receives that an unexpected message of p's fits
  ssize_t recvSome(Peer& p, Lane& l, void* at, size_t want, const P2pOp* op);
  bool matchAnySource();
  // The ops waiting on p; `nameOps`: each error starts with what the op was (describeOp).
  void failQueued(Peer& p, ErrorCode code, const std::string& why, bool nameOps = false);
  // And the connection; `farewell`: this rank gives up on p for that reason, and tells it.
  void failPeer(Peer& p, ErrorCode code, const std::string& why, const std::string& farewell = {});
  // Connecting to p failed: the ops that called for the connection fail, each named.
  void failDial(Peer& p, ErrorCode code, const std::string& why);
  // The reason p gave on lane l, if it said farewell there: a farewell header just read, or one
  // waiting unread at a message boundary.
  std::optional<std::string> farewellOn(Lane& l);
  void peerGaveUp(Peer& p, const std::string& what, const std::string& reason);
  void failAll();  // after shutdown() or abort(): every op, each named
  // A lower rank that ops wait on to call this one (at its first message to or receive from it)
  // may have exited or ended its group before it did: no call would come, and the ops would wait
  // out the group's timeout (gloo, which connects every pair at set-up, sees the connection close
  // at once). Its listener tells: a connect is refused once its process or its group has ended,
  // while a slow or stopped rank's kernel still accepts one (closed at once; introduce() drops
  // it quietly). A refusal fails p's ops.
  void probeSilentPeer(Peer& p, std::chrono::steady_clock::time_point now);
  void closeProbe(Peer& p);
  // Why `op`, waiting on p, timed out: where it is the message under way, how far it got.
  std::string timeoutReason(const Peer& p, const P2pOp& op) const;
  void checkDeadlines();  // and probeSilentPeer()
  bool anyPending() const;

  Topology topo_;
  int rank_;
  int lanes_;
  std::chrono::microseconds linger_;
  std::string secret_;
  std::string name_;
  std::vector<net::LocalAddress> addrs_;  // this rank's, one per interface
  std::vector<int> listenFds_;  // one per address
  // A descriptor held back (/dev/null) for accepting one connection when the process has none
  // left, to tell its dialler so (turnAway); lent meanwhile. Under stateMutex_ after the ctor.
  int reserveFd_ = -1;
  bool reserveLent_ = false;
  int wakeFd_ = -1;  // eventfd: submissions and abort
  int driverBellFd_ = -1;  // eventfd: a driver's op was completed by another thread, or abort
  std::mutex driveMutex_;  // held by the one driver
  bool shutDown_ = false;  // under driveMutex_
  std::atomic<bool> driving_{false};
  std::once_flag shutdownOnce_;

  std::mutex mutex_;
  std::deque<P2pOp> submitted_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> aborted_{false};
  std::atomic<int> connections_{0};

  // Touched by the thread, and by submit() on the caller's thread when the thread is not making a
  // pass; the thread's poll() runs without the lock.
  std::mutex stateMutex_;
  StallBoard board_;  // under stateMutex_
  // Counts changes to the set of sockets (dialled, closed, accepted, introduced) and passes over
  // poll() results: a poll whose set was built at an older count has stale results, ignored.
  uint64_t fdGeneration_ = 0;
  std::chrono::steady_clock::time_point lastDeadlineCheck_{};  // under stateMutex_
  std::vector<Completion> completions_;
  std::vector<std::unique_ptr<Peer>> peers_;  // by rank; null for ranks of this host
  std::vector<std::unique_ptr<Incoming>> incoming_;
  std::deque<P2pOp> anyRecvs_;  // receives from any source, in issue order
  std::thread thread_;
};

}  // namespace smddp::engine
