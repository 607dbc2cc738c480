#include "engine/progress_thread.h"

#include <pthread.h>

#include <stdexcept>

#include "core/spin.h"

namespace smddp::engine {
namespace {
// The progress thread whose task the calling thread is running, if any.
thread_local const ProgressThread* tlsRunning = nullptr;
// The innermost IssueOrder of the calling thread.
thread_local const ProgressThread* tlsOrderThread = nullptr;
thread_local uint64_t tlsOrderBefore = 0;
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

ProgressThread::ProgressThread(std::string name, std::chrono::microseconds linger)
    : name_(std::move(name)), linger_(linger) {
  thread_ = std::thread([this] { loop(); });
}

ProgressThread::~ProgressThread() { stop(); }

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
    task = std::move(queue_.front().task);
    queue_.pop_front();
    queued_.store(queue_.size(), std::memory_order_release);
  }
  runAsOwn(task);
  return true;
}

void ProgressThread::runNested(const Task& task) {
  const uint64_t before = tlsOrderThread == this ? tlsOrderBefore : 0;
  while (runFrontNested([before](uint64_t number) { return number < before; })) {
  }
  task();
}

void ProgressThread::enqueue(Task task) {
  if (runningHere()) {
    runNested(task);
    return;
  }
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw std::logic_error("smddp: operation issued after the process group was shut down");
    queue_.push_back({issued_.load(std::memory_order_relaxed), std::move(task)});
    issued_.fetch_add(1, std::memory_order_release);
    queued_.store(queue_.size(), std::memory_order_release);
    wake = sleeping_;
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
    wake = sleeping_ && (stopping_ || !queue_.empty());
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
      task = std::move(queue_.front().task);
      queue_.pop_front();
      queued_.store(queue_.size(), std::memory_order_release);
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

void ProgressThread::loop() {
  pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
  while (true) {
    Task task;
    spinUntil(linger_, [this] { return queued_.load(std::memory_order_acquire) != 0; });
    {
      std::unique_lock<std::mutex> lock(mutex_);
      sleeping_ = true;
      cv_.wait(lock, [this] { return !busy_ && (stopping_ || !queue_.empty()); });
      sleeping_ = false;
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front().task);
      queue_.pop_front();
      queued_.store(queue_.size(), std::memory_order_release);
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
