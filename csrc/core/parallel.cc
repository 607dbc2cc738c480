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

// A part smaller than this costs more in hand-off (a wake-up, a cache miss on the flags) than
// it saves.
constexpr size_t kMinPartBytes = 64 * 1024;
// Helpers poll this long for the next part before sleeping: consecutive steps of an op follow
// within microseconds, and a wake-up through the kernel costs tens of them.
constexpr auto kHelperSpin = std::chrono::microseconds(50);

int partsFor(const HelperPool* pool, size_t bytes) {
  if (pool == nullptr) return 1;
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(pool->threads(), bytes / kMinPartBytes)));
}

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
  const int parts = partsFor(pool, n);
  if (parts == 1) {
    copyOut(dst, src, n, stream);
    return;
  }
  const Slices sl = slicesOf(n, parts, kAlignBytes);
  pool->run(parts, [&](int i) { copyOut(bytes(dst) + sl.begin(i), bytes(src) + sl.begin(i), sl.size(i), stream); });
}

void reduceParallel(HelperPool* pool, DataType dtype, const Reduction& r, void* dst, const void* const* srcs, int n,
                    size_t count) {
  const size_t es = elementSize(dtype);
  const int parts = partsFor(pool, count * es);
  if (parts == 1) {
    reduce(dtype, r, dst, srcs, n, count);
    return;
  }
  const Slices sl = slicesOf(count, parts, alignElems(dtype));
  pool->run(parts, [&](int i) {
    const size_t b = sl.begin(i), m = sl.size(i);
    if (m == 0) return;
    constexpr int kOnStack = 16;  // sources of a host's ranks: no allocation per part
    const void* onStack[kOnStack];
    std::vector<const void*> onHeap(n > kOnStack ? n : 0);
    const void** mine = n > kOnStack ? onHeap.data() : onStack;
    for (int k = 0; k < n; ++k) mine[k] = bytes(srcs[k]) + b * es;
    reduce(dtype, r, bytes(dst) + b * es, mine, n, m);
  });
}

}  // namespace smddp
