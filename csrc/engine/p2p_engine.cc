#include "engine/p2p_engine.h"

#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <thread>

#include "core/env.h"
#include "core/error.h"
#include "core/interrupt.h"
#include "core/log.h"
#include "core/spin.h"

namespace smddp::engine {
namespace {

struct ChunkHeader {
  uint64_t messageBytes;
  int32_t tag;
  uint32_t chunkBytes;
  // Non-zero: the chunk carries no data, the receiver reads the whole message from this address
  // in the sender's memory (Domain::readFromPeer) and the sender's op is done once it has.
  uint64_t senderAddress;
};
constexpr size_t kHeader = 64;  // payload starts on its own cache line
// The claim word (P2pEngine::claimOf) follows the header in the same line.
constexpr size_t kClaimAt = sizeof(ChunkHeader);
static_assert(kClaimAt % std::atomic_ref<uint32_t>::required_alignment == 0 && kClaimAt + 4 <= kHeader);
static_assert(std::atomic_ref<uint32_t>::is_always_lock_free);  // shared between processes
// How long a failing send waits for a read under way to end. process_vm_readv copies GiBs per
// second, so this only ends the wait of a sender whose receiver is stopped (a debugger, SIGSTOP):
// abort and shutdown must not hang on it.
constexpr auto kReadBound = std::chrono::seconds(5);
constexpr size_t kPayload = shm::Domain::kP2pChunkBytes - kHeader;
constexpr auto kActiveTick = std::chrono::milliseconds(50);
constexpr auto kIdleTick = std::chrono::seconds(1);

// The engine the calling thread drives, if any (its own completions need not wake it).
thread_local const P2pEngine* tDriving = nullptr;

std::exception_ptr errorOf(ErrorCode code, const std::string& msg) {
  return std::make_exception_ptr(Error(code, msg));
}

}  // namespace

size_t P2pEngine::singleCopyBytesFor(const CpuShare& machine) {
  const int64_t v = env::p2pSingleCopyBytes();
  if (v == 0) return SIZE_MAX;
  if (v > 0) return static_cast<size_t>(v);
  // Through the mailboxes sender and receiver copy at once, each 64 KiB chunk still in cache when
  // the receiver takes it, and process_vm_readv pins the sender's pages one by one: with a core
  // per rank the mailboxes win (2 ranks on 2 cores, one message at a time: 2-5x from 256 KiB to
  // 16 MiB on 4 KiB pages; both directions at once: single copy 1.1-1.9x at 16-32 MiB only).
  // With fewer cores than ranks the second copy has no core of its own and reading in place wins
  // from 256 KiB (4 ranks on 2 cores: 1.5-2.7x on 4 KiB pages, up to 5x on huge pages).
  return machine.oversubscribed() ? (256u << 10) : SIZE_MAX;
}

std::atomic_ref<uint32_t> P2pEngine::claimOf(uint8_t* chunk) {
  return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(chunk + kClaimAt));
}

P2pEngine::P2pEngine(shm::Domain* domain, std::chrono::microseconds spin, size_t singleCopyBytes, std::string name)
    : domain_(domain),
      rank_(domain->rank()),
      size_(domain->size()),
      spin_(spin),
      singleCopyBytes_(singleCopyBytes),
      name_(std::move(name)),
      sends_(size_),
      recvs_(size_),
      unexpected_(size_),
      sendNext_(size_, 0),
      recvNext_(size_, 0),
      broken_(size_) {
  thread_ = std::thread([this] { loop(); });
}

P2pEngine::~P2pEngine() { shutdown(); }

void P2pEngine::abort() {
  aborted_.store(true);
  domain_->markClosed();  // host-mates' receives from this rank fail now, not at their timeout
  domain_->ringDoorbell(rank_);  // wakes a driver, or the thread asleep with ops pending
  std::lock_guard<std::mutex> lock(mutex_);
  kicked_ = true;
  wake_.notify_all();
}

