// Receives of CUDA tensors. The message lands in pinned host memory whenever its peer sends it;
// the copy to the device is queued at call time, on a stream of its own, behind a wait on a flag
// word. So nothing calls into the driver when the message arrives (the engine thread that takes
// it must never queue behind a synchronous call of the user's), and a receive still waiting for
// its peer holds up neither the staging stream nor the progress thread: two ranks that each post
// a receive before the send the other waits for do not deadlock.
//
// The copies run in the order the receives were posted, as the stream takes them: the host
// publishes "receives 1..k have arrived" once all of them have, even when a later one came first.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>

#include "cuda/device_ops.h"
#include "cuda/flags.h"

namespace smddp::cuda {

class ReceiveQueue {
 public:
  explicit ReceiveQueue(DeviceOps& ops) : ops_(ops), flags_(ops, 2) {}
  ~ReceiveQueue() { abort(); }  // the owner waits for the stream to go idle before the flags go away
  ReceiveQueue(const ReceiveQueue&) = delete;
  ReceiveQueue& operator=(const ReceiveQueue&) = delete;

  // Caller's thread, in issue order: queues on `s` the copy of `bytes` from `host` (pinned) to
  // `device`, held until receive k has arrived, then "k is delivered". Returns k.
  uint64_t enqueue(uint8_t* device, const uint8_t* host, size_t bytes, Stream s);
  // Any thread, once per receive: its message is in host memory, or it failed (the copy then
  // moves bytes nobody reads, and the stream moves on).
  void arrived(uint64_t k);
  // Waits until receive k's data is in device memory: kTimeout at `deadline`, kAborted after abort().
  void awaitDelivered(uint64_t k, std::chrono::steady_clock::time_point deadline);
  // Releases every copy queued now or later, so the stream never waits on a host that stopped.
  void abort();

  uint64_t arrivedValue() const { return __atomic_load_n(flags_.host(kArrived), __ATOMIC_ACQUIRE); }

 private:
  enum Flag { kArrived, kDelivered };  // host: receives 1..g are in host memory; device: their copies are done

  DeviceOps& ops_;
  FlagWords flags_;
  std::mutex mutex_;
  uint64_t next_ = 1;      // enqueue's numbering (0 is the flags' initial value)
  uint64_t published_ = 0;
  std::set<uint64_t> early_;  // arrived ahead of an earlier receive
  std::atomic<bool> aborted_{false};
};

}  // namespace smddp::cuda
