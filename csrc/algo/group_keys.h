// When a group's set-up keys leave the job's store. A job that makes groups as it runs
// (new_group, DeviceMesh's sub-groups, a group per evaluation) would otherwise grow its store by
// about ten keys per rank and group for as long as it runs.
//
// A rank's keys are of two kinds. Its set-up's keys (its records, tickets, answers) are read
// only while peers set the group up: endSetUp(), last in the set-up, waits until every rank is
// past its set-up and removes them. The others are read while the group lives (where a stalled
// rank waits, for the desync probe; a rank's mesh address, for a first all_to_all across hosts)
// and stay in the store. Nothing is removed as the group is destroyed: that is when the job
// ends, and the process that hosts a TCPStore (rank 0's, for tcp:// and env://) may be gone by
// then, which c10d's client reports with a stack trace on every rank that still asks.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "core/store.h"

namespace smddp::algo::group_keys {

// In the group's namespace, removed by rank 0 through endSetUp: ranks past their set-up
// (counter), "every rank is" (set by the last to count), ranks past their removal (counter).
inline constexpr char kSetUpDoneKey[] = "smddp/set-up/done";
inline constexpr char kAllSetUpKey[] = "smddp/set-up/all";
inline constexpr char kRemovedKey[] = "smddp/set-up/removed";

struct SetUpEnd {
  size_t removed = 0;   // keys of `spent` removed (those not set are not counted)
  std::string failure;  // the store's error that stopped the removal ("" if none): the rest stay
};

// Last in a group's set-up, on every rank of it (collective). Waits until every rank has counted
// itself past its set-up in the group's namespace `group` (as long as the store's get() waits:
// the group's timeout), then removes `spent`, keys of the job's store `root` that no peer reads
// any more, and counts itself past its removal. Rank 0 then waits, up to `removalPatience`, for
// every rank's count and removes the counters and the flag: no other rank touches the store after
// its count, so where rank 0's process hosts it (tcp://, env:// without torchrun) none asks
// after rank 0 has returned and perhaps exited (c10d's client prints a stack trace per request
// that finds the store gone).
// Throws kTimeout, naming how many ranks came, when a peer does not (it failed or died after its
// own set-up), and what the store throws where a count or the wait fails (its host is gone); a
// store that cannot add (kInvalidUsage, on every rank alike) skips it all, reported in `failure`,
// and so does a failed removal: the group works as well with its keys left in the store.
SetUpEnd endSetUp(Store& root, Store& group, int rank, int size, const std::vector<std::string>& spent,
                  std::chrono::milliseconds removalPatience = std::chrono::seconds(5));

}  // namespace smddp::algo::group_keys
