#include "engine/progress_thread.h"

#include <pthread.h>

#include <algorithm>
#include <stdexcept>

#include "core/spin.h"

namespace smddp::engine {
namespace {
// The progress thread whose task the calling thread is running, if any.
thread_local const ProgressThread* tlsRunning = nullptr;
// The innermost IssueOrder of the calling thread.
thread_local const ProgressThread* tlsOrderThread = nullptr;
thread_local uint64_t tlsOrderBefore = 0;
// The progress thread whose queued task the calling thread runs within callbacks (runningAhead).
thread_local const ProgressThread* tlsAhead = nullptr;
}  // namespace

ProgressThread::IssueOrder::IssueOrder(const ProgressThread* thread, uint64_t before)
    : outerThread_(tlsOrderThread), outerBefore_(tlsOrderBefore) {
  tlsOrderThread = thread;
  tlsOrderBefore = before;
}

ProgressThread::IssueOrder::~IssueOrder() {
  tlsOrderThread = outerThread_;
  tlsOrderBefore = outerBefore_;
}

ProgressThread::ProgressThread(std::string name, std::chrono::microseconds linger,
                               std::chrono::microseconds wakeDelay)
    : name_(std::move(name)),
      linger_(linger),
      wakeDelay_(wakeDelay),
      sliceMicros_(wakeDelay.count()) {
  thread_ = std::thread([this] { loop(); });
}

ProgressThread::~ProgressThread() { stop(); }

bool ProgressThread::wakeNeededLocked() const {
  if (!sleeping_) return false;  // it looks at the queue before it sleeps again
  if (stopping_) return true;
  if (busy_ || queue_.empty()) return false;  // whoever runs a task wakes it at the end (releaseToThread)
  return hurried_ || !dozing_;
}

ProgressThread::Task ProgressThread::popFrontLocked() {
  Task task = std::move(queue_.front().task);
  queue_.pop_front();
  queued_.store(queue_.size(), std::memory_order_release);
  if (queue_.empty()) hurried_ = false;
  return task;
}

bool ProgressThread::runningHere() const { return tlsRunning == this; }

ProgressThread::InCallbacks::InCallbacks(ProgressThread& thread)
    : thread_(thread), outer_(thread.callbacksSince_.load(std::memory_order_relaxed)) {
  if (outer_ == 0) {
    const auto now = std::chrono::steady_clock::now().time_since_epoch();
    thread_.callbacksSince_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count(),
                                  std::memory_order_release);
  }
}

ProgressThread::InCallbacks::~InCallbacks() { thread_.callbacksSince_.store(outer_, std::memory_order_release); }

void ProgressThread::runAsOwn(const Task& task) {
  const ProgressThread* outer = tlsRunning;
  tlsRunning = this;
  task();
  tlsRunning = outer;
}

bool ProgressThread::runFrontNested(const std::function<bool(uint64_t)>& take) {
  Task task;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.empty() || !take(queue_.front().number)) return false;
    task = popFrontLocked();
  }
  const ProgressThread* outerAhead = tlsAhead;
  tlsAhead = ordering() ? this : nullptr;
  runAsOwn(task);
  tlsAhead = outerAhead;
  return true;
}

bool ProgressThread::runningAhead() const { return tlsAhead == this; }

bool ProgressThread::ordering() const { return tlsOrderThread == this; }

void ProgressThread::deferCallbacks(Task callbacks) { deferredCallbacks_.push_back(std::move(callbacks)); }

void ProgressThread::runDeferredCallbacks() {
  if (runningDeferred_) return;  // the run under way takes those deferred meanwhile
  runningDeferred_ = true;
  struct Done {
    bool& running;
    ~Done() { running = false; }  // a callback that throws must not hold back later runs
  } done{runningDeferred_};
  while (!deferredCallbacks_.empty()) {
    Task callbacks = std::move(deferredCallbacks_.front());
    deferredCallbacks_.pop_front();
    callbacks();
  }
}

void ProgressThread::runNested(const Task& task) {
  const uint64_t before = tlsOrderThread == this ? tlsOrderBefore : 0;
  while (runFrontNested([before](uint64_t number) { return number < before; })) {
  }
  task();
}

