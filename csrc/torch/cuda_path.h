// CUDA tensors in a process group: the glue between c10's device-generic streams and the
// torch-free staging pipeline (csrc/cuda/staging.h). The CUDA code itself lives in
// libsmddp_cuda.so, loaded at the first CUDA tensor, so this file and the extension build and
// import against the CPU wheel of torch; a CUDA tensor given to a build without that library
// gets a clear NotImplementedError.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "algo/communicator.h"
#include "cuda/staging.h"

namespace smddp::torchext {

// The host work of one staging round (it captures the round's staging pointers).
using CudaStep = std::function<void(algo::Communicator&, std::chrono::milliseconds)>;

class CudaPath {
 public:
  // One per process group, bound to the first CUDA device it sees. Creates a dedicated stream
  // and allocates SMDDP_CUDA_STAGING_BYTES of pinned staging.
  CudaPath(int rank, c10::Device device);
  ~CudaPath();  // releases every waiting stream, then frees the staging once the stream is idle

  c10::Device device() const { return device_; }
  size_t roundBytes() const { return pipeline_->roundCapacity(); }
  cuda::DeviceOps& ops() { return *ops_; }
  // Where the next op's first round will be staged; the caller holds the issue lock until it
  // has launched that op.
  uint8_t* nextStaging() const { return pipeline_->nextStaging(); }

  struct Launch {
    cuda::Ticket ticket;
    std::vector<uint8_t*> bases;  // each round's staging
    void* doneEvent = nullptr;    // recorded after the last copy back; the Work owns it
  };
  // Caller's thread, in issue order: the side stream waits for the caller's current stream, then
  // takes the rounds' copies and flags.
  Launch launch(const std::vector<cuda::Round>& rounds);
  // Progress thread: each round's host step in turn, then waits until the results are back in
  // device memory. On failure releases the op's rounds (the stream moves on) and rethrows.
  void runHost(const Launch& l, const std::vector<CudaStep>& steps, algo::Communicator& c,
               std::chrono::milliseconds timeout);
  // After a launch whose host side will never run (the group shut down meanwhile).
  void release(const Launch& l) { pipeline_->releaseAll(l.ticket); }
  // Makes the caller's current stream on this device wait for `event`.
  void blockCurrentStream(void* event);
  // A Work is done with its event. Any thread, and no CUDA call: the progress thread must never
  // enter the driver, where it can queue behind a synchronous copy on the user's thread that is
  // itself waiting for the progress thread (a deadlock seen on a GPU). Events are reused.
  void recycleEvent(void* event);
  // Unblocks every stream and host waiter for good (group shutdown).
  void abort() { pipeline_->abort(); }

 private:
  int rank_;
  c10::Device device_;
  cuda::DeviceOps* ops_ = nullptr;
  cuda::Stream stream_ = nullptr;
  void* callerReady_ = nullptr;  // reused: recorded on the caller's stream at each launch
  std::unique_ptr<cuda::StagingPipeline> pipeline_;
  std::mutex eventsMutex_;
  std::vector<void*> freeEvents_;
};

}  // namespace smddp::torchext
