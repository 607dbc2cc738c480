// Point-to-point send/recv over the shared-memory mailboxes, on a thread of its own so that a
// send waiting for its receiver never blocks the group's collectives, and an exchange (both
// ranks send, then both receive) cannot deadlock: every pending op progresses as far as it can
// on each pass. Messages between a pair of ranks are matched in order, and a receive checks the
// sender's tag and size: a mismatch is an error, never a silent truncation.
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

#include "transport/shm_domain.h"

namespace smddp::engine {

struct P2pOp {
  bool isSend = false;
  int peer = -1;  // -1: receive from any source
  int tag = 0;
  uint8_t* buffer = nullptr;
  size_t bytes = 0;
  std::chrono::steady_clock::time_point deadline;
  // Called once on the p2p thread: the error (or null) and the rank the message came from.
  std::function<void(std::exception_ptr, int)> done;
  // A receive from any source in a group that spans hosts is posted to both engines (host-mates
  // through shared memory, other hosts through TCP); whichever first matches a message, times the
  // receive out or fails it takes this flag, and the other engine drops its copy unfinished.
  std::shared_ptr<std::atomic<bool>> sharedAnySource;

  size_t offset = 0;
  bool started = false;  // first chunk sent / matched

  // True if this engine may finish the op: always, except for a shared receive the other engine
  // already took. After it, this engine owns the op outright.
  bool claim() {
    if (!sharedAnySource) return true;
    const bool won = !sharedAnySource->exchange(true);
    sharedAnySource.reset();
    return won;
  }
  // The other engine has taken this shared receive: drop it without calling done.
  bool takenElsewhere() const { return sharedAnySource && sharedAnySource->load(); }
  void finish(std::exception_ptr error, int source) {
    if (claim()) done(std::move(error), source);
  }
};

// Why a receive cannot take the next message from `peer` (both engines word it alike): that
// message has another tag or size than the receive expects.
std::string outOfStepMessage(int peer, int tag, size_t bytes, int64_t sentTag, uint64_t sentBytes);

class P2pEngine {
 public:
  P2pEngine(shm::Domain* domain, std::chrono::microseconds spin, std::string name);
  ~P2pEngine();  // fails what is pending, joins

  void submit(P2pOp op);
  // Fails every pending and future op promptly. Idempotent.
  void abort();

 private:
  void loop();
  bool progress();  // one pass over every pending op; true if anything moved
  bool progressSend(P2pOp& op);
  bool progressRecv(P2pOp& op, int src);
  bool matchAnySource();
  void fail(std::deque<P2pOp>& q, const std::string& why);
  void checkDeadlinesAndPeers();

  shm::Domain* domain_;
  int rank_;
  int size_;
  std::chrono::microseconds spin_;
  std::string name_;

  std::mutex mutex_;
  std::deque<P2pOp> incoming_;  // submitted, not yet sorted into the per-peer queues
  std::atomic<bool> stop_{false};
  std::atomic<bool> aborted_{false};

  // Owned by the p2p thread.
  std::vector<std::deque<P2pOp>> sends_;  // per destination, in issue order
  std::vector<std::deque<P2pOp>> recvs_;  // per source, in issue order
  std::deque<P2pOp> anyRecvs_;
  std::vector<uint64_t> sendNext_;  // next chunk index of the stream to each peer
  std::vector<uint64_t> recvNext_;  // next chunk index of the stream from each peer
  std::vector<std::string> broken_;  // per peer: why the stream can no longer be trusted
  std::thread thread_;
};

}  // namespace smddp::engine