void P2pEngine::shutdown() {
  std::call_once(shutdownOnce_, [this] { shutdownNow(); });
}

void P2pEngine::shutdownNow() {
  abort();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
    wake_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  // A driver sees aborted_ at its next pass (it entered before aborted_ was set, or it would not
  // have touched the domain at all) and fails what it waited for.
  while (drivers_.load() > 0) {
    domain_->ringDoorbell(rank_);
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // The thread stops at the stop flag without another pass, and may have seen it before the
  // abort: fail what is still queued here, or ops nobody drives would never finish (a future
  // waiting on one would hang). With aborted_ set a pass touches no shared memory, but for a send
  // handed over by address (release()): none is left after this pass, so none once we return.
  pass();
}

void P2pEngine::submit(P2pOp op) {
  if (aborted_.load()) {
    const std::string why = describeOp(op, op.peer >= 0 ? domain_->groupRank(op.peer) : -1) + ": " + kShutDown;
    op.finish(errorOf(ErrorCode::kAborted, why), op.peer);
    return;
  }
  if (op.isSend) {
    try {
      domain_->commitOutboxes();  // throws on the caller's thread if /dev/shm is full
    } catch (const Error& e) {
      // The receiver would wait for this message until its timeout, then blame this rank for
      // not sending: the pair gives up, with the cause, which its receives report at once.
      std::vector<Completion> done;
      {
        std::lock_guard<std::mutex> lock(progressMutex_);
        breakPair(op.peer, withoutRankPrefix(e.what()), "failure");
        done.swap(completions_);
      }
      finish(done);
      throw;
    }
    op.readableInPlace = op.bytes >= singleCopyBytes_ && domain_->readableByPeers(op.buffer, op.bytes);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    op.postSeq = nextPostSeq();
    incoming_.push_back(std::move(op));
  }
  // After an abort, shutdown()'s last pass may have come before this op was queued: this pass
  // must run then (it fails the op), not be left to a thread that is gone.
  const Pass p = pass(/*tryOnly=*/!aborted_.load());
  if (p.ran && !p.pending) return;
  // Another thread is making a pass (it reads the doorbell before each, so it will pass again),
  // or ops are left for the thread or a driver to finish.
  domain_->ringDoorbell(rank_);
  handOver();
}

void P2pEngine::handOver() {
  std::lock_guard<std::mutex> lock(mutex_);
  kicked_ = true;
  wake_.notify_all();
}

void P2pEngine::driveUntil(const std::function<bool()>& done) {
  drivers_.fetch_add(1);
  const P2pEngine* outer = tDriving;
  tDriving = this;
  Pass p;
  while (!aborted_.load()) {
    const uint32_t bell = domain_->doorbell();
    p = pass();
    if (done() || aborted_.load()) break;
    if (!p.moved) await(bell, p, /*poll=*/true);
  }
  // After an abort, one more pass fails what is pending (the thread may already be gone).
  if (aborted_.load()) p = pass();
  tDriving = outer;
  drivers_.fetch_sub(1);
  bool queued;  // submitted while this thread made the pass, after its intake
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queued = !incoming_.empty();
  }
  if (p.pending || queued) handOver();
}

void P2pEngine::complete(P2pOp op, std::exception_ptr error, int source) {
  completions_.push_back({std::move(op), std::move(error), source});
}

P2pEngine::Handover P2pEngine::withdraw(P2pOp& op) {
  if (!op.isSend || op.readUntil == 0) return Handover::kFree;
  const int d = op.peer;
  if (domain_->consumedFrom(d, rank_).load(std::memory_order_acquire) >= op.readUntil) return Handover::kDelivered;
  // Not consumed yet, so the chunk is still the one that offered the buffer: only this thread
  // writes a new chunk there, and only once the receiver has consumed this one.
  uint32_t seen = kOffered;
  if (claimOf(domain_->outbox(rank_, d, op.readUntil - 1))
          .compare_exchange_strong(seen, kRevoked, std::memory_order_acq_rel)) {
    return Handover::kFree;
  }
  return seen == kReading ? Handover::kReading : Handover::kFree;  // kRevoked before, or kReadFailed
}

