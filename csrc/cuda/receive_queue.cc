#include "cuda/receive_queue.h"

namespace smddp::cuda {

uint64_t ReceiveQueue::enqueue(uint8_t* device, const uint8_t* host, size_t bytes, Stream s) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t k = next_;
  ops_.waitFor(flags_.device(kArrived), k, s);
  ops_.toDevice(host, Copy{device, bytes, 0, bytes, bytes, 1}, s);
  ops_.signal(flags_.device(kDelivered), k, s);
  ++next_;  // only once all three are queued: a failed enqueue leaves no number behind
  return k;
}

void ReceiveQueue::arrived(uint64_t k) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (k != published_ + 1) {
    early_.insert(k);
    return;
  }
  published_ = k;
  for (auto it = early_.begin(); it != early_.end() && *it == published_ + 1; it = early_.erase(it)) ++published_;
  raiseFlag(flags_.host(kArrived), published_);
}

void ReceiveQueue::awaitDelivered(uint64_t k, std::chrono::steady_clock::time_point deadline) {
  awaitFlag(flags_.host(kDelivered), k, deadline, aborted_, "copy a received message from pinned memory",
            "receive");
}

void ReceiveQueue::abort() {
  aborted_.store(true);
  raiseFlag(flags_.host(kArrived), kReleasedForever);
}

}  // namespace smddp::cuda
