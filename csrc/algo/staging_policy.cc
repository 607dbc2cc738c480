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

bool StagingPolicy::choose(OpKind kind) {
  if (mode_ != Mode::kAuto) return mode_ == Mode::kAlways;
  PerKind& k = kinds_[static_cast<size_t>(kind) % kKinds];
  ++k.largeOps;
  if (!k.ways[0].seen || !k.ways[1].seen) return !k.ways[1].seen;  // one of each first
  const bool best = k.ways[1].avg < k.ways[0].avg;
  const double ratio = k.ways[!best].avg / k.ways[best].avg;
  if (++k.sinceExplored < explorePeriod(ratio)) return best;
  k.sinceExplored = 0;
  return !best;
}

uint64_t StagingPolicy::explorePeriod(double ratio) {
  // Trying a way that took `ratio` times as long costs ratio - 1 ops' time: spread it out to
  // kExploreCost of the time.
  const double ops = std::ceil((ratio - 1) / kExploreCost);
  return static_cast<uint64_t>(std::clamp(ops, double(kExploreMin), double(kExploreMax)));
}

void StagingPolicy::record(OpKind kind, bool streamed, double nsPerByte) {
  PerKind& k = kinds_[static_cast<size_t>(kind) % kKinds];
  // The first large op of a kind also faults in its buffers' pages and warms the caches: it would
  // judge its way unfairly.
  if (mode_ != Mode::kAuto || !(nsPerByte > 0) || k.largeOps <= 1) return;
  Way& w = k.ways[streamed ? 1 : 0];
  // A way last used more than an op ago (an exploration) is judged on this time alone: its old
  // average may date from another placement.
  const bool fresh = w.seen && k.largeOps - w.lastOp <= 1;
  w.avg = fresh ? (1 - kWeight) * w.avg + kWeight * nsPerByte : nsPerByte;
  w.seen = true;
  w.lastOp = k.largeOps;
}

}  // namespace smddp::algo