void P2pEngine::release(P2pOp& op) {
  if (withdraw(op) != Handover::kReading) return;
  const int d = op.peer;
  const auto until = std::chrono::steady_clock::now() + kReadBound;
  while (domain_->consumedFrom(d, rank_).load(std::memory_order_acquire) < op.readUntil) {
    if (!domain_->peerAlive(d)) return;
    if (std::chrono::steady_clock::now() >= until) {
      SMDDP_WARN(kNet, "point-to-point: %s fails while rank %d still reads the message from its buffer after %lld s; "
                 "the buffer goes back to the caller, and rank %d may receive what the caller writes to it next",
                 describeOp(op, domain_->groupRank(d)).c_str(), domain_->groupRank(d),
                 static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(kReadBound).count()),
                 domain_->groupRank(d));
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void P2pEngine::fail(std::deque<P2pOp>& q, const std::string& why, bool nameOps) {
  // Only a queue's front send can have been handed over by address (sends go one at a time).
  if (!q.empty()) release(q.front());
  while (!q.empty()) {
    const int peer = q.front().peer;
    const std::string text =
        nameOps ? describeOp(q.front(), peer >= 0 ? domain_->groupRank(peer) : -1) + ": " + why : why;
    complete(std::move(q.front()), errorOf(ErrorCode::kAborted, text), peer);
    q.pop_front();
  }
}

void P2pEngine::failEverything() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fail(incoming_, kShutDown, true);
  }
  for (int p = 0; p < size_; ++p) {
    fail(sends_[p], kShutDown, true);
    fail(recvs_[p], kShutDown, true);
  }
  fail(anyRecvs_, kShutDown, true);
}

bool P2pEngine::progressSend(P2pOp& op) {
  const int d = op.peer;
  // A peer whose group has shut down, or that gave up on this pair, takes nothing more: the send
  // stays queued for checkDeadlinesAndPeers to fail, instead of completing into a slot no one reads.
  if (!op.started && (domain_->closed(d) || domain_->pairGaveUp(d, rank_))) return false;
  bool moved = false;
  while (!op.started || op.offset < op.bytes) {
    const uint64_t i = sendNext_[d];
    // Buffer i % 2 still holds chunk i - 2 until the receiver has consumed it.
    if (i >= 2 && domain_->consumedFrom(d, rank_).load(std::memory_order_acquire) < i - 1) break;
    uint8_t* chunk = domain_->outbox(rank_, d, i);
    if (!op.started && op.readableInPlace && domain_->readsPeers(d)) {
      // One copy instead of two: the receiver reads the message where it is.
      const ChunkHeader h{op.bytes, op.tag, 0, reinterpret_cast<uint64_t>(op.buffer)};
      std::memcpy(chunk, &h, sizeof(h));
      claimOf(chunk).store(kOffered, std::memory_order_relaxed);  // published by sentTo's release
      domain_->sentTo(rank_, d).store(i + 1, std::memory_order_release);
      domain_->ringDoorbell(d);
      sendNext_[d] = i + 1;
      op.offset = op.bytes;
      op.started = true;
      op.readUntil = i + 1;
      return true;
    }
    const size_t n = std::min(kPayload, op.bytes - op.offset);
    const ChunkHeader h{op.bytes, op.tag, static_cast<uint32_t>(n), 0};
    std::memcpy(chunk, &h, sizeof(h));
    claimOf(chunk).store(kCopied, std::memory_order_relaxed);  // no stale word from an earlier message here
    if (n > 0) std::memcpy(chunk + kHeader, op.buffer + op.offset, n);  // an empty message may have no buffer
    domain_->sentTo(rank_, d).store(i + 1, std::memory_order_release);
    domain_->ringDoorbell(d);
    sendNext_[d] = i + 1;
    op.offset += n;
    op.started = true;
    moved = true;
  }
  return moved;
}

