#include "core/parallel.h"

#include <pthread.h>

#include <algorithm>
#include <cstdint>

#include "core/copy.h"
#include "core/reduce.h"
#include "core/slices.h"
#include "core/spin.h"

namespace smddp {
namespace {

// Helpers poll this long for the next part before sleeping: consecutive steps of an op follow
// within microseconds, and a wake-up through the kernel costs tens of them.
constexpr auto kHelperSpin = std::chrono::microseconds(50);

}  // namespace

HelperPool::HelperPool(int helpers, const std::string& name) {
  try {
    for (int i = 0; i < helpers; ++i) {
      threads_.emplace_back([this, i, name] {
        pthread_setname_np(pthread_self(), (name + std::to_string(i)).substr(0, 15).c_str());
        loop(i);
      });
    }
  } catch (...) {
    stopAll();  // a joinable std::thread must not be destroyed
    throw;
  }
}

HelperPool::~HelperPool() { stopAll(); }

void HelperPool::stopAll() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void HelperPool::run(int parts, const std::function<void(int)>& part) {
  if (parts <= 1) {
    part(0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    part_ = &part;
    parts_ = parts;
    pending_.store(parts - 1);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  part(0);
  if (spinUntil(kHelperSpin, [&] { return pending_.load(std::memory_order_acquire) == 0; })) return;
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return pending_.load() == 0; });
}

void HelperPool::loop(int helper) {
  uint64_t seen = 0;
  while (true) {
    if (!spinUntil(kHelperSpin, [&] { return generation_.load(std::memory_order_acquire) != seen; })) {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
    }
    const std::function<void(int)>* part;
    int parts;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      seen = generation_.load();
      part = part_;
      parts = parts_;
    }
    if (helper + 1 >= parts) continue;  // this call needs fewer threads
    (*part)(helper + 1);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);  // the caller checks pending_ under it: no lost wake-up
      done_.notify_one();
    }
  }
}

void copyParallel(HelperPool* pool, void* dst, const void* src, size_t n, bool stream) {
  forEachPart(pool, n, 1, kAlignBytes,
              [&](size_t b, size_t m) { copyOut(bytes(dst) + b, bytes(src) + b, m, stream); });
}

void reduceParallel(HelperPool* pool, DataType dtype, const Reduction& r, void* dst, const void* const* srcs, int n,
                    size_t count) {
  const size_t es = elementSize(dtype);
  forEachPart(pool, count, es, alignElems(dtype), [&](size_t b, size_t m) {
    constexpr int kOnStack = 16;  // sources of a host's ranks: no allocation per part
    const void* onStack[kOnStack];
    std::vector<const void*> onHeap(n > kOnStack ? n : 0);
    const void** mine = n > kOnStack ? onHeap.data() : onStack;
    for (int k = 0; k < n; ++k) mine[k] = bytes(srcs[k]) + b * es;
    reduce(dtype, r, bytes(dst) + b * es, mine, n, m);
  });
}

}  // namespace smddp
