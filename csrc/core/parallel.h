// Large copies and reductions split over a few threads. One core cannot use up the memory
// bandwidth of a server socket: on the H100 host we measured, one thread copied 5.95 GB/s, so
// a 2-rank CPU all_reduce of 64 MiB was bound by that single thread per rank while 14 cores
// idled. SMDDP_CPU_THREADS = 1 (what the default picks when ranks fill the cores) keeps
// everything on the thread that runs the op.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/slices.h"
#include "core/types.h"

namespace smddp {

class HelperPool {
 public:
  // Starts `helpers` threads named `name`. Between calls they spin for a few microseconds (the
  // next step of an op usually follows at once), then sleep on a condition variable.
  HelperPool(int helpers, const std::string& name);
  ~HelperPool();  // joins the helpers; no run() may be in flight (the owner serialises them)
  HelperPool(const HelperPool&) = delete;
  HelperPool& operator=(const HelperPool&) = delete;

  int threads() const { return static_cast<int>(threads_.size()) + 1; }
  // Runs part(0) .. part(parts - 1), part 0 on the calling thread and part i on helper i - 1,
  // and returns once all have run. 1 <= parts <= threads(); parts must not throw. One caller at a
  // time (a process group runs one op at a time).
  void run(int parts, const std::function<void(int)>& part);

 private:
  void loop(int helper);
  void stopAll();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int)>* part_ = nullptr;
  int parts_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// A part smaller than this costs more in hand-off (a wake-up, a cache miss on the flags) than
// it saves.
constexpr size_t kMinPartBytes = 64 * 1024;

// Cuts `count` elements of `elemBytes` into parts on multiples of `align` elements, one per
// thread of `pool` (null: one part) as long as each part gets kMinPartBytes, and runs
// fn(begin, size) for every non-empty part, part 0 on the calling thread. A template, so the
// one-part case (every small op) is a direct call.
template <class Fn>
void forEachPart(HelperPool* pool, size_t count, size_t elemBytes, size_t align, Fn&& fn) {
  const size_t fit = count * elemBytes / kMinPartBytes;  // parts that get kMinPartBytes each
  const int parts = pool == nullptr ? 1 : static_cast<int>(std::clamp<size_t>(fit, 1, pool->threads()));
  if (parts == 1) {
    if (count > 0) fn(size_t{0}, count);
    return;
  }
  const Slices sl = slicesOf(count, parts, align);
  pool->run(parts, [&](int i) {
    if (sl.size(i) > 0) fn(sl.begin(i), sl.size(i));
  });
}

// memcpy (streaming stores if `stream`, see copyOut) and reduce (see reduce.h), split over
// `pool` by forEachPart.
void copyParallel(HelperPool* pool, void* dst, const void* src, size_t n, bool stream = false);
void reduceParallel(HelperPool* pool, DataType dtype, const Reduction& r, void* dst, const void* const* srcs, int n,
                    size_t count);

}  // namespace smddp
