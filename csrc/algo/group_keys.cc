#include "algo/group_keys.h"

#include <algorithm>
#include <exception>
#include <thread>

namespace smddp::algo::group_keys {

void countSetUp(Store& group, int size) {
  if (size > 1) group.add(kRanksDoneKey, 1);
}

namespace {

// How many ranks are past their set-up, once every one is or the patience is out, given `done`,
// the counter's value after this rank's destroy was added.
int64_t awaitSetUps(Store& group, int64_t done, int size, std::chrono::milliseconds patience) {
  const int64_t stride = size + 1;
  const auto deadline = std::chrono::steady_clock::now() + patience;
  auto pause = std::chrono::milliseconds(1);
  while (done % stride < size && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
    const int64_t now = group.add(kRanksDoneKey, 0);
    if (now < done) {
      // Removed meanwhile by the last rank to destroy the group, so every rank is past its
      // set-up; this look made the key again, and goes after it.
      group.deleteKey(kRanksDoneKey);
      return size;
    }
    done = now;
  }
  return done % stride;
}

}  // namespace

Released release(Store& root, Store& group, const Release& plan) noexcept {
  Released out;
  const auto removeWithin = [&](Store& from, const std::vector<std::string>& keys,
                                std::chrono::steady_clock::time_point budget) {
    for (const std::string& k : keys) {
      if (std::chrono::steady_clock::now() > budget) return;
      if (from.deleteKey(k)) ++out.removed;
    }
  };
  try {
    if (plan.size > 1) {
      const int64_t stride = plan.size + 1;
      const int64_t done = group.add(kRanksDoneKey, stride);
      out.last = done / stride == plan.size;
      out.allSetUp = awaitSetUps(group, done, plan.size, plan.peersSetUpPatience) == plan.size;
    } else {
      out.allSetUp = out.last = true;
    }
    const auto budget = std::chrono::steady_clock::now() + plan.removalBudget;
    if (out.allSetUp) removeWithin(root, plan.spent, budget);
    if (out.last) removeWithin(group, plan.lasting, budget);
    if (out.last && plan.size > 1) removeWithin(group, {kRanksDoneKey}, budget);
  } catch (const std::exception& e) {
    out.failure = e.what();
  } catch (...) {
    out.failure = "unknown error";
  }
  return out;
}

}  // namespace smddp::algo::group_keys
