#include "algo/group_keys.h"

#include <exception>

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

SetUpEnd endSetUp(Store& root, Store& group, int size, const std::vector<std::string>& spent) {
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
      throwError(ErrorCode::kTimeout,
                 "%s of %d ranks ended their set-up of the group within the timeout (the others failed or died "
                 "after their own set-up; %s)",
                 came < 0 ? "not all" : std::to_string(came).c_str(), size, e.what());
    }
  }
  removeAll(root, spent, out);
  if (size > 1 && out.failure.empty()) {
    try {
      if (group.add(kRemovedKey, 1) == size) {
        SetUpEnd counters;
        removeAll(group, {kSetUpDoneKey, kAllSetUpKey, kRemovedKey}, counters);
        out.failure = counters.failure;
      }
    } catch (const std::exception& e) {
      out.failure = e.what();
    }
  }
  return out;
}

}  // namespace smddp::algo::group_keys