bool P2pEngine::progressRecv(P2pOp& op, int s) {
  bool moved = false;
  while (!op.started || op.offset < op.bytes) {
    const uint64_t i = recvNext_[s];
    if (domain_->sentTo(s, rank_).load(std::memory_order_acquire) <= i) break;
    uint8_t* chunk = domain_->outbox(s, rank_, i);
    ChunkHeader h;
    std::memcpy(&h, chunk, sizeof(h));
    if (!op.started && h.messageBytes != op.bytes) {  // routeNext matched the tags
      throw Error(ErrorCode::kInvalidUsage, sizeMismatchMessage(domain_->groupRank(s), op.tag, op.bytes,
                                                                h.messageBytes));
    }
    if (h.senderAddress != 0) {
      const int who = domain_->groupRank(s);
      uint32_t seen = kOffered;
      if (!claimOf(chunk).compare_exchange_strong(seen, kReading, std::memory_order_acq_rel)) {
        // The sender's op failed before this read began, and its buffer is its caller's again.
        const std::string odd = seen == kRevoked ? "" : formatString(" (claim word %u)", seen);
        throw Error(ErrorCode::kRemoteError,
                    formatString("%s: rank %d withdrew its message (tag %d, %llu bytes) before this rank read it, "
                                 "because its send failed (it timed out, or its process group was aborted or shut "
                                 "down)%s",
                                 describeOp(op, who).c_str(), who, h.tag,
                                 static_cast<unsigned long long>(h.messageBytes), odd.c_str()));
      }
      const int err = domain_->readFromPeer(s, op.buffer, h.senderAddress, op.bytes);
      if (err != 0) {
        claimOf(chunk).store(kReadFailed, std::memory_order_release);  // the sender need not wait for it
        throw Error(err == ESRCH ? ErrorCode::kRemoteError : ErrorCode::kSystemError,
                    formatString("recv from rank %d (tag %d, %zu bytes): reading the message from rank %d's memory "
                                 "failed: %s%s",
                                 who, op.tag, op.bytes, who, strerror(err), err == ESRCH ? " (it exited)" : ""));
      }
      op.offset = op.bytes;
    } else {
      if (h.chunkBytes > 0) std::memcpy(op.buffer + op.offset, chunk + kHeader, h.chunkBytes);
      op.offset += h.chunkBytes;
    }
    op.started = true;
    domain_->consumedFrom(rank_, s).store(i + 1, std::memory_order_release);
    domain_->ringDoorbell(s);
    recvNext_[s] = i + 1;
    moved = true;
  }
  return moved;
}

bool P2pEngine::routeNext(int s) {
  if (!broken_[s].empty()) return false;
  std::deque<P2pOp>& q = recvs_[s];
  if (!q.empty() && (q.front().started || q.front().into)) return true;  // it is reading that message
  const uint64_t i = recvNext_[s];
  if (domain_->sentTo(s, rank_).load(std::memory_order_acquire) <= i) return false;
  ChunkHeader h;
  std::memcpy(&h, domain_->outbox(s, rank_, i), sizeof(h));
  if (!q.empty() && q.front().tag == h.tag && !hasUnexpected(unexpected_[s], h.tag) &&
      !anySourceFirst(anyRecvs_, q.front(), h.tag)) {
    unexpected_[s].heldBack.reset();
    return true;
  }
  return routeMessage(q, anyRecvs_, unexpected_[s], s, domain_->groupRank(s), h.tag, h.messageBytes);
}

bool P2pEngine::serve(int s) {
  if (unexpected_[s].empty()) return false;
  std::string sizeError;
  const bool served = serveUnexpected(
      recvs_[s], anyRecvs_, unexpected_[s], s, domain_->groupRank(s),
      [this](P2pOp op, std::exception_ptr error, int source) { complete(std::move(op), std::move(error), source); },
      &sizeError);
  if (!sizeError.empty()) breakPair(s, sizeError);
  return served;
}

