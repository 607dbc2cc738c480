#include "core/spin.h"

#include <sched.h>

#include <algorithm>
#include <thread>

#include "core/env.h"

namespace smddp {

int usableCpus() { return static_cast<int>(usableCpuIds().size()); }

std::vector<int> usableCpuIds() {
  std::vector<int> ids;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) ids.push_back(c);
    }
  }
  if (ids.empty()) {
    for (int c = 0; c < static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); ++c) ids.push_back(c);
  }
  return ids;
}

std::chrono::microseconds spinBudget(const CpuShare& share) {
  const int64_t us = env::spinMicros();
  if (us >= 0) return std::chrono::microseconds(us);
  // A peer that is late by more than this has most likely been descheduled; past it, sleeping
  // costs a wake-up (tens of microseconds) but frees the core.
  return std::chrono::microseconds(share.oversubscribed() ? 2 : 500);
}

std::chrono::microseconds lingerBudget(const CpuShare& share) {
  return std::min(spinBudget(share), std::chrono::microseconds(50));
}

}  // namespace smddp
