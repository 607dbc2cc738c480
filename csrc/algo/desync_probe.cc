#include "algo/desync_probe.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

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

// "<op number> <collective> <posted at, wall ms>"; op number 0: no op yet.
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
  const int fields = std::sscanf(store.get(keyOf(p)).c_str(), "%llu %llu %lld", &seq, &signature, &postedMs);
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
  return out + ", nor in a point-to-point op (busy elsewhere: computing, another group's op, or blocked outside smddp)";
}

}  // namespace

void DesyncProbe::postP2p(Store& store, int rank, const std::string& what) {
  store.set(p2pKeyOf(rank), std::to_string(wallMs()) + " " + what);
}

std::string DesyncProbe::whereIs(Store& store, int peer, std::chrono::milliseconds interval) {
  try {
    return "; where rank " + std::to_string(peer) + " stands (its latest posts in the group's store): " +
           describeRank(store, peer, 0, interval);
  } catch (const Error&) {
    return {};
  }
}

void DesyncProbe::announce(Store& store, int rank) { store.set(keyOf(rank), position(0, 0)); }

DesyncProbe::DesyncProbe(Store& store, int rank, uint64_t seq, uint64_t signature, std::chrono::milliseconds interval)
    : store_(store), rank_(rank), seq_(seq), signature_(signature), interval_(interval) {}

void DesyncProbe::stalled(std::chrono::steady_clock::time_point since,
                          const std::function<std::vector<int>()>& waitedFor) {
  const auto now = std::chrono::steady_clock::now();
  if (off_ || now - since < interval_ || now - lastLook_ < interval_) return;
  lastLook_ = now;
  waited_ = waitedFor();
  const std::vector<int>& peers = waited_;
  // At most kReadsPerLook peers per look, the next ones at the next look: a store serves every
  // stalled rank of a large group.
  constexpr size_t kReadsPerLook = 8;
  const size_t reads = std::min(peers.size(), kReadsPerLook);
  unsigned long long seq = 0, signature = 0;
  int peer = -1;
  try {
    store_.set(keyOf(rank_), position(seq_, signature_));
    for (size_t i = 0; i < reads && peer < 0; ++i) {
      const int p = peers[(nextRead_ + i) % peers.size()];
      if (std::sscanf(store_.get(keyOf(p)).c_str(), "%llu %llu", &seq, &signature) == 2 && seq == seq_ &&
          signature != signature_) {
        peer = p;
      }
    }
  } catch (const Error& e) {
    // The wait goes on as without the probe: its own deadline and peers decide how it ends.
    SMDDP_INFO(kColl, "rank %d: desync check off for op #%llu: %s", rank_, static_cast<unsigned long long>(seq_),
               e.what());
    off_ = true;
    return;
  }
  nextRead_ += reads;
  if (peer >= 0) {
    throwError(ErrorCode::kInvalidUsage,
               "collectives do not match across ranks: rank %d runs %s but this rank runs %s (found after %lld ms "
               "without progress, in the group's store). Every rank must issue the same collectives in the same order "
               "with matching sizes and dtypes",
               peer, OpSignature::unpack(signature).describe(seq).c_str(),
               OpSignature::unpack(signature_).describe(seq_).c_str(),
               static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(now - since).count()));
  }
}

std::string DesyncProbe::report() {
  if (off_ || waited_.empty()) return {};
  std::string out = "; where the ranks it waited for stand (their latest posts in the group's store): ";
  constexpr size_t kMaxReported = 8;
  try {
    for (size_t i = 0; i < waited_.size() && i < kMaxReported; ++i) {
      out += (i ? "; " : "") + describeRank(store_, waited_[i], seq_, interval_);
    }
  } catch (const Error&) {
    return {};
  }
  if (waited_.size() > kMaxReported) out += "; and " + std::to_string(waited_.size() - kMaxReported) + " more";
  return out;
}

}  // namespace smddp::algo
