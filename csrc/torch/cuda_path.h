// CUDA tensors in a process group: the glue between c10's device-generic streams and the
// torch-free staging pipeline (csrc/cuda/staging.h). The CUDA code itself lives in
// libsmddp_cuda.so, loaded at the first CUDA tensor, so this file and the extension build and
// import against the CPU wheel of torch; a CUDA tensor given to a build without that library
// gets a clear NotImplementedError.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "algo/communicator.h"
#include "cuda/receive_queue.h"
#include "cuda/staging.h"
#include "engine/progress_thread.h"

namespace smddp::torchext {

// The host work of one staging round (it captures the round's staging pointers).
using CudaStep = std::function<void(algo::Communicator&, std::chrono::milliseconds)>;

class CudaPath {
 public:
  // One per process group, bound to the first CUDA device it sees. Creates a dedicated stream
  // and allocates SMDDP_CUDA_STAGING_BYTES of pinned staging.
  // `who`: this rank as messages name it (rankName()).
  CudaPath(int rank, std::string who, c10::Device device);
  ~CudaPath();  // releases every waiting stream, then frees the staging once the stream is idle

  c10::Device device() const { return device_; }
  // The most one round can stage (ops that need all their data on the host at once).
  size_t roundCapacity() const { return pipeline_->roundCapacity(); }
  // The round size of ops cut into many rounds (SMDDP_CUDA_ROUND_BYTES, at most the capacity).
  size_t pipelinedRoundBytes() const { return pipelinedRoundBytes_; }
  // Where the next op's first round will be staged; the caller holds the issue lock until it
  // has launched that op.
  uint8_t* nextStaging() const { return pipeline_->nextStaging(); }

  struct Launch {
    cuda::Ticket ticket;
    std::vector<uint8_t*> bases;  // each round's staging
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
  // Progress thread, once an op is done: runs `finish` (completing the Work, dropping the op's
  // tensors and maybe the Work, whose future holds a CUDA event) on a thread of its own. The
  // progress thread must never enter the CUDA driver, where it can queue behind a synchronous
  // copy on the user's thread that waits for a later op, i.e. for the progress thread (a
  // deadlock seen on an H100, then through an event destroyed by a Work).
  void completeLater(std::function<void()> finish);
  // Receives (see cuda/receive_queue.h). Caller's thread: the copy of the message from `host`
  // (pinned, alive until awaitDelivered returns) to `device`, on the receive stream behind the
  // caller's current stream. Returns the receive's number.
  uint64_t launchReceive(uint8_t* device, const uint8_t* host, size_t bytes);
  // The staging and receive streams as torch's external streams, on which a Work's future
  // records the point where the op's results are in device memory.
  c10::Stream stagingStream() const { return asTorchStream(stream_); }
  c10::Stream receiveStream() const { return asTorchStream(receiveStream_); }
  // Any thread (no driver call): receive `number`'s message is in `host` (or failed).
  void received(uint64_t number) { receives_->arrived(number); }
  // Completion thread: waits until receive `number` is in device memory.
  void awaitDelivered(uint64_t number, std::chrono::milliseconds timeout) {
    receives_->awaitDelivered(number, std::chrono::steady_clock::now() + timeout);
  }

  // After a failure, where `stream` may still copy into or out of `tensors` (the op's rounds were
  // released, or it was never waited for): device tensors are recorded on `stream` for torch's
  // caching allocator, which then reuses their memory only once the stream has passed this
  // point; host ones (pinned memory of the op's own) are kept until the group ends. Any thread
  // that may enter the allocator (not the progress thread).
  void holdForStream(const std::vector<at::Tensor>& tensors, c10::Stream stream);

  // Unblocks every stream and host waiter for good (group shutdown).
  void abort() {
    pipeline_->abort();
    receives_->abort();
  }

 private:
  // Caller's thread, device guard held: later work on `s` waits for what the caller's current
  // stream holds now. Throws CaptureRefused while that stream is being captured into a graph.
  void followCaller(cuda::Stream s);
  struct CaptureRefused : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  // torch's id of an external CUDA stream is its handle (c10::cuda::getStreamFromExternal, which
  // lives in libc10_cuda, which this extension does not link); the constructor checks that this
  // torch reads it back as that handle.
  c10::Stream asTorchStream(cuda::Stream s) const {
    return c10::Stream(c10::Stream::UNSAFE, device_, reinterpret_cast<c10::StreamId>(s));
  }

  int rank_;
  std::string who_;
  c10::Device device_;
  cuda::DeviceOps* ops_ = nullptr;
  cuda::Stream stream_ = nullptr;
  cuda::Stream receiveStream_ = nullptr;
  void* callerReady_ = nullptr;  // reused: recorded on the caller's stream at each launch
  std::unique_ptr<cuda::StagingPipeline> pipeline_;
  std::unique_ptr<cuda::ReceiveQueue> receives_;
  size_t pipelinedRoundBytes_ = 0;
  std::unique_ptr<engine::ProgressThread> completer_;
  std::mutex heldMutex_;
  std::vector<at::Tensor> held_;  // holdForStream's host tensors, freed once the streams are idle
};

}  // namespace smddp::torchext