void P2pEngine::breakPair(int peer, const std::string& reason, const char* kind) {
  const std::string why =
      std::string("an earlier point-to-point ") + kind + " with rank " + std::to_string(domain_->groupRank(peer)) +
      ": " + reason;
  broken_[peer] = why;
  fail(recvs_[peer], why);
  fail(sends_[peer], why);
  unexpected_[peer].clear();
  domain_->markPairGaveUp(peer, reason);
}

// A peer's next message when no named receive from it waits: to the oldest receive from any
// source with its tag, or read aside while any-source receives wait for other tags.
bool P2pEngine::matchAnySource() {
  while (!anyRecvs_.empty() && anyRecvs_.front().takenElsewhere()) anyRecvs_.pop_front();
  bool moved = false;
  for (int k = 1; k < size_ && !anyRecvs_.empty(); ++k) {
    const int s = (rank_ + k) % size_;
    if (recvs_[s].empty()) moved |= routeNext(s);
  }
  return moved;
}

bool P2pEngine::progress() {
  bool moved = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (!incoming_.empty()) {
      P2pOp op = std::move(incoming_.front());
      incoming_.pop_front();
      if (op.peer >= 0 && !broken_[op.peer].empty()) {
        const int peer = op.peer;
        const std::string why = describeOp(op, domain_->groupRank(peer)) + ": " + broken_[peer];
        complete(std::move(op), errorOf(ErrorCode::kAborted, why), peer);
        continue;
      }
      if (op.isSend) sends_[op.peer].push_back(std::move(op));
      else if (op.peer < 0) anyRecvs_.push_back(std::move(op));
      else recvs_[op.peer].push_back(std::move(op));
      moved = true;
    }
  }
  moved |= matchAnySource();
  for (int p = 0; p < size_; ++p) {
    while (!sends_[p].empty()) {
      P2pOp& op = sends_[p].front();
      moved |= progressSend(op);
      if (!op.started || op.offset < op.bytes) break;
      // A message handed over by address is done once the receiver has read it.
      if (op.readUntil > domain_->consumedFrom(p, rank_).load(std::memory_order_acquire)) break;
      complete(std::move(op), nullptr, rank_);
      sends_[p].pop_front();
      moved = true;
    }
    moved |= serve(p);
    while (!recvs_[p].empty()) {
      // Only a receive that routeNext put first for a message that has come reads it: checked
      // here, the tags could be those of a message that arrived since.
      if (!routeNext(p)) break;
      P2pOp& op = recvs_[p].front();
      try {
        if (!progressRecv(op, p)) break;
      } catch (const Error& e) {
        // The stream from p is out of step with what this rank expects: fail everything on it.
        complete(std::move(op), std::make_exception_ptr(e), p);
        recvs_[p].pop_front();
        breakPair(p, e.what());
        moved = true;
        break;
      }
      moved = true;
      if (op.offset < op.bytes) break;
      Unexpected* into = op.into;
      if (into == nullptr) complete(std::move(op), nullptr, p);
      recvs_[p].pop_front();
      if (into != nullptr) {
        into->whole = true;
        serve(p);
      }
    }
  }
  return moved;
}

