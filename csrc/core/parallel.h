// Large copies and reductions split over a few threads. One core cannot use up the memory
// bandwidth of a server socket: on the H100 host we measured, one thread copied 5.95 GB/s, so
// a 2-rank CPU all_reduce of 64 MiB was bound by that single thread per rank while 14 cores
// idled. SMDDP_CPU_THREADS = 1 (the default) keeps everything on the thread that runs the op.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

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

// memcpy (streaming stores if `stream`, see copyOut) and reduce (see reduce.h), split over
// `pool` when the data is large enough to pay for the hand-off; `pool` may be null.
void copyParallel(HelperPool* pool, void* dst, const void* src, size_t n, bool stream = false);
void reduceParallel(HelperPool* pool, DataType dtype, const Reduction& r, void* dst, const void* const* srcs, int n,
                    size_t count);

}  // namespace smddp
