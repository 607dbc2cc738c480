// Pinned staging for CUDA tensors, as SMDDP does it: the GPU's copy engines move data into
// page-locked host memory, CPU threads reduce and exchange it with the host transports, and the
// copy engines move the result back. No SM time is spent on the reduction and no host thread
// ever synchronises with a stream: each side learns about the other from a flag word in mapped
// host memory.
//
// A collective is cut into rounds that fit half of a fixed, reused staging buffer
// (SMDDP_CUDA_STAGING_BYTES); rounds alternate halves, so the device copies of round k+1 overlap
// the host work of round k. Everything device-side is enqueued at call time on one side stream:
//
//   toHost(0) ready(0) toHost(1) ready(1) wait(0) toDevice(0) toHost(2) ready(2) wait(1) toDevice(1) ...
//
// `ready`, `done` and `back` are counters numbered by round across the pipeline's life: the device
// writes ready = g after round g's data is in staging, the host writes done = g after round g's
// results are, and the device writes back = g (at an op's last round) once they are on the
// device. A half is rewritten only by toHost(g+2), which the stream runs after toDevice(g).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

#include "cuda/device_ops.h"
#include "cuda/flags.h"

namespace smddp::cuda {

struct Round {
  size_t stagingBytes = 0;     // bytes of the half this round uses
  std::vector<Copy> toHost;    // device -> staging, before the host work
  std::vector<Copy> toDevice;  // staging -> device, after it
  // Which part of the op the round covers (elements), for the host work.
  size_t offset = 0;
  size_t count = 0;
  // Pinned memory of the op's own for a round that must be staged whole and exceeds a half
  // (list forms of all_gather, gather, scatter, all_to_all); null = the pipeline's half. The
  // round still takes its turn in the numbering, so the flags order it like any other.
  uint8_t* host = nullptr;
};

// The rounds of one op, as enqueued: global round numbers first .. first + rounds - 1.
struct Ticket {
  uint64_t first = 0;
  size_t rounds = 0;
};

class StagingPipeline {
 public:
  // Allocates `capacityBytes` of pinned staging (two halves) and the flag words.
  StagingPipeline(DeviceOps& ops, size_t capacityBytes);
  ~StagingPipeline();  // releases the device side (abort()) and frees the memory
  StagingPipeline(const StagingPipeline&) = delete;
  StagingPipeline& operator=(const StagingPipeline&) = delete;

  size_t roundCapacity() const { return half_; }

  // Caller's thread, in issue order: enqueues the device side of `rounds` on `stream`, ending
  // with a signal that the op's results are back on the device. Throws std::length_error if a
  // round without memory of its own does not fit a half (nothing enqueued then), and what a
  // device call throws: the op's copies enqueued so far stay on the stream, its rounds spent and
  // released (its outputs are undefined; later ops are not affected).
  Ticket enqueue(const std::vector<Round>& rounds, Stream stream);
  // Where the next op's first round will be staged, while the caller keeps enqueues serialised.
  uint8_t* nextStaging() const { return buffer_ + (nextRound_ % 2) * half_; }
  // Where round i of `t` (enqueued as `rounds`) is staged: its own memory, or its half.
  uint8_t* stagingOf(const Ticket& t, const std::vector<Round>& rounds, size_t i) const {
    return rounds[i].host ? rounds[i].host : buffer_ + ((t.first + i) % 2) * half_;
  }

  // Host side, on the thread that runs the ops in issue order. Waits until round i of `t` is in
  // staging; throws smddp::Error (kTimeout) at `deadline`, (kAborted) after abort().
  void awaitRound(const Ticket& t, size_t i, std::chrono::steady_clock::time_point deadline);
  // Round i's results are in staging: the device may copy them back.
  void finishRound(const Ticket& t, size_t i);
  // Waits until the device has copied all of `t`'s results back (same errors as awaitRound).
  void awaitCopiedBack(const Ticket& t, std::chrono::steady_clock::time_point deadline);
  // After a failure: releases every round of `t`, so the stream moves on (its outputs then hold
  // whatever was in staging; the op reports the error).
  void releaseAll(const Ticket& t);
  // Releases every round ever enqueued, now and later, so no stream waits on a host that stopped.
  void abort();

  uint64_t readyValue() const { return __atomic_load_n(flags_.host(kReady), __ATOMIC_ACQUIRE); }
  uint64_t doneValue() const { return __atomic_load_n(flags_.host(kDone), __ATOMIC_ACQUIRE); }

 private:
  void publishDone(uint64_t g);

  enum Flag { kReady, kDone, kBack };  // device: round g is in staging; host: its results are; device: they are back

  DeviceOps& ops_;
  size_t half_;
  uint8_t* buffer_ = nullptr;
  FlagWords flags_;
  std::mutex enqueueMutex_;
  uint64_t nextRound_ = 1;  // 0 is the flags' initial value
  std::atomic<bool> aborted_{false};
};

// Offsets inside a round are multiples of this, which suits any copy engine.
constexpr size_t kStagingAlign = 256;
inline size_t alignStaging(size_t v) { return (v + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

// Round plans. `roundBytes` is the half capacity; element size `es`.

// An in-place elementwise op (allreduce, reduce, broadcast) over `count` elements at `device`.
// `copyIn`/`copyOut` say whether this rank's data goes to the host and comes back.
std::vector<Round> planFlat(uint8_t* device, size_t count, size_t es, size_t roundBytes, bool copyIn, bool copyOut);
// All-gather of `n` elements per rank into a [world, n] output: each round covers columns
// [offset, offset + count) of every rank's block; staging holds the input piece, then the
// world pieces of the output.
std::vector<Round> planGather(const uint8_t* input, uint8_t* output, size_t n, int world, size_t es,
                              size_t roundBytes);
// Reduce-scatter of a [world, n] input into `n` elements: the mirror image of planGather (the
// world input pieces first, then the output piece).
std::vector<Round> planScatter(const uint8_t* input, uint8_t* output, size_t n, int world, size_t es,
                               size_t roundBytes);

}  // namespace smddp::cuda
