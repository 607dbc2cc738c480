#include "algo/way_policy.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/log.h"

namespace smddp::algo {

WayPolicy::Mode WayPolicy::parseMode(const char* name, const std::string& value) {
  if (value == "auto") return Mode::kAuto;
  if (value == "1") return Mode::kAlways;
  if (value == "0") return Mode::kNever;
  throwError(ErrorCode::kInvalidUsage, "%s=%s: expected auto, 1 or 0", name, value.c_str());
}

bool WayPolicy::startTrial(PerKind& k, bool way) {
  k.trialOps = kTrialOps;
  k.trialWay = way;
  k.trialBest = 0;
  return way;
}

WayPolicy::PerKind& WayPolicy::of(OpKind kind, size_t hostBytes) {
  const uint32_t sizeClass = hostBytes == 0 ? 0 : 64 - __builtin_clzll(hostBytes);
  return kinds_[static_cast<uint32_t>(kind) << 8 | sizeClass];
}

bool WayPolicy::choose(OpKind kind, size_t hostBytes) {
  if (mode_ != Mode::kAuto) return mode_ == Mode::kAlways;
  PerKind& k = of(kind, hostBytes);
  if (k.largeOps++ == 0) return false;  // the warm-up op (record() skips it)
  if (k.trialOps > 0) return k.trialWay;
  if (!k.ways[1].seen) return startTrial(k, true);
  if (!k.ways[0].seen) return startTrial(k, false);
  const bool best = k.ways[1].avg < k.ways[0].avg;
  const double ratio = k.ways[!best].avg / k.ways[best].avg;
  if (++k.sinceExplored < explorePeriod(ratio)) return best;
  k.sinceExplored = 0;
  return startTrial(k, !best);
}

void WayPolicy::record(OpKind kind, size_t hostBytes, bool way, double nsPerByte) {
  if (mode_ != Mode::kAuto) return;
  PerKind& k = of(kind, hostBytes);
  // The first large op of a kind and size also faults in its buffers' pages and warms the caches:
  // it would judge its way unfairly.
  // An op of no bytes has no time per byte (infinite): it would poison the averages for good.
  if (!(nsPerByte > 0) || !std::isfinite(nsPerByte) || k.largeOps <= 1) return;
  Way& w = k.ways[way ? 1 : 0];
  if (k.trialOps > 0 && way == k.trialWay) {
    k.trialBest = k.trialBest > 0 ? std::min(k.trialBest, nsPerByte) : nsPerByte;
    if (--k.trialOps == 0) {
      w.avg = k.trialBest;
      w.seen = true;
      SMDDP_INFO(kColl, "%s of %s over %zu bytes: %s trial %.4f ns/B, %s %.4f ns/B", what_, opKindName(kind),
                 hostBytes, wayNames_[way], w.avg, wayNames_[!way], k.ways[!way].avg);
    }
    return;
  }
  // The way in use. One slow op (a new buffer's page faults, a descheduled peer) moves the
  // average by at most kWeight * (kMaxStep - 1); a lasting change moves it on every op.
  w.avg = w.seen ? (1 - kWeight) * w.avg + kWeight * std::min(nsPerByte, kMaxStep * w.avg) : nsPerByte;
  w.seen = true;
  SMDDP_TRACE(kColl, "%s of %s over %zu bytes: %s op %.4f ns/B, average %.4f (the other way %.4f)", what_,
              opKindName(kind), hostBytes, wayNames_[way], nsPerByte, w.avg, k.ways[!way].avg);
}

uint64_t WayPolicy::explorePeriod(double ratio) {
  // Trying a way that took `ratio` times as long costs ratio - 1 ops' time: spread it out to
  // kExploreCost of the time.
  const double ops = std::ceil((ratio - 1) / kExploreCost);
  return static_cast<uint64_t>(std::clamp(ops, double(kExploreMin), double(kExploreMax)));
}

}  // namespace smddp::algo