void ProgressThread::enqueue(Task&& task, bool deferWake) {
  if (runningHere()) {
    runNested(task);
    return;
  }
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw std::logic_error("smddp: operation issued after the process group was shut down");
    const bool deferred = deferWake && deferring();
    queue_.push_back({issued_.load(std::memory_order_relaxed), std::move(task),
                      deferred ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{}});
    issued_.fetch_add(1, std::memory_order_release);
    queued_.store(queue_.size(), std::memory_order_release);
    if (!deferred) hurried_ = true;
    wake = wakeNeededLocked();
  }
  if (wake) cv_.notify_one();
}

void ProgressThread::noteWait(std::chrono::nanoseconds sinceIssue) {
  if (wakeDelay_.count() == 0) return;
  const int soon = soonWaits_.load(std::memory_order_relaxed);
  // Racing waiters of one group may lose a count: it only delays or hastens the switch.
  soonWaits_.store(sinceIssue <= wakeDelay_ ? std::min(soon + 1, kDeferAfter) : 0, std::memory_order_relaxed);
}

void ProgressThread::hurry() {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.empty()) return;  // what the caller waits for has been taken already
    hurried_ = true;
    wake = wakeNeededLocked();
  }
  if (wake) cv_.notify_one();
}

bool ProgressThread::tryRunInline(const Task& task) {
  if (runningHere()) {
    runNested(task);
    return true;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ || busy_ || !queue_.empty()) return false;
    busy_ = true;
  }
  runAsOwn(task);
  releaseToThread();
  return true;
}

void ProgressThread::releaseToThread() {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ = false;
    // Something was queued meanwhile, or stop() waits for the thread to see the task end.
    wake = wakeNeededLocked();
  }
  if (wake) cv_.notify_one();
}

bool ProgressThread::runQueuedUntil(const std::function<bool()>& done) {
  if (runningHere()) {
    bool ran = false;
    while (!done() && runFrontNested([](uint64_t) { return true; })) ran = true;
    return ran;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (busy_ || queue_.empty()) return false;
    busy_ = true;
  }
  do {
    Task task;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (queue_.empty()) break;
      task = popFrontLocked();
    }
    runAsOwn(task);
  } while (!done());
  releaseToThread();  // what is queued behind it is the thread's again
  return true;
}

void ProgressThread::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void ProgressThread::afterDozeLocked(bool timedOut) {
  if (!timedOut) return;  // woken for a task owed a wake-up, or by stop()
  const int64_t slice = sliceMicros_.load(std::memory_order_relaxed);
  if (busy_ || queue_.empty()) {  // nothing for the thread: its issuers ran everything
    sliceMicros_.store(std::min(slice * 2, wakeDelay_.count() * kMaxSliceFactor), std::memory_order_relaxed);
    return;
  }
  const auto deferredAt = queue_.front().deferredAt;
  if (deferredAt != std::chrono::steady_clock::time_point{} &&
      std::chrono::steady_clock::now() - deferredAt >= wakeDelay_) {
    soonWaits_.store(0, std::memory_order_relaxed);
    sliceMicros_.store(wakeDelay_.count(), std::memory_order_relaxed);
  }
}

void ProgressThread::loop() {
  pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
  uint64_t seen = 0;  // issued() when the thread last looked
  auto dozeUntil = std::chrono::steady_clock::time_point::min();
  while (true) {
    Task task;
    spinUntil(linger_, [this] { return queued_.load(std::memory_order_acquire) != 0; });
    {
      std::unique_lock<std::mutex> lock(mutex_);
      while (busy_ || (!stopping_ && queue_.empty())) {
        // Ops keep coming, waited for soon: doze, so that a deferrable one needs no wake-up
        // (wakeNeededLocked), until kDozeWindow passes without one.
        const uint64_t issued = issued_.load(std::memory_order_relaxed);
        bool doze = false;
        if (deferring()) {
          const auto now = std::chrono::steady_clock::now();
          if (issued != seen) {
            seen = issued;
            dozeUntil = now + kDozeWindow;
          }
          doze = now < dozeUntil;
        }
        dozing_ = doze;
        sleeping_ = true;
        if (dozing_) {
          const bool timedOut =
              cv_.wait_for(lock, std::chrono::microseconds(sliceMicros_.load(std::memory_order_relaxed))) ==
              std::cv_status::timeout;
          afterDozeLocked(timedOut);
        } else {
          sliceMicros_.store(wakeDelay_.count(), std::memory_order_relaxed);
          cv_.wait(lock);
        }
        sleeping_ = false;
        dozing_ = false;
      }
      if (queue_.empty()) return;  // stopping and drained
      task = popFrontLocked();
      busy_ = true;
    }
    runAsOwn(task);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
    }
  }
}

}  // namespace smddp::engine
