// Flag words in mapped pinned memory, through which a stream and host threads tell each other how
// far they got without either synchronising with the other (GDRCopy-style): a stream writes or
// waits on a word with DeviceOps::signal / waitFor, a host thread polls it or stores to it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "cuda/device_ops.h"

namespace smddp::cuda {

// `count` counters, each on its own cache line, all starting at 0.
class FlagWords {
 public:
  FlagWords(DeviceOps& ops, int count);
  ~FlagWords() { ops_.hostFree(words_); }
  FlagWords(const FlagWords&) = delete;
  FlagWords& operator=(const FlagWords&) = delete;

  uint64_t* host(int i) const { return words_ + i * kStride; }
  uint64_t* device(int i) const { return device_ + i * kStride; }

 private:
  static constexpr int kStride = 64 / sizeof(uint64_t);
  DeviceOps& ops_;
  uint64_t* words_ = nullptr;
  uint64_t* device_ = nullptr;
};

// Host side: waits until the device has written at least `g` to `word`. Throws smddp::Error
// kAborted once `aborted` is set, kTimeout at `deadline`; `what` ("copy the op's data to pinned
// staging") and `unit` ("round") make the message.
void awaitFlag(const uint64_t* word, uint64_t g, std::chrono::steady_clock::time_point deadline,
               const std::atomic<bool>& aborted, const char* what, const char* unit);

// What abort() writes to a word the device waits on: it releases every number a counter can reach.
constexpr uint64_t kReleasedForever = ~uint64_t{0} >> 1;

// Host side: raises `word` to `g`, never lowering it.
void raiseFlag(uint64_t* word, uint64_t g);

}  // namespace smddp::cuda
