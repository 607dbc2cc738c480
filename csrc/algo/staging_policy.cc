#include "algo/staging_policy.h"

#include <algorithm>
#include <cmath>

#include "core/env.h"
#include "core/error.h"

namespace smddp::algo {

StagingPolicy::Mode StagingPolicy::modeFromEnv() {
  const std::string& v = env::stageStream();
  if (v == "auto") return Mode::kAuto;
  if (v == "1") return Mode::kAlways;
  if (v == "0") return Mode::kNever;
  throwError(ErrorCode::kInvalidUsage, "SMDDP_STAGE_STREAM=%s: expected auto, 1 or 0", v.c_str());
}

bool StagingPolicy::startTrial(PerKind& k, bool way) {
  k.trialOps = kTrialOps;
  k.trialWay = way;
  k.trialBest = 0;
  return way;
}

bool StagingPolicy::choose(OpKind kind) {
  if (mode_ != Mode::kAuto) return mode_ == Mode::kAlways;
  PerKind& k = kinds_[static_cast<size_t>(kind) % kKinds];
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

void StagingPolicy::record(OpKind kind, bool streamed, double nsPerByte) {
  PerKind& k = kinds_[static_cast<size_t>(kind) % kKinds];
  // The first large op of a kind also faults in its buffers' pages and warms the caches: it would
  // judge its way unfairly.
  if (mode_ != Mode::kAuto || !(nsPerByte > 0) || k.largeOps <= 1) return;
  Way& w = k.ways[streamed ? 1 : 0];
  if (k.trialOps > 0 && streamed == k.trialWay) {
    k.trialBest = k.trialBest > 0 ? std::min(k.trialBest, nsPerByte) : nsPerByte;
    if (--k.trialOps == 0) {
      w.avg = k.trialBest;
      w.seen = true;
    }
    return;
  }
  // The way in use. One slow op (a new buffer's page faults, a descheduled peer) moves the
  // average by at most kWeight * (kMaxStep - 1); a lasting change moves it on every op.
  w.avg = w.seen ? (1 - kWeight) * w.avg + kWeight * std::min(nsPerByte, kMaxStep * w.avg) : nsPerByte;
  w.seen = true;
}

uint64_t StagingPolicy::explorePeriod(double ratio) {
  // Trying a way that took `ratio` times as long costs ratio - 1 ops' time: spread it out to
  // kExploreCost of the time.
  const double ops = std::ceil((ratio - 1) / kExploreCost);
  return static_cast<uint64_t>(std::clamp(ops, double(kExploreMin), double(kExploreMax)));
}

}  // namespace smddp::algo
