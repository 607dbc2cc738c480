// Point-to-point send/recv over the shared-memory mailboxes, on a thread of its own so that a
// send waiting for its receiver never blocks the group's collectives, and an exchange (both
// ranks send, then both receive) cannot deadlock: every pending op progresses as far as it can
// on each pass. Messages meet their receives by sender and tag as in MPI and gloo
// (p2p_matching.h), and a receive checks the size of the message it takes: a mismatch is an
// error, never a silent truncation.
//
// The thread is there for what nobody waits on. A caller moves what it can at once (submit()
// makes a pass on its own thread when no other is under way), and a caller blocked in a wait
// runs the passes itself (driveUntil(); the thread steps aside meanwhile): a blocking send/recv
// then costs one wake-up per message, the receiver's, instead of three hand-overs between
// threads (caller -> p2p thread -> peer's p2p thread -> peer's caller).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/spin.h"
#include "engine/p2p_matching.h"
#include "transport/shm_domain.h"

namespace smddp::engine {

// What a blocking wait on a point-to-point op runs (SmddpWork::wait): the passes of the engine
// that moves the op, on the waiting thread, until `done()` holds, the engine is aborted or shut
// down; the waiter is then the thread its peer's message wakes.
class P2pDriver {
 public:
  virtual ~P2pDriver() = default;
  virtual void driveUntil(const std::function<bool()>& done) = 0;
};

class P2pEngine : public P2pDriver {
 public:
  // `singleCopyBytes`: messages of at least this size to a rank that reads its peers' memory are
  // handed over by address (singleCopyBytesFor()).
  P2pEngine(shm::Domain* domain, std::chrono::microseconds spin, size_t singleCopyBytes, std::string name);
  // SMDDP_P2P_SINGLE_COPY_BYTES, or its default for how the machine's cores are shared.
  static size_t singleCopyBytesFor(const CpuShare& machine);
  size_t singleCopyBytes() const { return singleCopyBytes_; }
  ~P2pEngine();  // shutdown()

  // Queues `op` and, unless another thread is making a pass, moves what it can of it at once
  // (at most the two chunks a mailbox holds): `done` may run before submit() returns.
  void submit(P2pOp op);
  // Makes the passes on the calling thread until `done()` holds (checked after each pass), the
  // engine is aborted, or after shutdown(): what a blocking wait calls, so that the waiter is
  // the one its peer's doorbell wakes. Ops' deadlines and dead peers are checked as on the thread.
  void driveUntil(const std::function<bool()>& done) override;
  // Fails every pending and future op promptly. Idempotent.
  void abort();
  // abort(), then joins the thread and waits for every driveUntil() to return; afterwards the
  // engine touches its domain no more (a Work may still hold it and call driveUntil).
  void shutdown();
  // Before the first op: where stalled ops are posted and peers looked up (StallBoard).
  void setStallBoard(StallBoard board) { board_ = std::move(board); }

  // A message handed over by address leaves the sender's buffer in the receiver's hands until it
  // is read, while the sender's op may fail first (timeout, abort, a broken pair) and give the
  // buffer back to its caller. The claim word in its chunk's header line, in shared memory,
  // settles who has the buffer: the sender writes kOffered; the receiver swaps kOffered for
  // kReading before it reads (and kReading for kReadFailed if the read fails); a sender whose op
  // fails swaps kOffered for kRevoked, and the receiver, finding that, fails its recv instead of
  // reading memory its caller may have reused. If the receiver won, the sender lets the read end
  // before it gives the buffer back. Public for the tests, which play the receiver with it.
  enum Claim : uint32_t { kCopied = 0, kOffered = 1, kReading = 2, kRevoked = 3, kReadFailed = 4 };
  static std::atomic_ref<uint32_t> claimOf(uint8_t* chunk);

