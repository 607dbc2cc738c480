#include "torch/cuda_path.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <algorithm>
#include <string>
#include <thread>

#include "core/env.h"
#include "core/error.h"
#include "core/log.h"

namespace smddp::torchext {
namespace {

// libsmddp_cuda.so sits next to this extension module.
cuda::DeviceOps* loadDeviceOps(const std::string& who) {
  Dl_info self{};
  TORCH_CHECK(dladdr(reinterpret_cast<void*>(&loadDeviceOps), &self) != 0 && self.dli_fname, who,
              ": cannot locate the smddp extension module");
  std::string dir(self.dli_fname);
  dir = dir.substr(0, dir.rfind('/') + 1);
  const std::string path = dir + "libsmddp_cuda.so";
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK_NOT_IMPLEMENTED(lib != nullptr, who,
                              ": CUDA tensors need libsmddp_cuda.so, which this build of smddp does not have (",
                              dlerror(), "); rebuild smddp on a machine where nvcc is on PATH");
  using Factory = cuda::DeviceOps* (*)(int);
  auto factory = reinterpret_cast<Factory>(dlsym(lib, "smddp_cuda_device_ops"));
  TORCH_CHECK(factory != nullptr, who, ": ", path, " has no smddp_cuda_device_ops");
  const std::string& mode = env::cudaFlags();
  int m = kSmddpFlagsAuto;
  if (mode == "kernel") {
    m = kSmddpFlagsKernel;
  } else if (mode == "memops") {
    m = kSmddpFlagsMemOps;
  }
  try {
    return factory(m);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, who, ": ", e.what());
  }
}

}  // namespace

CudaPath::CudaPath(int rank, std::string who, c10::Device device)
    : rank_(rank), who_(std::move(who)), device_(device) {
  c10::DeviceGuard guard(device_);  // first: loading checks the current device's capabilities
  ops_ = loadDeviceOps(who_);
  const int64_t bytes = env::cudaStagingBytes();  // at least 4096 (env.cc)
  try {
    stream_ = ops_->createStream();
    receiveStream_ = ops_->createStream();
    for (cuda::Stream s : {stream_, receiveStream_}) {
      if (asTorchStream(s).native_handle() != s) {
        throw std::runtime_error("this torch does not name an external CUDA stream by its handle, which smddp's "
                                 "futures rely on (a torch version smddp was not built for?)");
      }
    }
    callerReady_ = ops_->createEvent();
    pipeline_ = std::make_unique<cuda::StagingPipeline>(*ops_, static_cast<size_t>(bytes));
    receives_ = std::make_unique<cuda::ReceiveQueue>(*ops_);
    const size_t cap = static_cast<size_t>(std::max<int64_t>(cuda::kStagingAlign, env::cudaRoundBytes()));
    pipelinedRoundBytes_ = std::min(pipeline_->roundCapacity(), cap / cuda::kStagingAlign * cuda::kStagingAlign);
    completer_ = std::make_unique<engine::ProgressThread>("smddp-cuda" + std::to_string(rank),
                                                          std::chrono::microseconds(0));
  } catch (const std::exception& e) {
    pipeline_.reset();  // before the streams: nothing was queued on them yet
    receives_.reset();
    if (callerReady_) ops_->destroyEvent(callerReady_);
    if (receiveStream_) ops_->destroyStream(receiveStream_);
    if (stream_) ops_->destroyStream(stream_);
    TORCH_CHECK(false, who_, ": setting up CUDA staging on ", device_, ": ", e.what());
  }
  SMDDP_INFO(kInit, "rank %d: CUDA staging on %s: %lld bytes pinned, flags by %s", rank, device_.str().c_str(),
             static_cast<long long>(bytes), ops_->flagMechanism());
}

