// WayPolicy (algo/way_policy.h): which of two ways large ops take, learnt from their times (told here
// as staging: way 1 streamed).
#include <limits>
#include <string>

#include "algo/way_policy.h"
#include "algo_tests.h"
#include "expect.h"

using smddp::OpKind;
using smddp::algo::WayPolicy;
using smddp::test::expect;

namespace {

constexpr size_t kBytes = size_t(64) << 20;

// Runs `ops` large ops of `kind`, each taking `cached` or `streamed` ns per byte by the way it
// staged; returns how many streamed.
int run(WayPolicy& p, OpKind kind, int ops, double cached, double streamed) {
  int n = 0;
  for (int i = 0; i < ops; ++i) {
    const bool s = p.choose(kind, kBytes);
    n += s;
    p.record(kind, kBytes, s, s ? streamed : cached);
  }
  return n;
}

void fixedModes() {
  WayPolicy always(WayPolicy::Mode::kAlways, "staging", "cached", "streamed"),
      never(WayPolicy::Mode::kNever, "staging", "cached", "streamed");
  expect(run(always, OpKind::kAllgather, 40, 1.0, 9.0) == 40, "mode 1 always streams, however slow");
  expect(run(never, OpKind::kAllgather, 40, 9.0, 1.0) == 0, "mode 0 never streams, however slow");
}

void triesBothThenKeepsTheFaster() {
  WayPolicy p(WayPolicy::Mode::kAuto, "staging", "cached", "streamed");
  const bool warmUp = p.choose(OpKind::kAllreduce, kBytes);
  p.record(OpKind::kAllreduce, kBytes, warmUp, 100.0);  // cold pages: not held against its way
  bool ways[2 * WayPolicy::kTrialOps];
  for (bool& w : ways) {
    w = p.choose(OpKind::kAllreduce, kBytes);
    p.record(OpKind::kAllreduce, kBytes, w, 1.0);
  }
  expect(ways[0] == ways[1] && ways[2] == ways[3] && ways[0] != ways[2],
         "after the warm-up op, a trial of two ops each way");
  // Streaming 3x faster: of the next 64 ops, all but a trial of the cache (per 40 ops) and an op
  // or two that break the first tie stream.
  const int streamed = run(p, OpKind::kAllreduce, 64, 3.0, 1.0);
  expect(streamed >= 58 && streamed < 64, "streams where it is faster (" + std::to_string(streamed) + "/64)");
  WayPolicy q(WayPolicy::Mode::kAuto, "staging", "cached", "streamed");
  const int slow = run(q, OpKind::kAllreduce, 66, 1.0, 3.0);
  expect(slow >= 1 && slow <= 6, "stages through the cache where that is faster (" + std::to_string(slow) + "/66)");
}

void followsAChangeOfPlacement() {
  // Shared L3 first (the cache faster), then the readers move to another L3 (streaming 4x faster):
  // after the change, only the tries of the cache and an op or two while the average catches up
  // still go through the cache.
  WayPolicy p(WayPolicy::Mode::kAuto, "staging", "cached", "streamed");
  constexpr int kTrial = WayPolicy::kTrialOps;
  const int before = run(p, OpKind::kAllgather, 96, 1.0, 1.3);
  expect(before <= kTrial * (96 / 16 + 1),
         "streams only to try it while the cache is faster (" + std::to_string(before) + ")");
  const int after = run(p, OpKind::kAllgather, 96, 4.0, 1.0);
  expect(after >= 96 - kTrial * (96 / 16) - 3, "streams after the change (" + std::to_string(after) + "/96)");
}

void noticesTheOtherWayGettingFaster() {
  // The way not in use improves while the one in use stays as it was: only trying it tells.
  WayPolicy p(WayPolicy::Mode::kAuto, "staging", "cached", "streamed");
  run(p, OpKind::kBroadcast, 64, 1.0, 3.0);
  const int period = static_cast<int>(WayPolicy::explorePeriod(3.0));
  const int streamed = run(p, OpKind::kBroadcast, 128, 1.0, 0.5);
  expect(streamed >= 128 - period - 3, "finds that streaming got faster (" + std::to_string(streamed) + "/128)");
}

void triesTheSlowerWayRarely() {
  expect(WayPolicy::explorePeriod(1.1) == WayPolicy::kExploreMin, "a close second is tried every 16 ops");
  expect(WayPolicy::explorePeriod(5.5) == 90, "a way 5.5x as slow is tried every 90 ops (5% of the time)");
  expect(WayPolicy::explorePeriod(1e6) == WayPolicy::kExploreMax, "at least every 256 ops");
  // 1000 ops: a trial of each way first, then one of streaming per 90 ops in the cache's way.
  WayPolicy p(WayPolicy::Mode::kAuto, "staging", "cached", "streamed");
  const int streamed = run(p, OpKind::kAllgather, 1000, 1.0, 5.5);
  constexpr int kTrial = WayPolicy::kTrialOps, kTrials = 1000 / (90 + kTrial);
  expect(streamed >= kTrial * kTrials && streamed <= kTrial * (kTrials + 1),
         "tries streaming once per 90 ops when it is 5.5x as slow (" + std::to_string(streamed) + " ops)");
}

void oneSlowOpMisleadsNothing() {
  // Streaming 1.5x faster, and every 7th op 10x slow whichever way it took (a new buffer's page
  // faults, a descheduled peer): still streams but for the trials of the cache.
  WayPolicy p(WayPolicy::Mode::kAuto, "staging", "cached", "streamed");
  int streamed = 0;
  for (int i = 0; i < 224; ++i) {
    const bool s = p.choose(OpKind::kAllgather, kBytes);
    streamed += s;
    p.record(OpKind::kAllgather, kBytes, s, (s ? 1.0 : 1.5) * (i % 7 == 6 ? 10 : 1));
  }
  expect(streamed >= 224 - 2 * (224 / 16) - 3,
         "keeps streaming through slow ops (" + std::to_string(streamed) + "/224)");
}

void timesPerNoByteTeachNothing() {
  // An op's time per byte is infinite when it moved no bytes (SMDDP_STAGE_STREAM_MIN_BYTES=0
  // lets such ops ask): recorded, both ways' averages stayed infinite and never learnt again.
  WayPolicy p(WayPolicy::Mode::kAuto, "staging", "cached", "streamed");
  const double inf = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 40; ++i) p.record(OpKind::kAllgather, kBytes, p.choose(OpKind::kAllgather, kBytes), inf);
  expect(run(p, OpKind::kAllgather, 64, 2.0, 1.0) >= 64 - 2 * WayPolicy::kTrialOps - 3,
         "after ops of no bytes, streaming 2x faster is learnt");
}