 private:
  struct Completion {
    P2pOp op;
    std::exception_ptr error;
    int source;
  };
  struct Pass {
    bool ran = false;        // false: another thread was making one (pass(true) only)
    bool moved = false;      // anything moved: pass again at once
    bool pending = false;    // ops wait: sleep on the doorbell, check deadlines
    bool streaming = false;  // a message is half through: its next chunk is imminent, poll for it
  };
  void loop();
  // One pass under progressMutex_ (blocking, or skipped when another thread holds it and `tryOnly`),
  // then the completions it produced, outside the lock (a `done` may submit again).
  Pass pass(bool tryOnly = false);
  // Waits for the doorbell to move on from `bell` (polling first if `poll` or streaming, then
  // asleep for at most a tick); then checks deadlines and peers if ops wait.
  void await(uint32_t bell, const Pass& p, bool poll);
  bool progress();  // one pass over every pending op; true if anything moved
  bool progressSend(P2pOp& op);
  bool progressRecv(P2pOp& op, int src);
  // Whether the front of recvs_[src] may read src's next chunk: it is reading that message
  // already, or the next message has come and the receive that takes it is first now
  // (p2p_matching.h's routeMessage).
  bool routeNext(int src);
  bool serve(int src);  // waiting receives that an unexpected message of src's fits
  bool matchAnySource();
  // The stream with `peer` is out of step or gone (`reason`; `kind`: "error" or "failure"):
  // fails everything queued with it, now and later, and tells the peer, which then treats this
  // rank as closed for the pair (checkDeadlinesAndPeers; a farewell across hosts).
  void breakPair(int peer, const std::string& reason, const char* kind = "error");
  void complete(P2pOp op, std::exception_ptr error, int source);  // done() after the pass
  // Runs `done`'s callbacks; rings the doorbell if another thread drives (its op may be among them).
  void finish(std::vector<Completion>& done);
  // Withdraws `op`, a send handed over by address, unless its receiver has claimed it (claimOf()),
  // and says where it stands: its buffer is the caller's again (never handed over, or withdrawn by
  // this call or before), the message has been read, or it is being read.
  enum class Handover { kFree, kDelivered, kReading };
  Handover withdraw(P2pOp& op);
  // withdraw(), and if the receiver is reading, waits (bounded) for the read to end: before an
  // error hands a send's buffer back.
  void release(P2pOp& op);
  // `nameOps`: each op's error starts with what it was (describeOp), where `why` does not say.
  void fail(std::deque<P2pOp>& q, const std::string& why, bool nameOps = false);
  void failEverything();  // after shutdown() or abort()
  void checkDeadlinesAndPeers();
  // Why no peer can send this rank a message any more ("rank 1 exited, rank 2 ..."), or "" while
  // one still may: what ends a receive from any source before its timeout.
  std::string sendersGone() const;
  bool unreadFrom(int peer) const;  // chunks `peer` published to this rank that it has not consumed
  void handOver();  // wakes the thread to take over pending ops (it steps aside again while a driver runs)
  void shutdownNow();

  shm::Domain* domain_;
  int rank_;
  int size_;
  std::chrono::microseconds spin_;
  size_t singleCopyBytes_;  // SMDDP_P2P_SINGLE_COPY_BYTES (SIZE_MAX: never)
  std::string name_;

  std::mutex mutex_;
  std::condition_variable wake_;  // the thread's sleep while nothing is pending or a caller drives
  bool kicked_ = false;           // ops were handed over to the thread, or it must wake
  std::deque<P2pOp> incoming_;    // submitted, not yet sorted into the per-peer queues
  std::atomic<bool> stop_{false};
  std::atomic<bool> aborted_{false};
  std::atomic<int> drivers_{0};  // threads inside driveUntil()
  std::once_flag shutdownOnce_;

  // The engine's state, touched by whichever thread makes the pass.
  std::mutex progressMutex_;
  std::vector<Completion> completions_;
  std::vector<std::deque<P2pOp>> sends_;  // per destination, in issue order
  std::vector<std::deque<P2pOp>> recvs_;  // per source, in issue order
  std::deque<P2pOp> anyRecvs_;
  std::vector<UnexpectedQueue> unexpected_;  // per source
  StallBoard board_;                         // under progressMutex_
  std::vector<uint64_t> sendNext_;  // next chunk index of the stream to each peer
  std::vector<uint64_t> recvNext_;  // next chunk index of the stream from each peer
  std::vector<std::string> broken_;  // per peer: why the stream can no longer be trusted
  std::thread thread_;
};

}  // namespace smddp::engine
