#include "core/spin.h"

#include <sched.h>

#include <algorithm>
#include <thread>

#include "core/env.h"

namespace smddp {

int usableCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

bool oversubscribed(int ranksOnHost) { return ranksOnHost > usableCpus(); }

std::chrono::microseconds spinBudget(int ranksOnHost) {
  const int64_t us = env::spinMicros();
  if (us >= 0) return std::chrono::microseconds(us);
  // A peer that is late by more than this has most likely been descheduled; past it, sleeping
  // costs a wake-up (tens of microseconds) but frees the core.
  return std::chrono::microseconds(oversubscribed(ranksOnHost) ? 2 : 500);
}

std::chrono::microseconds lingerBudget(int ranksOnHost) {
  return std::min(spinBudget(ranksOnHost), std::chrono::microseconds(50));
}

}  // namespace smddp
