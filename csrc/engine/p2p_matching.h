// How point-to-point messages meet their receives, shared by the shared-memory engine (host-mates)
// and the TCP one (other hosts), so that both match alike, as MPI and gloo do: among the waiting
// receives that match a message (from its sender, or from any source, with its tag) the first
// posted takes it (P2pOp::postSeq), whether the message arrives before or after they were posted;
// messages of one sender and tag are taken in the order sent, while messages with different tags
// may be taken in any order.
//
// Each engine reads a pair's messages in the order sent (one stream per pair). A message that no
// waiting receive wants while receives for other tags wait (MPI's "unexpected" message) is read
// into memory of its own, so that the stream moves on to the message they want, and kept until a
// receive for its tag comes, up to SMDDP_P2P_UNEXPECTED_BYTES per sender. With no receive waiting
// at all, or past that bound, a message stays with its sender (its mailbox, or the socket, which
// holds the sender back): a sender that runs ahead of its receiver costs no memory.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace smddp::engine {

// A message read before any receive wanted it.
struct Unexpected {
  int tag = 0;
  std::vector<uint8_t> data;
  bool whole = false;  // every byte has arrived
};
// The sender's next message, which could not be read aside and waits with its sender.
struct HeldBack {
  int tag = 0;
  uint64_t bytes = 0;
  std::string why;
};

// One per sender, in arrival order.
struct UnexpectedQueue : std::deque<std::unique_ptr<Unexpected>> {
  std::optional<HeldBack> heldBack;  // set by routeMessage, cleared once that message is taken
  bool warnedHeld = false;           // warned once per sender
};

// A receive from any source in a group that spans hosts, posted to both engines (host-mates
// through shared memory, other hosts through TCP): whichever first matches a message, times the
// receive out or fails it takes it, and the other engine drops its copy unfinished.
struct SharedAnySource {
  std::atomic<bool> taken{false};
  // Copies that may still match a message. An engine whose every sender is gone drops its copy
  // and leaves its reason here; the last such fails the receive with both reasons.
  std::atomic<int> hopeful{2};
  std::mutex mutex;
  std::string gone;
};

struct P2pOp {
  bool isSend = false;
  int peer = -1;  // -1: receive from any source
  int tag = 0;
  uint8_t* buffer = nullptr;
  size_t bytes = 0;
  std::chrono::steady_clock::time_point deadline;
  std::chrono::steady_clock::time_point posted;  // when the caller issued it
  // Posting order, which decides between a named receive and one from any source that both match
  // a message: set by the engine's submit() from nextPostSeq(), under the lock that queues it, so
  // that it follows the order of the engine's queues. A clock would not do: two posts may read the
  // same time, and the caller stamps `posted` before it takes that lock.
  uint64_t postSeq = 0;
  // Called once on the p2p thread: the error (or null) and the rank the message came from.
  std::function<void(std::exception_ptr, int)> done;
  std::shared_ptr<SharedAnySource> sharedAnySource;  // set where the receive went to both engines
  // Set on the engine's own receive of an unexpected message (routeMessage): it reads into `into`'s
  // memory, has no deadline and nobody waits on it.
  Unexpected* into = nullptr;
  // smddp's own message (monitored_barrier's, whose tags are its own per call): no deadline
  // (never expires, so never breaks the pair) and never posted as where this rank waits.
  bool background = false;

  // A send its receiver may read where it is (single copy): large enough, and in memory other
  // processes may read (a driver's pinned memory may not be). Set by the shared-memory engine's
  // submit(), on the caller's thread.
  bool readableInPlace = false;

  size_t offset = 0;
  bool started = false;  // first chunk sent / matched
  uint64_t readUntil = 0;  // shared-memory send handed over by address: done once the peer consumed this many chunks

  // True if this engine may finish the op: always, except for a shared receive the other engine
  // already took. After it, this engine owns the op outright.
  bool claim() {
    if (!sharedAnySource) return true;
    const bool won = !sharedAnySource->taken.exchange(true);
    sharedAnySource.reset();
    return won;
  }
  // The other engine has taken this shared receive: drop it without calling done.
  bool takenElsewhere() const { return sharedAnySource && sharedAnySource->taken.load(); }
  void finish(std::exception_ptr error, int source) {
    if (claim() && done) done(std::move(error), source);
  }
};

// No rank that `anyRecvs`' engine hears from can send it a message any more (`gone` says why, as
// "rank 1 exited, rank 2 shut down ..."): each receive still waiting there is passed to `fail`
// with the whole reason, unless the other engine's copy of it may still match a message (this
// copy is dropped then, and `gone` left for that engine to tell if it comes to fail it too).
void abandonAnySource(std::deque<P2pOp>& anyRecvs, const std::string& gone,
                      const std::function<void(P2pOp, const std::string&)>& fail);

// The next posting sequence number (from 1), from one counter for the whole process, so that the
// numbers of both engines' receives compare (a receive from any source may go to both,
// P2pOp::sharedAnySource).
uint64_t nextPostSeq();

