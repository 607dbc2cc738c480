// Which of two ways a kind of large op takes, learnt from the ops' own times.
//
// Some choices have no answer known in advance: it depends on where the scheduler put the ranks
// (sharing a last-level cache or not), on the pages under the caller's buffers (4 KiB or huge),
// on the machine, and it may change while a job runs. A WayPolicy learns such a choice per kind
// of op and size class (a power of two of the host's bytes: how much of the data stays in cache,
// so the time per byte and the better way, changes with the size; a job has a handful of sizes)
// from the ops' own times: after an op that warms up, it tries each way for kTrialOps ops and
// judges it by the fastest, then takes the way with the lower moving average of time per byte,
// and tries the other way again now and then (a new trial, whose result replaces the old: it may
// date from another placement), the less often the slower it was, so that trying costs at most
// kExploreCost of the time. Ops of tens of microseconds time too noisily for a rank to learn
// alone: the users keep it to large ops.
//
// Two choices use it (algo/collectives.h):
// - Staging with streaming stores (way 1) or through the cache (way 0), SMDDP_STAGE_STREAM. Peers
//   read what a rank stages in shared memory. Where they share its last-level cache they read it
//   fastest from there; where they do not (another socket, another AMD CCX, or a VM whose host
//   has moved its vCPUs apart) they pull each line still dirty out of the writer's cache, several
//   times slower than from memory, and streaming stores, which send the data to memory, win.
//   Measured at 32 MiB on 2 vCPUs (README, "Staging and cache placement"): streamed ops took
//   0.16-0.51x the time on separate L3s, and 0.72-1.52x on a shared one, by op, page size and
//   run; auto came within 4% of the better way on a shared L3 and within 2% on separate ones.
//   Every rank decides for itself: how a rank writes its own staging area is invisible to the
//   readers, so ranks that judge differently still compute the same results.
// - An all_reduce reading its peers' buffers in place (way 1) or staged (way 0),
//   SMDDP_SHM_ALLREDUCE_SINGLE_COPY. process_vm_readv's copies cost more per byte on 4 KiB pages
//   than on huge ones, by as much as the copy it saves at some sizes. The ranks must agree: the
//   host's first rank decides and tells the others in the op's first step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "core/types.h"

namespace smddp::algo {

class WayPolicy {
 public:
  enum class Mode { kAuto, kAlways, kNever };
  // The other way is tried again after explorePeriod() large ops of the kind, for kTrialOps ops.
  static constexpr uint64_t kExploreMin = 16, kExploreMax = 256;
  static constexpr double kExploreCost = 0.05;  // of the time, at most, spent trying the slower way
  static constexpr int kTrialOps = 2;     // a trial counts its fastest op: slow ones have many causes
  static constexpr double kWeight = 0.25;  // of the newest time in the way in use's moving average
  static constexpr double kMaxStep = 2;    // a time counts at most as this many times the average

  // `what`, `ways`: the choice and its two ways, for the log ("staging", {"cached", "streamed"}).
  WayPolicy(Mode mode, const char* what, const char* way0, const char* way1)
      : mode_(mode), what_(what), wayNames_{way0, way1} {}
  // `value` of setting `name`: auto, 1 or 0; anything else throws kInvalidUsage.
  static Mode parseMode(const char* name, const std::string& value);

  // The way the next large op of `kind` over `hostBytes` (the data of the host's ranks) takes.
  bool choose(OpKind kind, size_t hostBytes);
  // How long that op took per byte of the host's data, to learn from (auto only).
  void record(OpKind kind, size_t hostBytes, bool way, double nsPerByte);
  // Large ops between tries of the other way, when it took `ratio` times as long as the best.
  static uint64_t explorePeriod(double ratio);

 private:
  struct Way {
    double avg = 0;  // ns per byte: the last trial's fastest op, then a moving average while in use
    bool seen = false;
  };
  struct PerKind {
    Way ways[2];
    uint64_t largeOps = 0;
    uint64_t sinceExplored = 0;
    int trialOps = 0;  // ops of the current trial still to come (0: none running)
    bool trialWay = false;
    double trialBest = 0;
  };
  static bool startTrial(PerKind& k, bool way);
  PerKind& of(OpKind kind, size_t hostBytes);

  Mode mode_;
  const char* what_;
  const char* wayNames_[2];
  std::map<uint32_t, PerKind> kinds_;  // by kind and size class
};

}  // namespace smddp::algo