void kindsLearnApart() {
  WayPolicy p(WayPolicy::Mode::kAuto, "staging", "cached", "streamed");
  for (int i = 0; i < 64; ++i) {
    const bool a = p.choose(OpKind::kAllgather, kBytes), r = p.choose(OpKind::kReduceScatter, kBytes);
    p.record(OpKind::kAllgather, kBytes, a, a ? 1.0 : 2.0);
    p.record(OpKind::kReduceScatter, kBytes, r, r ? 2.0 : 1.0);
  }
  expect(p.choose(OpKind::kAllgather, kBytes) || p.choose(OpKind::kAllgather, kBytes), "allgather streams");
  expect(!p.choose(OpKind::kReduceScatter, kBytes) || !p.choose(OpKind::kReduceScatter, kBytes),
         "reduce_scatter does not");
}

void sizesLearnApart() {
  // DDP's buckets or FSDP's layers alternate sizes; whether a size stays in cache decides the way.
  WayPolicy p(WayPolicy::Mode::kAuto, "staging", "cached", "streamed");
  constexpr size_t kSmall = size_t(40) << 20, kLarge = size_t(300) << 20;
  int smallStreamed = 0, largeStreamed = 0;
  for (int i = 0; i < 200; ++i) {
    const bool s = p.choose(OpKind::kAllreduce, kSmall), l = p.choose(OpKind::kAllreduce, kLarge);
    smallStreamed += s;
    largeStreamed += l;
    p.record(OpKind::kAllreduce, kSmall, s, s ? 2.0 : 1.0);
    p.record(OpKind::kAllreduce, kLarge, l, l ? 1.0 : 2.0);
  }
  const int trials = WayPolicy::kTrialOps * (200 / 20 + 1);
  expect(smallStreamed <= trials,
         "40 MiB ops stage through the cache (" + std::to_string(smallStreamed) + "/200 streamed)");
  expect(largeStreamed >= 200 - trials - 1, "300 MiB ops stream (" + std::to_string(largeStreamed) + "/200)");
  // Sizes within a power of two share what was learnt (a new size class would warm up through
  // the cache first).
  expect(p.choose(OpKind::kAllreduce, size_t(400) << 20) || p.choose(OpKind::kAllreduce, size_t(400) << 20),
         "400 MiB ops learn from 300 MiB ones");
}

}  // namespace

void wayPolicyTests() {
  fixedModes();
  triesBothThenKeepsTheFaster();
  followsAChangeOfPlacement();
  noticesTheOtherWayGettingFaster();
  triesTheSlowerWayRarely();
  oneSlowOpMisleadsNothing();
  timesPerNoByteTeachNothing();
  kindsLearnApart();
  sizesLearnApart();
}
