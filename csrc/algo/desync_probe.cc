#include "algo/desync_probe.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <utility>

#include "core/error.h"
#include "core/log.h"
#include "core/types.h"

namespace smddp::algo {
namespace {

std::string keyOf(int rank) { return "smddp/desync/at/" + std::to_string(rank); }
std::string p2pKeyOf(int rank) { return "smddp/desync/p2p/" + std::to_string(rank); }

// Wall-clock milliseconds: a post's age is read on another host (clocks kept in step by NTP are
// close enough for ages counted in probe intervals, seconds).
long long wallMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// "<op number> <collective> <posted at, wall ms>", under keyOf(rank) once the rank has waited an
// interval in a collective; no key: it has not. Peers look for a key before they read it (a read
// of an absent one would wait), and the keys stay in the store with the group's other lasting
// keys (algo/group_keys.h).
std::string position(uint64_t seq, uint64_t signature) {
  return std::to_string(seq) + " " + std::to_string(signature) + " " + std::to_string(wallMs());
}

// A post is fresh while its rank may still be waiting there: a stalled rank re-posts every
// interval; allow two and some slack for a busy store.
bool fresh(long long postedMs, std::chrono::milliseconds interval) {
  return wallMs() - postedMs <= 2 * interval.count() + 1000;
}

// "rank 1 waits in allreduce #2 (float32, sum)", "... in recv from rank 0 (tag 3, 16 bytes)", or
// "... has not waited in any op of this group (busy elsewhere: ...)", from its latest posts;
// `mySeq`: this rank's op number, 0 outside a collective. Throws what the store throws.
std::string describeRank(Store& store, int p, uint64_t mySeq, std::chrono::milliseconds interval) {
  unsigned long long seq = 0, signature = 0;
  long long postedMs = 0;
  const int fields = store.check(keyOf(p))
                         ? std::sscanf(store.get(keyOf(p)).c_str(), "%llu %llu %lld", &seq, &signature, &postedMs)
                         : 0;
  std::string out = "rank " + std::to_string(p);
  if (fields == 3 && seq != 0 && fresh(postedMs, interval)) {
    out += " waits in " + OpSignature::unpack(signature).describe(seq);
    if (mySeq != 0 && seq != mySeq) out += " (this rank is at #" + std::to_string(mySeq) + ")";
    return out;
  }
  if (store.check(p2pKeyOf(p))) {
    const std::string post = store.get(p2pKeyOf(p));
    const size_t space = post.find(' ');
    if (space != std::string::npos && fresh(std::atoll(post.c_str()), interval)) {
      return out + " waits in " + post.substr(space + 1) + " (point-to-point)";
    }
  }
  out += fields < 3 || seq == 0 ? std::string(" has not waited in any collective of this group")
                                : " last waited in " + OpSignature::unpack(signature).describe(seq) + " " +
                                      std::to_string((wallMs() - postedMs) / 1000) +
                                      " s ago and is not waiting in a collective of this group now";
  // A rank posts only once it has waited an interval: one that began waiting here later than
  // that before this look is not busy elsewhere, and nothing tells the two apart.
  return out + ", nor in a point-to-point op (busy elsewhere: computing, another group's op, or blocked outside " +
         "smddp; or waiting in this group for less than SMDDP_DESYNC_CHECK_MS, " + std::to_string(interval.count()) +
         " ms, after which a waiting rank posts where it waits)";
}

// What a store that has not answered for kPatience says of `what`.
std::string silence(const std::string& what) {
  return "; " + what + " is not known: the group's store did not answer within " +
         std::to_string(DesyncProbe::kPatience.count()) +
         " s (the process that hosts it, rank 0's for init_method tcp:// and env://, may be stopped or frozen)";
}

// The answer of `request` if the store gives it within kPatience; otherwise silence(what), or
// the store's failure (the process hosting it may have exited: a reader is told why it sees no
// position rather than nothing).
std::string ask(StoreErrands& errands, const std::string& what, StoreErrands::Request request) {
  try {
    std::shared_ptr<StoreErrands::Errand> errand = errands.start(std::move(request));
    std::optional<std::string> answer = errand ? errand->wait(DesyncProbe::kPatience) : std::nullopt;
    if (answer) return *answer;
  } catch (const std::exception& e) {
    const std::string why = e.what();  // its first line: torch's store errors go on with a stack trace
    return "; " + what + " is not known: the group's store failed (" + why.substr(0, why.find('\n')) + ")";
  }
  return silence(what);
}

}  // namespace

void DesyncProbe::postP2p(StoreErrands& errands, int rank, const std::string& what) {
  // Not waited for: a post that fails or never lands leaves the peers' timeout messages vaguer.
  errands.start([rank, value = std::to_string(wallMs()) + " " + what](Store& store) {
    try {
      store.set(p2pKeyOf(rank), value);
    } catch (const Error& e) {
      SMDDP_INFO(kColl, "rank %d: could not post where point-to-point waits: %s", rank, e.what());
    }
    return std::string();
  });
}

std::string DesyncProbe::whereIs(StoreErrands& errands, int peer, std::chrono::milliseconds interval) {
  return ask(errands, "where rank " + std::to_string(peer) + " stands", [peer, interval](Store& store) {
    return "; where rank " + std::to_string(peer) + " stands (its latest posts in the group's store): " +
           describeRank(store, peer, 0, interval);
  });
}

DesyncProbe::DesyncProbe(StoreErrands& errands, int rank, uint64_t seq, uint64_t signature,
                         std::chrono::milliseconds interval)
    : errands_(errands), rank_(rank), seq_(seq), signature_(signature), interval_(interval) {}

void DesyncProbe::stalled(std::chrono::steady_clock::time_point since,
                          const std::function<std::vector<int>()>& waitedFor) {
  if (off_) return;
  const auto now = std::chrono::steady_clock::now();
  if (look_ != nullptr) {
    if (!look_->done()) return;  // the wait goes on meanwhile, to its own deadline
    std::string found;
    try {
      found = look_->wait(std::chrono::milliseconds(0)).value();
    } catch (const std::exception& e) {
      // The wait goes on as without the probe: its own deadline and peers decide how it ends.
      SMDDP_INFO(kColl, "rank %d: desync check off for op #%llu: %s", rank_, static_cast<unsigned long long>(seq_),
                 e.what());
      off_ = true;
      return;
    }
    look_.reset();
    unsigned long long seq = 0, signature = 0;
    int peer = -1;
    if (std::sscanf(found.c_str(), "%d %llu %llu", &peer, &seq, &signature) == 3) {
      throwError(ErrorCode::kInvalidUsage,
                 "collectives do not match across ranks: this rank runs %s, but rank %d runs %s (found after %lld "
                 "ms without progress, in the group's store). Every rank must issue the same collectives in the same "
                 "order with matching sizes and dtypes",
                 OpSignature::unpack(signature_).describe(seq_).c_str(), peer,
                 OpSignature::unpack(signature).describe(seq).c_str(),
                 static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count()));
    }
  }
  if (now - since < interval_ || now - lastLook_ < interval_) return;
  lastLook_ = now;
  waited_ = waitedFor();
  if (waited_.empty()) return;
  // At most kReadsPerLook peers per look, the next ones at the next look: a store serves every
  // stalled rank of a large group.
  constexpr size_t kReadsPerLook = 8;
  std::vector<int> peers;
  for (size_t i = 0; i < std::min(waited_.size(), kReadsPerLook); ++i) {
    peers.push_back(waited_[(nextRead_ + i) % waited_.size()]);
  }
  nextRead_ += peers.size();
  // "<peer> <its op number> <its collective>" for the first peer at this op number with another
  // collective; "" if none. Null when earlier looks of this group are still out (the store has
  // stopped answering): none this time.
  look_ = errands_.start([rank = rank_, seq = seq_, signature = signature_, peers](Store& store) {
    store.set(keyOf(rank), position(seq, signature));
    for (int p : peers) {
      unsigned long long theirSeq = 0, theirSignature = 0;
      if (store.check(keyOf(p)) &&
          std::sscanf(store.get(keyOf(p)).c_str(), "%llu %llu", &theirSeq, &theirSignature) == 2 &&
          theirSeq == seq && theirSignature != signature) {
        return std::to_string(p) + " " + std::to_string(theirSeq) + " " + std::to_string(theirSignature);
      }
    }
    return std::string();
  });
}

std::string DesyncProbe::report() {
  if (off_ || waited_.empty()) return {};
  const std::string what = "where the ranks it waited for stand";
  // The store has sat on the last look for as long as a new request would be given.
  if (look_ != nullptr && !look_->done() && std::chrono::steady_clock::now() - lastLook_ >= kPatience) {
    return silence(what);
  }
  return ask(errands_, what,
             [waited = waited_, seq = seq_, interval = interval_](Store& store) {
               std::string out = "; where the ranks it waited for stand (their latest posts in the group's store): ";
               constexpr size_t kMaxReported = 8;
               for (size_t i = 0; i < waited.size() && i < kMaxReported; ++i) {
                 out += (i ? "; " : "") + describeRank(store, waited[i], seq, interval);
               }
               if (waited.size() > kMaxReported) {
                 out += "; and " + std::to_string(waited.size() - kMaxReported) + " more";
               }
               return out;
             });
}

}  // namespace smddp::algo
