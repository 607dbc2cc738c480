#include "algo/group_keys.h"

#include <algorithm>
#include <exception>
#include <thread>

#include "core/error.h"

namespace smddp::algo::group_keys {

namespace {

// Removes `keys` from `from`, stopping at the store's first failure (reported in `out`).
void removeAll(Store& from, const std::vector<std::string>& keys, SetUpEnd& out) {
  try {
    for (const std::string& k : keys) {
      if (from.deleteKey(k)) ++out.removed;
    }
  } catch (const std::exception& e) {
    out.failure = e.what();
  }
}

}  // namespace

SetUpEnd endSetUp(Store& root, Store& group, int rank, int size, const std::vector<std::string>& spent,
                  std::chrono::milliseconds removalPatience) {
  SetUpEnd out;
  if (size > 1) {
    int64_t done = 0;
    try {
      done = group.add(kSetUpDoneKey, 1);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidUsage) throw;
      out.failure = e.what();
      return out;
    }
    if (done == size) group.set(kAllSetUpKey, "1");
    try {
      (void)group.get(kAllSetUpKey);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kTimeout) throw;
      int64_t came = -1;
      try {
        came = group.add(kSetUpDoneKey, 0);
      } catch (const Error&) {  // the timeout says enough
      }
      if (came == size) {  // the last to count tells the others: it failed or died in between
        throwError(ErrorCode::kTimeout,
                   "every rank ended its set-up of the group, but the last of them failed or died before telling "
                   "the others (%s)",
                   e.what());
      }
      throwError(ErrorCode::kTimeout,
                 "%s of %d ranks ended their set-up of the group within the timeout (the others failed or died "
                 "after their own set-up; %s)",
                 came < 0 ? "not all" : std::to_string(came).c_str(), size, e.what());
    }
  }
  removeAll(root, spent, out);
  if (size == 1) return out;
  try {
    // Counted whether or not its removal went: rank 0 waits for every rank's count.
    int64_t removed = group.add(kRemovedKey, 1);
    if (rank != 0) return out;
    const auto deadline = std::chrono::steady_clock::now() + removalPatience;
    auto pause = std::chrono::milliseconds(1);
    while (removed < size && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(20));
      removed = group.add(kRemovedKey, 0);
    }
    if (removed == size) {
      SetUpEnd counters;
      removeAll(group, {kSetUpDoneKey, kAllSetUpKey, kRemovedKey}, counters);
      if (out.failure.empty()) out.failure = counters.failure;
    }
  } catch (const std::exception& e) {
    if (out.failure.empty()) out.failure = e.what();
  }
  return out;
}

}  // namespace smddp::algo::group_keys
