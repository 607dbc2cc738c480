#include "core/spin.h"

#include <sched.h>

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
  return std::chrono::microseconds(oversubscribed(ranksOnHost) ? 2 : 50);
}

}  // namespace smddp