CudaPath::~CudaPath() {
  abort();
  // Memory may be freed only once the streams stopped using it: the queued Works' tensors and
  // messages (dropped as the completion thread finishes them), the pinned staging. A stream stuck
  // behind a kernel that never ends would hold us forever: give them a few seconds, then leak.
  bool idle = false;
  try {
    for (int i = 0; i < 5000 && !(idle = ops_->streamIdle(stream_) && ops_->streamIdle(receiveStream_)); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  } catch (const std::exception&) {
  }
  completer_->stop();  // finishes the Works still queued
  if (idle) {
    pipeline_.reset();
    receives_.reset();
    held_.clear();
  } else {
    SMDDP_WARN(kInit, "rank %d: a CUDA stream of the group is still busy at shutdown; its pinned memory is not freed",
               rank_);
    (void)pipeline_.release();
    (void)receives_.release();
    (void)new std::vector<at::Tensor>(std::move(held_));  // leaked with the staging
  }
  ops_->destroyEvent(callerReady_);
  ops_->destroyStream(receiveStream_);
  ops_->destroyStream(stream_);
}

void CudaPath::holdForStream(const std::vector<at::Tensor>& tensors, c10::Stream stream) {
  c10::impl::VirtualGuardImpl impl(device_.type());
  std::lock_guard<std::mutex> lock(heldMutex_);
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    if (t.is_cuda()) {
      impl.recordDataPtrOnStream(t.storage().data_ptr(), stream);
    } else {
      held_.push_back(t);
    }
  }
}

void CudaPath::completeLater(std::function<void()> finish) {
  try {
    completer_->enqueue(std::move(finish));
  } catch (const std::logic_error&) {  // stopping: finish here (shutdown's last ops)
    finish();
  }
}

void CudaPath::followCaller(cuda::Stream s) {
  c10::impl::VirtualGuardImpl impl(device_.type());
  void* caller = impl.getStream(device_).native_handle();
  // Captured, the op's copies and flag writes would be recorded into the graph instead of run,
  // while its host side waits for them: the group would time out and break. NCCL's kernels can
  // be captured; smddp's host reduction cannot.
  if (ops_->streamCapturing(caller)) {
    throw CaptureRefused(who_ + ": CUDA graph capture of smddp ops is not supported (the reduction runs on the host, "
                                "outside the graph); issue the op outside the captured region");
  }
  ops_->recordEvent(callerReady_, caller);
  ops_->streamWaitEvent(s, callerReady_);
}

CudaPath::Launch CudaPath::launch(const std::vector<cuda::Round>& rounds) {
  c10::DeviceGuard guard(device_);
  Launch l;
  try {
    followCaller(stream_);
    l.ticket = pipeline_->enqueue(rounds, stream_);
    for (size_t i = 0; i < rounds.size(); ++i) l.bases.push_back(pipeline_->stagingOf(l.ticket, rounds, i));
  } catch (const std::length_error& e) {
    TORCH_CHECK_VALUE(false, who_, ": ", e.what(), "; raise SMDDP_CUDA_STAGING_BYTES");
  } catch (const CaptureRefused& e) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, e.what());
  } catch (const std::exception& e) {  // enqueue released whatever it had queued
    TORCH_CHECK(false, who_, ": ", e.what());
  }
  return l;
}

uint64_t CudaPath::launchReceive(uint8_t* device, const uint8_t* host, size_t bytes) {
  c10::DeviceGuard guard(device_);
  try {
    followCaller(receiveStream_);
    return receives_->enqueue(device, host, bytes, receiveStream_);
  } catch (const CaptureRefused& e) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, e.what());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, who_, ": ", e.what());
  }
}

void CudaPath::runHost(const Launch& l, const std::vector<CudaStep>& steps, algo::Communicator& c,
                       std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const algo::Communicator::NoPeerReads pinned(c);  // the steps' buffers are the driver's pinned staging
  try {
    for (size_t i = 0; i < steps.size(); ++i) {
      pipeline_->awaitRound(l.ticket, i, deadline);
      steps[i](c, timeout);
      pipeline_->finishRound(l.ticket, i);
    }
    pipeline_->awaitCopiedBack(l.ticket, deadline);
  } catch (...) {
    pipeline_->releaseAll(l.ticket);
    throw;
  }
}

}  // namespace smddp::torchext
