#include "engine/progress_thread.h"

#include <pthread.h>

#include <stdexcept>

namespace smddp::engine {

ProgressThread::ProgressThread(std::string name) : name_(std::move(name)) {
  thread_ = std::thread([this] { loop(); });
}

ProgressThread::~ProgressThread() { stop(); }

void ProgressThread::enqueue(Task task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw std::logic_error("smddp: operation issued after the process group was shut down");
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

bool ProgressThread::tryRunInline(const Task& task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ || busy_ || !queue_.empty()) return false;
    busy_ = true;
  }
  task();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ = false;
  }
  cv_.notify_one();  // something may have been queued meanwhile
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
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return !busy_ && (stopping_ || !queue_.empty()); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    task();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
    }
  }
}

}  // namespace smddp::engine