void P2pEngine::checkDeadlinesAndPeers() {
  const auto now = std::chrono::steady_clock::now();
  // Fails the first op of `q` past its deadline (each of `q` may be: receives are taken out of
  // order by tag), or the first if `peer` has exited.
  auto expire = [&](std::deque<P2pOp>& q, int peer) {
    if (q.empty()) return;
    const bool dead = peer >= 0 && !domain_->peerAlive(peer);
    // The peer gave up on this pair (breakPair there: its reason, the more specific, is read
    // first), or its group shut down or aborted: a receive fails once it has taken every chunk the
    // peer published before (the pair's flag and closed are ordered after them), a send at once.
    std::string gaveUp;
    const bool closed = !dead && peer >= 0 &&
                        (domain_->pairGaveUp(peer, rank_, &gaveUp) || domain_->closed(peer)) &&
                        (q.front().isSend || !unreadFrom(peer));
    const auto late = [&](const P2pOp& op) { return now >= op.deadline; };
    const auto it = dead || closed ? q.begin() : std::find_if(q.begin(), q.end(), late);
    if (it == q.end()) return;
    // Failing any send fails the front one too (breakPair). If that one's receiver has claimed its
    // buffer, it is being read, which ends soon: the send completes then instead.
    if (!dead && q.front().isSend && withdraw(q.front()) != Handover::kFree) return;
    P2pOp op = std::move(*it);
    q.erase(it);
    const std::string who = peer >= 0 ? std::to_string(domain_->groupRank(peer)) : "";
    const std::string what = describeOp(op, peer >= 0 ? domain_->groupRank(peer) : -1);
    // Part of a message in: its send was posted, and stopped (its sender exited, gave up, stalls).
    std::string partly;
    if (!op.isSend && op.offset > 0) {
      partly = formatString(" after %zu of the message's %zu bytes had arrived", op.offset, op.bytes);
    }
    std::string why = what;
    if (dead) {
      why += ": rank " + who + " exited" + partly;
    } else if (closed && !gaveUp.empty()) {
      why += ": rank " + who + " gave up point-to-point with this rank: " + inTheWordsOf(domain_->groupRank(peer), gaveUp);
    } else if (closed) {
      why += ": rank " + who + " shut down or aborted the process group" + partly;
    } else if (op.isSend) {
      why += " timed out: no matching recv was posted";
    } else if (!partly.empty()) {
      why += " timed out: the message stopped arriving" + partly;
    } else {
      why += " timed out: " + (peer >= 0 ? recvTimeoutReason(unexpected_[peer], domain_->groupRank(peer))
                                         : std::string("no matching send was posted"));
    }
    for (int s = 0; !dead && peer < 0 && s < size_; ++s) {  // a receive from any source: every sender's
      why += unexpectedSummary(unexpected_[s], domain_->groupRank(s));
    }
    if (!dead && !closed && peer >= 0) why += board_.where(domain_->groupRank(peer));
    complete(std::move(op), errorOf(dead || closed ? ErrorCode::kRemoteError : ErrorCode::kTimeout, why), peer);
    // Part of a message may have moved: the stream can no longer be trusted.
    if (peer >= 0) breakPair(peer, why, "failure");
  };
  for (int p = 0; p < size_; ++p) {
    expire(sends_[p], p);
    expire(recvs_[p], p);
  }
  expire(anyRecvs_, -1);
  if (!anyRecvs_.empty()) {
    if (const std::string gone = sendersGone(); !gone.empty()) {
      abandonAnySource(anyRecvs_, gone, [&](P2pOp op, const std::string& why) {
        complete(std::move(op), errorOf(ErrorCode::kRemoteError, why), -1);
      });
    }
  }
  // The oldest op still waiting, for the peers' timeout messages.
  if (!board_.due(now)) return;
  const P2pOp* oldest = nullptr;
  int oldestPeer = -1;
  auto consider = [&](const std::deque<P2pOp>& q, int peer) {
    for (const P2pOp& op : q) {
      if (op.into == nullptr && !op.background && (oldest == nullptr || op.posted < oldest->posted)) {
        oldest = &op;
        oldestPeer = peer >= 0 ? domain_->groupRank(peer) : -1;
      }
    }
  };
  for (int p = 0; p < size_; ++p) {
    consider(sends_[p], p);
    consider(recvs_[p], p);
  }
  consider(anyRecvs_, -1);
  board_.watch(oldest, oldestPeer, now);
}

bool P2pEngine::unreadFrom(int peer) const {
  return domain_->sentTo(peer, rank_).load(std::memory_order_acquire) >
         domain_->consumedFrom(rank_, peer).load(std::memory_order_acquire);
}

