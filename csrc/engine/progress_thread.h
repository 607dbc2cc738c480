// Runs a process group's operations one at a time, in issue order, on a dedicated thread, so
// `async_op=True` overlaps communication with the caller's compute. An idle thread sleeps on a
// condition variable and costs nothing.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
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
  // `wakeDelay`: where the tasks' issuers have been waiting for them within wakeDelay of issuing
  // them (kDeferAfter times in a row, as noteWait() reports), a task queued with
  // enqueue(task, true) wakes nobody: its issuer, about to wait, runs it itself
  // (runQueuedUntil). Meanwhile the thread sleeps in slices and takes what is queued after
  // each (for kDozeWindow after the last task queued), so such a task waits for it at most a
  // slice. A slice starts at wakeDelay and doubles, up to kMaxSliceFactor x wakeDelay, each time
  // it ends with nothing queued: while the issuers run every task, the thread wakes rarely (with
  // 1 ms slices throughout, its wake-ups cost 67 us of CPU per op where ops came 5 ms apart;
  // README, "Async ops"). A deferred task the thread finds queued for wakeDelay or longer was
  // waited for by nobody: the deferral ends there (kDeferAfter soon waits restart it) and the
  // slices start again from wakeDelay. Where a rank's threads share a core, waking the thread
  // for a task its issuer is about to run costs that core (the woken thread takes it from the
  // caller or a peer, or runs the op while the caller sleeps: two hand-offs where none was
  // needed); a task waited for later is better started at once, and is. A timer armed per task
  // would cost as much as the wake-up: arming one due within microseconds reprograms the CPU's
  // timer, a VM exit (7 us on this project's VM). 0: every task wakes the thread, which sleeps
  // until woken.
  ProgressThread(std::string name, std::chrono::microseconds linger,
                 std::chrono::microseconds wakeDelay = std::chrono::microseconds(0));
  static constexpr std::chrono::milliseconds kDozeWindow{50};
  static constexpr int kDeferAfter = 3;
  static constexpr int kMaxSliceFactor = 8;
  std::chrono::microseconds wakeDelay() const { return wakeDelay_; }
  // The thread's next (or current) doze slice; whether a deferrable task would wake nobody now.
  std::chrono::microseconds dozeSlice() const {
    return std::chrono::microseconds(sliceMicros_.load(std::memory_order_relaxed));
  }
  bool deferring() const { return soonWaits_.load(std::memory_order_relaxed) >= kDeferAfter; }
  ~ProgressThread();  // runs what is queued, then joins

  // Tasks must not throw: each one reports its own outcome (the torch layer completes a Work).
  // A task issued by a running task of this thread (a future's callback, run as an op completes,
  // that issues an op and waits for it: DDP's PowerSGD hook does) runs at once, nested, on the
  // same thread: queued, it would wait for the task that waits for it. Before it, the queued
  // tasks numbered below the bound that an IssueOrder on this thread sets run (none without
  // one): the ops issued before the callback's future was obtained. Where an op completes before
  // its callback is chained, the callback runs on the caller's thread and its op is queued
  // behind those same tasks, so the op takes the same place on every rank either way, as long
  // as the caller issues nothing between obtaining the future and chaining the callback (which
  // nobody can see: then the order depends on the ranks' pace).
  // A queued task run nested within callbacks (ahead of a callback's op, or by a callback's wait)
  // leaves the callbacks of its own future for later (runningAhead(), deferCallbacks()): they run
  // after the outermost callbacks return, in the order the tasks ran, as they would where those
  // ops had completed before their callbacks were chained.
  // `deferWake`: the thread, asleep, may take it only after the wake delay (for a task that its
  // issuer will likely wait for, and then run, soon); otherwise it is woken now.
  // After stop() it throws std::logic_error and leaves `task` with the caller, who may run it.
  void enqueue(Task&& task, bool deferWake = false);
  // A task's issuer waits for it, `sinceIssue` after queuing it (first wait only).
  void noteWait(std::chrono::nanoseconds sinceIssue);
  // Ends the wake delay of what is queued: the thread is woken now if it sleeps, or as soon as
  // the task running on a caller's thread ends, and so until the queue is empty. For a caller
  // about to wait for a queued task without running it (a wait with a time limit, a future's).
  void hurry();
  // How many tasks have been queued so far: the number the next one gets.
  uint64_t issued() const { return issued_.load(std::memory_order_acquire); }
  // While one lives, tasks that the calling thread issues nested (above) first run the queued
  // tasks of `thread` numbered below `before`.
  class IssueOrder {
   public:
    IssueOrder(const ProgressThread* thread, uint64_t before);
    ~IssueOrder();
    IssueOrder(const IssueOrder&) = delete;
    IssueOrder& operator=(const IssueOrder&) = delete;

   private:
    const ProgressThread* outerThread_;
    uint64_t outerBefore_;
  };
  // Runs `task` on the calling thread if nothing is queued or running (or nested, as enqueue()),
  // which preserves issue order and saves two thread hand-offs for blocking ops. Returns false
  // (task not run) otherwise.
  bool tryRunInline(const Task& task);
  // Runs queued tasks on the calling thread, in order, until `done()` (checked after each) or
  // the queue is empty, unless a task is running already on another thread. A caller that
  // waits for an op not yet started so runs it itself, saving two hand-offs (its wake-up of the
  // thread, the thread's of it), as a blocking call does; where ranks outnumber cores each
  // hand-off waits for a core. A caller inside a task of this thread (a callback waiting for an
  // op queued behind the task that runs it) runs them nested: otherwise it would wait forever.
  // Returns whether it ran any.
  bool runQueuedUntil(const std::function<bool()>& done);
  // Whether the calling thread is running a task of this thread (then a wait must run the
  // queued ops it waits for itself: runQueuedUntil).
  bool runningHere() const;
  // While one lives, the task running on this thread runs a future's callbacks (user code, not
  // bounded by any timeout, which may hold every task queued behind it: callbacksSince()).
  class InCallbacks {
   public:
    explicit InCallbacks(ProgressThread& thread);
    ~InCallbacks();
    InCallbacks(const InCallbacks&) = delete;
    InCallbacks& operator=(const InCallbacks&) = delete;

   private:
    ProgressThread& thread_;
    int64_t outer_;
  };
  // Since when (steady clock, ns) the running task has been in callbacks; 0: it is not.
  int64_t callbacksSince() const { return callbacksSince_.load(std::memory_order_acquire); }
  // Whether the task the calling thread runs was taken from the queue within callbacks on this
  // thread (above): its future's callbacks are then to be deferred.
  bool runningAhead() const;
  // Whether the calling thread is within an IssueOrder of this thread (a future's completion).
  bool ordering() const;
  // Holds `callbacks` (a completed op's future's) until runDeferredCallbacks().
  void deferCallbacks(Task callbacks);
  // Called as the outermost callbacks on this thread return: runs the deferred ones in order,
  // and those they defer in turn, until none is left (at once where a run is under way).
  void runDeferredCallbacks();
  // Stops after the queued tasks have run. Idempotent.
  void stop();

 private:
  void loop();
  struct Queued {
    uint64_t number;
    Task task;
    std::chrono::steady_clock::time_point deferredAt;  // queued without a wake-up (else: epoch)
  };
  // Runs `task` as this thread's, marking the calling thread as running one (for nested issues).
  void runAsOwn(const Task& task);
  // Nested in a running task: takes the front of the queue if `take(its number)` and runs it.
  bool runFrontNested(const std::function<bool(uint64_t)>& take);
  // Under mutex_: takes the front task; the queue emptied, nothing is owed a wake-up any more.
  Task popFrontLocked();
  // Under mutex_, after a change that may need the sleeping thread: whether the caller must
  // notify it (after unlocking: the woken thread takes mutex_ first thing).
  bool wakeNeededLocked() const;
  // A task issued nested: the queued ones the calling thread's IssueOrder puts first, then it.
  void runNested(const Task& task);
  std::atomic<int64_t> callbacksSince_{0};
  // After tasks run on a caller's thread: clears busy_ and wakes the thread if it has work or
  // stop() waits for it.
  void releaseToThread();

  std::string name_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;
  // deferCallbacks(): touched only by whoever runs this thread's tasks, one at a time.
  std::deque<Task> deferredCallbacks_;
  bool runningDeferred_ = false;
  std::atomic<uint64_t> issued_{0};  // changed under mutex_
  bool stopping_ = false;
  bool busy_ = false;      // a task is running, on the thread or inline
  bool sleeping_ = false;  // the thread waits on cv_ (only then is a notify needed)
  bool dozing_ = false;    // ...for at most wakeDelay_
  bool hurried_ = false;   // a task queued is owed a wake-up now, until the queue is empty
  std::atomic<size_t> queued_{0};
  std::chrono::microseconds linger_;
  std::chrono::microseconds wakeDelay_;
  // Waits that came within wakeDelay_ of their task's issue, in a row (noteWait(); capped).
  std::atomic<int> soonWaits_{0};
  std::atomic<int64_t> sliceMicros_;  // written by the thread only
  // Under mutex_, the thread after a doze slice: lengthens the next one when nothing came, or
  // ends the deferral when the task queued first has waited wakeDelay_ for anyone to run it.
  void afterDozeLocked(bool timedOut);
  std::thread thread_;
};

}  // namespace smddp::engine
