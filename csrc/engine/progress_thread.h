// Runs a process group's operations one at a time, in issue order, on a dedicated thread, so
// `async_op=True` overlaps communication with the caller's compute. An idle thread sleeps on a
// condition variable and costs nothing.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace smddp::engine {

class ProgressThread {
 public:
  using Task = std::function<void()>;

  // After a task, the thread polls for the next one for `linger` before sleeping: a burst of
  // async ops then avoids a wake-up per op.
  ProgressThread(std::string name, std::chrono::microseconds linger);
  ~ProgressThread();  // runs what is queued, then joins

  // Tasks must not throw: each one reports its own outcome (the torch layer completes a Work).
  // A task issued by a running task of this thread (a future's callback, run as an op completes,
  // that issues an op and waits for it: DDP's PowerSGD hook does) runs at once, nested, on the
  // same thread: queued, it would wait for the task that waits for it. It also takes the same
  // place on every rank this way, right after the op whose completion issued it, wherever the
  // caller's thread has got to meanwhile.
  void enqueue(Task task);
  // Runs `task` on the calling thread if nothing is queued or running (or nested, as above),
  // which preserves issue order and saves two thread hand-offs for blocking ops. Returns false
  // (task not run) otherwise.
  bool tryRunInline(const Task& task);
  // Runs queued tasks on the calling thread, in order, until `done()` (checked after each) or
  // the queue is empty, unless a task is running already (on the thread or another caller's) or
  // the caller is inside one. A caller that waits for an op not yet started so runs it itself,
  // saving two hand-offs (its wake-up of the thread, the thread's of it), as a blocking call
  // does; where ranks outnumber cores each hand-off waits for a core. Returns whether it ran any.
  bool runQueuedUntil(const std::function<bool()>& done);
  // Stops after the queued tasks have run. Idempotent.
  void stop();

 private:
  void loop();
  // Runs `task` as this thread's, marking the calling thread as running one (for nested issues).
  void runAsOwn(const Task& task);
  // After tasks run on a caller's thread: clears busy_ and wakes the thread if it has work or
  // stop() waits for it.
  void releaseToThread();
  bool reentrant() const;

  std::string name_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  bool busy_ = false;      // a task is running, on the thread or inline
  bool sleeping_ = false;  // the thread waits on cv_ (only then is a notify needed)
  std::atomic<size_t> queued_{0};
  std::chrono::microseconds linger_;
  std::thread thread_;
};

}  // namespace smddp::engine