std::string P2pEngine::sendersGone() const {
  std::string gone;
  for (int s = 0; s < size_; ++s) {
    if (s == rank_) continue;
    const auto who = [&] { return "rank " + std::to_string(domain_->groupRank(s)); };
    if (!broken_[s].empty()) {
      gone += (gone.empty() ? "" : ", ") + ("an earlier point-to-point failure with " + who());
      continue;
    }
    // Read before what the peer sent, which it publishes before either (as in expire()).
    const bool gaveUp = domain_->pairGaveUp(s, rank_);
    const bool closed = gaveUp || domain_->closed(s);
    if (!closed && domain_->peerAlive(s)) return "";  // most calls end here, at the first peer
    if (unreadFrom(s)) return "";                      // the next pass routes it
    gone += (gone.empty() ? "" : ", ") + who() +
            (gaveUp   ? " gave up point-to-point with this rank"
             : closed ? " shut down or aborted the process group"
                      : " exited");
  }
  return gone.empty() ? "the group has no other rank" : gone;
}

P2pEngine::Pass P2pEngine::pass(bool tryOnly) {
  Pass p;
  std::vector<Completion> done;
  {
    std::unique_lock<std::mutex> lock(progressMutex_, std::defer_lock);
    if (tryOnly) {
      if (!lock.try_lock()) return p;
    } else {
      lock.lock();
    }
    p.ran = true;
    if (aborted_.load()) {
      failEverything();
    } else {
      p.moved = progress();
      p.pending = !anyRecvs_.empty();
      for (int d = 0; d < size_; ++d) {
        p.pending |= !sends_[d].empty() || !recvs_[d].empty();
        // Only a message already under way is worth polling for: its next chunk comes as soon as
        // the peer's copy ends, where the next message comes when the peer's program sends it.
        p.streaming |= (!sends_[d].empty() && sends_[d].front().started) ||
                       (!recvs_[d].empty() && recvs_[d].front().started);
      }
    }
    done.swap(completions_);
  }
  finish(done);
  return p;
}

void P2pEngine::finish(std::vector<Completion>& done) {
  for (Completion& c : done) c.op.finish(std::move(c.error), c.source);
  // A caller may be asleep on the doorbell waiting for one of these ops: it must look again (not
  // after an abort: drivers leave then, and after shutdown() the domain may be gone).
  if (!done.empty() && !aborted_.load() && drivers_.load() > (tDriving == this ? 1 : 0)) domain_->ringDoorbell(rank_);
}

void P2pEngine::await(uint32_t bell, const Pass& p, bool poll) {
  if ((poll || p.streaming) && spinUntil(spin_, [&] { return domain_->doorbell() != bell; })) return;
  interrupt::watch();  // a SIGINT wakes the sleep: a waiter's done() looks (torch/work.cc)
  domain_->sleepOnDoorbell(bell, kActiveTick);
  if (!p.pending) return;
  std::vector<Completion> done;
  {
    std::lock_guard<std::mutex> lock(progressMutex_);
    checkDeadlinesAndPeers();
    done.swap(completions_);
  }
  finish(done);
}

void P2pEngine::loop() {
  pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
  while (!stop_.load()) {
    if (drivers_.load() > 0) {
      // A caller makes the passes; it hands over when it leaves with ops pending.
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait_for(lock, kActiveTick, [&] { return kicked_ || stop_.load(); });
      kicked_ = false;
      continue;
    }
    const uint32_t bell = domain_->doorbell();
    const Pass p = pass();
    if (p.moved) continue;
    if (!p.pending) {
      // Nothing to wait for from the peers: sleep until something is submitted or handed over.
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait_for(lock, kIdleTick, [&] { return kicked_ || !incoming_.empty() || stop_.load(); });
      kicked_ = false;
      continue;
    }
    await(bell, p, /*poll=*/false);
  }
}

}  // namespace smddp::engine