// "send to rank 3 (tag 0, 16 bytes)", "recv from any rank (...)", or for the engine's own receive
// "a message from rank 3 (...) that no recv has taken yet"; `peerRank`: op.peer as a group rank.
std::string describeOp(const P2pOp& op, int peerRank);

// Why an op fails after its group's shutdown() or abort() (after describeOp's text).
inline constexpr const char* kShutDown = "the process group has been shut down or aborted";

// Why a receive cannot take the message from `peer` with its tag: that message has another size.
std::string sizeMismatchMessage(int peer, int tag, size_t bytes, uint64_t sentBytes);

// "; messages from rank 3 that no recv has taken: tag 5 (16 bytes), ...", or "" if none: what a
// receive that timed out adds, since a tag mixed up is the usual cause.
std::string unexpectedSummary(const UnexpectedQueue& q, int peerRank);

// The next message from `peer` (its queue of named receives `recvs`) has `tag` and `bytes`, and the
// front of `recvs`, if any, has not started; puts first in `recvs` the receive that takes it: of
// the oldest named one with its tag and the oldest receive from any source with its tag, the one
// posted first (an any-source one is moved from `anyRecvs`, op.peer set), else, if any receive
// waits for another tag, the engine's own receive into a new entry of `unexpected`. A message
// whose tag an older unexpected one has goes behind it, into `unexpected`, so that one sender's
// messages of one tag are taken in order. Returns whether the front of `recvs` takes the message
// now; false if no receive waits at all, or the message cannot be held aside (it would take what
// `unexpected` holds past SMDDP_P2P_UNEXPECTED_BYTES, or there is no memory): it then waits with
// its sender. `peerRank`: `peer` as a group rank.
// Moving a named receive to the front erases it from the middle of `recvs`, which invalidates
// every reference into `recvs`: a caller holding one (e.g. to the old front) must not use it after.
bool routeMessage(std::deque<P2pOp>& recvs, std::deque<P2pOp>& anyRecvs, UnexpectedQueue& unexpected, int peer,
                  int peerRank, int tag, uint64_t bytes);

// Why a receive from `peerRank` timed out: no matching send was posted, or the sender's next
// message waits with its sender ahead of it (q.heldBack); then unexpectedSummary(q, peerRank).
std::string recvTimeoutReason(const UnexpectedQueue& q, int peerRank);

// Whether `q` holds a message with `tag` (a message with that tag that comes now goes behind it).
bool hasUnexpected(const UnexpectedQueue& q, int tag);

// Whether a receive of `anyRecvs` with `tag` (one the other engine has not taken) was posted
// before `named`: then a message with `tag` that `named` could take is routeMessage's to route,
// not `named`'s to read.
bool anySourceFirst(const std::deque<P2pOp>& anyRecvs, const P2pOp& named, int tag);

// Where point-to-point waits stand, in both directions: an engine posts its oldest op once that has
// waited `interval` (and again every interval while it waits), for the timeout messages of the
// peers it waits for; and an op of its own that times out says where its peer stands. The backend
// keeps both in the group's store (algo::DesyncProbe); without hooks, or at interval 0, nothing.
struct StallBoard {
  std::chrono::milliseconds interval{0};
  std::function<void(const std::string& waitsIn)> post;
  std::function<std::string(int peerRank)> whereIs;  // "; where rank 1 stands ...", or ""

  // Whether a deadline check should look for its oldest op now: a quarter interval after the
  // last look, so an engine busy with many ops does not scan them on every pass.
  bool due(std::chrono::steady_clock::time_point now);
  // With the engine's oldest pending op (null: none) and its peer as a group rank: posts it once
  // it has waited `interval`, and again each interval. Store errors are the hooks' own to
  // swallow: a wait never fails for a post.
  void watch(const P2pOp* oldest, int peerRank, std::chrono::steady_clock::time_point now);
  std::string where(int peerRank) const { return whereIs && peerRank >= 0 ? whereIs(peerRank) : ""; }

 private:
  std::chrono::steady_clock::time_point lastLook_{};
  std::chrono::steady_clock::time_point lastPost_{};
};

// Gives the receives of `recvs` (named, from `peer`) that have not started and those of `anyRecvs`,
// in the order they were posted, the oldest unexpected message of `peer` with their tag, once that
// one is whole: `complete(op, error, peer)` gets each receive so served. A message whose size
// differs from its receive's fails the receive and stops there: `sizeError` then says why, and the
// caller treats the pair as out of step. Returns whether any receive was served.
bool serveUnexpected(std::deque<P2pOp>& recvs, std::deque<P2pOp>& anyRecvs, UnexpectedQueue& unexpected, int peer,
                     int peerRank, const std::function<void(P2pOp, std::exception_ptr, int)>& complete,
                     std::string* sizeError);

}  // namespace smddp::engine
