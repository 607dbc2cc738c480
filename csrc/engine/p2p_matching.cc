#include "engine/p2p_matching.h"

#include <algorithm>
#include <new>

#include "core/env.h"
#include "core/error.h"
#include "core/log.h"

namespace smddp::engine {
namespace {

// The oldest unexpected message with `tag`, if it is whole (a younger one must not overtake it).
UnexpectedQueue::iterator wholeWithTag(UnexpectedQueue& q, int tag) {
  const auto it = std::find_if(q.begin(), q.end(), [&](const auto& m) { return m->tag == tag; });
  return it != q.end() && (*it)->whole ? it : q.end();
}

// Moves the oldest receive of `anyRecvs` with `tag` that the other engine has not taken to the
// front of `recvs`, for `peer`, if it was posted before `before` (the oldest named receive's
// postSeq); drops those the other engine took on the way.
bool passToAnySource(std::deque<P2pOp>& anyRecvs, std::deque<P2pOp>& recvs, int peer, int tag, uint64_t before) {
  for (size_t k = 0; k < anyRecvs.size();) {
    if (anyRecvs[k].tag != tag && !anyRecvs[k].takenElsewhere()) {
      ++k;
      continue;
    }
    if (anyRecvs[k].tag == tag && !anyRecvs[k].takenElsewhere() && anyRecvs[k].postSeq >= before) return false;
    P2pOp op = std::move(anyRecvs[k]);
    anyRecvs.erase(anyRecvs.begin() + static_cast<std::ptrdiff_t>(k));
    if (op.tag != tag || !op.claim()) continue;  // the other engine's now: drop this copy
    op.peer = peer;
    recvs.push_front(std::move(op));
    return true;
  }
  return false;
}

std::atomic<uint64_t> gPostSeq{0};

}  // namespace

uint64_t nextPostSeq() { return gPostSeq.fetch_add(1, std::memory_order_relaxed) + 1; }

bool hasUnexpected(const UnexpectedQueue& q, int tag) {
  return std::any_of(q.begin(), q.end(), [&](const auto& m) { return m->tag == tag; });
}

bool anySourceFirst(const std::deque<P2pOp>& anyRecvs, const P2pOp& named, int tag) {
  // The one passToAnySource would weigh against `named`: `anyRecvs` is in posting order.
  const auto oldest = std::find_if(anyRecvs.begin(), anyRecvs.end(),
                                   [&](const P2pOp& op) { return op.tag == tag && !op.takenElsewhere(); });
  return oldest != anyRecvs.end() && oldest->postSeq < named.postSeq;
}

void abandonAnySource(std::deque<P2pOp>& anyRecvs, const std::string& gone,
                      const std::function<void(P2pOp, const std::string&)>& fail) {
  for (P2pOp& op : anyRecvs) {
    if (op.takenElsewhere()) continue;
    std::string other;  // the other engine's reason, where it gave up first
    if (SharedAnySource* shared = op.sharedAnySource.get()) {
      std::lock_guard<std::mutex> lock(shared->mutex);
      if (shared->hopeful.fetch_sub(1) > 1) {
        shared->gone = gone;
        continue;
      }
      other = "; " + shared->gone;
    }
    const std::string why = describeOp(op, -1) + ": no rank can send it any more: " + gone + other;
    fail(std::move(op), why);
  }
  anyRecvs.clear();
}

std::string describeOp(const P2pOp& op, int peerRank) {
  const std::string what = " (tag " + std::to_string(op.tag) + ", " + std::to_string(op.bytes) + " bytes)";
  if (op.into) return "a message from rank " + std::to_string(peerRank) + what + " that no recv has taken yet";
  return std::string(op.isSend ? "send to" : "recv from") +
         (op.peer >= 0 ? " rank " + std::to_string(peerRank) : std::string(" any rank")) + what;
}

bool StallBoard::due(std::chrono::steady_clock::time_point now) {
  if (!post || interval.count() <= 0 || now - lastLook_ < interval / 4) return false;
  lastLook_ = now;
  return true;
}

void StallBoard::watch(const P2pOp* oldest, int peerRank, std::chrono::steady_clock::time_point now) {
  if (!post || interval.count() <= 0 || oldest == nullptr) return;
  if (now - oldest->posted < interval || now - lastPost_ < interval) return;
  lastPost_ = now;
  post(describeOp(*oldest, peerRank));
}

std::string sizeMismatchMessage(int peer, int tag, size_t bytes, uint64_t sentBytes) {
  return formatString("recv from rank %d (tag %d, %zu bytes): the message from rank %d with that tag has %llu bytes; "
                      "a recv must take a message of exactly its size",
                      peer, tag, bytes, peer, static_cast<unsigned long long>(sentBytes));
}

std::string unexpectedSummary(const UnexpectedQueue& q, int peerRank) {
  if (q.empty()) return "";
  std::string s = "; messages from rank " + std::to_string(peerRank) + " that no recv has taken:";
  for (const auto& m : q) {
    s += (m.get() == q.front().get() ? " tag " : ", tag ") + std::to_string(m->tag) + " (" +
         std::to_string(m->data.size()) + " bytes)";
  }
  return s;
}

std::string recvTimeoutReason(const UnexpectedQueue& q, int peerRank) {
  const std::string who = "rank " + std::to_string(peerRank);
  const std::string reason =
      q.heldBack ? formatString("%s's next message (tag %d, %llu bytes) waits with its sender ahead of it: no recv "
                                "takes it, and %s",
                                who.c_str(), q.heldBack->tag, static_cast<unsigned long long>(q.heldBack->bytes),
                                q.heldBack->why.c_str())
                 : "no matching send was posted";
  return reason + unexpectedSummary(q, peerRank);
}

bool routeMessage(std::deque<P2pOp>& recvs, std::deque<P2pOp>& anyRecvs, UnexpectedQueue& unexpected, int peer,
                  int peerRank, int tag, uint64_t bytes) {
  unexpected.heldBack.reset();  // routed anew: set again below if it still cannot be set aside
  if (!hasUnexpected(unexpected, tag)) {
    const auto named = std::find_if(recvs.begin(), recvs.end(), [&](const P2pOp& op) { return op.tag == tag; });
    // MPI's rule: the first posted of the receives that match takes the message, however long the
    // named one has waited; only when it posted first does it keep the message from any-source ones.
    const uint64_t namedSeq = named != recvs.end() ? named->postSeq : UINT64_MAX;
    if (passToAnySource(anyRecvs, recvs, peer, tag, namedSeq)) return true;  // `named` untouched otherwise
    if (named != recvs.end()) {
      if (named == recvs.begin()) return true;
      P2pOp op = std::move(*named);
      recvs.erase(named);
      recvs.push_front(std::move(op));
      return true;
    }
  }
  const auto waits = [](const P2pOp& op) { return !op.takenElsewhere(); };
  const bool anyWaits = !recvs.empty() || std::any_of(anyRecvs.begin(), anyRecvs.end(), waits);
  if (!anyWaits) return false;
  // A message that cannot be held aside waits with its sender; the receives waiting for other
  // tags from that sender wait behind it (and time out unless the program takes it first).
  auto holdBack = [&](const std::string& why) {
    unexpected.heldBack = HeldBack{tag, bytes, why};
    if (!unexpected.warnedHeld) {
      unexpected.warnedHeld = true;
      SMDDP_WARN(kNet, "point-to-point: a %llu-byte message from rank %d (tag %d) arrived while receives wait for "
                 "other tags, but %s: it waits with its sender until a recv takes it, and receives from that rank "
                 "wait behind it (warned once per sender)",
                 static_cast<unsigned long long>(bytes), peerRank, tag, why.c_str());
    }
    return false;
  };
  uint64_t held = 0;
  for (const auto& m : unexpected) held += m->data.size();
  const auto limit = static_cast<uint64_t>(env::p2pUnexpectedBytes());
  if (held + bytes > limit) {
    return holdBack(formatString("setting it aside would take the messages held aside from that rank (%llu bytes) "
                                 "past SMDDP_P2P_UNEXPECTED_BYTES (%llu)",
                                 static_cast<unsigned long long>(held), static_cast<unsigned long long>(limit)));
  }
  auto m = std::make_unique<Unexpected>();
  m->tag = tag;
  try {
    m->data.resize(bytes);
  } catch (const std::bad_alloc&) {
    return holdBack("there is no memory to set it aside");
  }
  P2pOp own;
  own.peer = peer;
  own.tag = tag;
  own.buffer = m->data.data();
  own.bytes = bytes;
  own.deadline = std::chrono::steady_clock::time_point::max();
  own.into = m.get();
  unexpected.push_back(std::move(m));
  recvs.push_front(std::move(own));
  return true;
}

bool serveUnexpected(std::deque<P2pOp>& recvs, std::deque<P2pOp>& anyRecvs, UnexpectedQueue& unexpected, int peer,
                     int peerRank, const std::function<void(P2pOp, std::exception_ptr, int)>& complete,
                     std::string* sizeError) {
  bool served = false;
  // Takes `m` into `op` (which leaves its queue), or fails `op` if the sizes differ.
  auto take = [&](P2pOp op, UnexpectedQueue::iterator m) {
    std::exception_ptr error;
    if ((*m)->data.size() != op.bytes) {
      *sizeError = sizeMismatchMessage(peerRank, op.tag, op.bytes, (*m)->data.size());
      error = std::make_exception_ptr(Error(ErrorCode::kInvalidUsage, *sizeError));
    } else if (op.bytes > 0) {
      std::copy((*m)->data.begin(), (*m)->data.end(), op.buffer);
    }
    unexpected.erase(m);
    op.peer = peer;
    complete(std::move(op), std::move(error), peer);
    served = true;
  };
  std::erase_if(anyRecvs, [](const P2pOp& op) { return op.takenElsewhere(); });  // the other engine's: drop
  // Each round serves the first posted receive that a whole message fits, named or from any
  // source. That is what going through the receives once in posting order would give: taking a
  // tag's oldest message only uncovers its next one for the receives with that tag posted later.
  while (sizeError->empty() && !unexpected.empty()) {
    std::deque<P2pOp>* from = nullptr;
    std::deque<P2pOp>::iterator first;
    UnexpectedQueue::iterator message;
    auto consider = [&](std::deque<P2pOp>& q) {
      for (auto it = q.begin(); it != q.end(); ++it) {
        if (it->started || it->into || (from != nullptr && it->postSeq >= first->postSeq)) continue;
        const auto m = wholeWithTag(unexpected, it->tag);
        if (m == unexpected.end()) continue;
        from = &q;
        first = it;
        message = m;
      }
    };
    consider(recvs);
    consider(anyRecvs);
    if (from == nullptr) break;
    P2pOp op = std::move(*first);
    from->erase(first);
    if (op.claim()) take(std::move(op), message);  // else the other engine took it meanwhile: drop this copy
  }
  return served;
}

}  // namespace smddp::engine
