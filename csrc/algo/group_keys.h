// When a group's keys may leave the job's store. A job that makes groups as it runs (new_group,
// DeviceMesh's sub-groups, a group per evaluation) would otherwise grow its store by about ten
// keys per rank and group for as long as it runs.
//
// A rank's keys are of two kinds. Its set-up's keys (its records, tickets, answers) are read
// only while peers set the group up: it may remove them once every rank is past its set-up.
// Other keys are read while the group lives (where a stalled rank stands, a TCP address read at
// a first all_to_all): only the last rank to destroy the group may remove them, every rank's.
//
// One counter under kRanksDoneKey in the group's namespace tells both: a rank past its set-up
// adds 1 (countSetUp), a rank destroying the group adds size + 1 (release), so that one add
// answers "how many are past their set-up" (sum % (size + 1)) and "how many have destroyed it"
// (sum / (size + 1)).
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "core/store.h"

namespace smddp::algo::group_keys {

inline constexpr char kRanksDoneKey[] = "smddp/ranks-done";

// Counts this rank past its set-up in the group's namespace `group`, last in its set-up (in a
// group of one rank, no peer reads its keys: nothing to count). Throws what the store throws
// (kInvalidUsage where it cannot add): the group works without, its keys staying in the store.
void countSetUp(Store& group, int size);

struct Release {
  int size = 1;
  // Keys of the job's store (full names): this rank's set-up's, removed once every rank is
  // past its set-up.
  std::vector<std::string> spent;
  // Keys of the group's namespace: every rank's read while the group lives, removed by the last
  // rank to destroy the group (with the counter, which this adds).
  std::vector<std::string> lasting;
  // How long a rank waits for peers still setting up (a group destroyed as soon as it is made)
  // before it leaves its set-up's keys in the store: ranks end their set-ups within
  // milliseconds of each other.
  std::chrono::milliseconds peersSetUpPatience{800};
  // How long the removal may take: at the end of a large job every rank destroys its groups at
  // once, and the store goes with the job.
  std::chrono::milliseconds removalBudget{200};
};

struct Released {
  bool allSetUp = false;  // every rank was past its set-up: `spent` went
  bool last = false;      // the last rank to destroy the group: `lasting` went
  size_t removed = 0;     // keys removed (within the budget; those not set are not counted)
  std::string failure;    // the store's error that ended it ("" if none)
};

// Destroying the group on this rank (counted past its set-up): removes what it
// may of `plan`'s keys. Blocks for up to the patience plus the budget and the store's own
// requests; the caller runs it on a thread no op waits for (StoreErrands). The first store
// failure ends it (the store is gone, or its host), reported in `failure`; never throws.
Released release(Store& root, Store& group, const Release& plan) noexcept;

}  // namespace smddp::algo::group_keys
