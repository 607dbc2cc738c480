#include "cuda/flags.h"

#include <time.h>

#include <algorithm>

#include "core/error.h"

namespace smddp::cuda {

FlagWords::FlagWords(DeviceOps& ops, int count) : ops_(ops) {
  words_ = static_cast<uint64_t*>(ops_.hostAlloc(count * kStride * sizeof(uint64_t)));
  for (int i = 0; i < count; ++i) __atomic_store_n(host(i), 0, __ATOMIC_RELEASE);
  device_ = static_cast<uint64_t*>(ops_.deviceAddress(words_));
}

void awaitFlag(const uint64_t* word, uint64_t g, std::chrono::steady_clock::time_point deadline,
               const std::atomic<bool>& aborted, const char* what, const char* unit) {
  // Spin a little (the copy is often done already), then sleep in growing steps up to 200 us:
  // the device cannot wake a sleeping thread, and a polling thread must not take a core that a
  // rank's reduction needs.
  long sleepNs = 2000;
  for (int spins = 0; __atomic_load_n(word, __ATOMIC_ACQUIRE) < g; ++spins) {
    if (aborted.load(std::memory_order_relaxed)) {
      throwError(ErrorCode::kAborted, "the process group was shut down while waiting for the GPU to %s", what);
    }
    if (spins < 2000) continue;
    if (std::chrono::steady_clock::now() >= deadline) {
      throwError(ErrorCode::kTimeout,
                 "timed out waiting for the GPU to %s (%s %llu): the stream the op was issued on did not get "
                 "there; an earlier kernel on that stream may be stuck",
                 what, unit, static_cast<unsigned long long>(g));
    }
    timespec ts{0, sleepNs};
    nanosleep(&ts, nullptr);
    sleepNs = std::min(sleepNs * 2, 200000L);
  }
}

void raiseFlag(uint64_t* word, uint64_t g) {
  uint64_t cur = __atomic_load_n(word, __ATOMIC_ACQUIRE);
  while (cur < g && !__atomic_compare_exchange_n(word, &cur, g, false, __ATOMIC_RELEASE, __ATOMIC_ACQUIRE)) {
  }
}

}  // namespace smddp::cuda
