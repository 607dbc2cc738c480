#include "core/spin.h"

#include <sched.h>

#include <algorithm>
#include <mutex>
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

namespace {
std::mutex claimsMutex;
std::vector<const CpuShare*> liveClaims;  // few entries: one per process group
}  // namespace

CpuShareClaim::CpuShareClaim(const CpuShare& share) : share_(share) {
  std::lock_guard<std::mutex> lock(claimsMutex);
  liveClaims.push_back(&share_);
}

CpuShareClaim::~CpuShareClaim() {
  std::lock_guard<std::mutex> lock(claimsMutex);
  liveClaims.erase(std::find(liveClaims.begin(), liveClaims.end(), &share_));
}

CpuShare CpuShareClaim::busiest() const {
  std::lock_guard<std::mutex> lock(claimsMutex);
  CpuShare most = share_;
  for (const CpuShare* s : liveClaims) {
    // Ranks per CPU, compared without division; on a tie the larger count of ranks.
    const int64_t lhs = int64_t{s->ranks} * most.cpus, rhs = int64_t{most.ranks} * s->cpus;
    if (lhs > rhs || (lhs == rhs && s->ranks > most.ranks)) most = *s;
  }
  return most;
}

void YieldGate::yielded(bool slow) {
  uint32_t backoff = backoff_.load(std::memory_order_relaxed);
  if (slow) {
    backoff = std::clamp(2 * backoff, kMinSkip, kMaxSkip);
  } else if (backoff != 0) {
    backoff = backoff / 2 < kMinSkip ? 0 : backoff / 2;
  } else {
    return;
  }
  backoff_.store(backoff, std::memory_order_relaxed);
  skip_.store(backoff, std::memory_order_relaxed);
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

std::chrono::microseconds handOffLinger(const CpuShare& share) {
  const int64_t us = env::lingerMicros();
  if (us >= 0) return std::chrono::microseconds(us);
  // Measured on 2 ranks sharing 2 cores: all_reduce(async_op=True).wait() of 8 bytes took 111 us
  // with both threads polling 50 us, 11 us sleeping at once (the wake-ups cost less than the
  // polls steal).
  if (share.underTwoCoresPerRank()) return std::chrono::microseconds(0);
  return lingerBudget(share);
}

// Ops waited for within it (functional collectives, DTensor; a short layer between FSDP's
// prefetch and its use) are run by their waiter, none woken; one nobody waits for starts
// within a doze slice (1-8 times this); the dozing thread wakes at most a thousand times a
// second while ops keep coming, 125 times once its slices find nothing to take (ProgressThread).
constexpr int64_t kDefaultWakeDelayMicros = 1000;

std::chrono::microseconds progressWakeDelay(const CpuShare& share) {
  const int64_t us = env::deferWakeMicros();
  if (us >= 0) return std::chrono::microseconds(us);
  if (!share.underTwoCoresPerRank() || env::waitRunsOp() == 0) return std::chrono::microseconds(0);
  return std::chrono::microseconds(kDefaultWakeDelayMicros);
}

}  // namespace smddp
