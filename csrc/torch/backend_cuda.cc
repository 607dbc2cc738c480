// SmddpBackend's CUDA ops: each one becomes rounds of pinned staging (csrc/cuda/staging.h)
// whose device side goes on the group's staging stream at call time and whose host side (the
// CPU collective on the staged data) runs on the progress thread in issue order.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/error.h"
#include "core/log.h"
#include "torch/backend.h"
#include "torch/staged.h"

namespace smddp::torchext {
namespace {

// Pinned host memory of its own for one op (torch's caching host allocator). A failure (the
// host's locked-memory limit, a CUDA error) raises torch's error with this rank and op named,
// keeping its type: an out-of-memory stays torch.OutOfMemoryError.
at::Tensor pinnedBytes(size_t bytes, const std::string& who, const char* op) {
  try {
    return at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  } catch (const c10::OutOfMemoryError& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, who, ": ", op, ": allocating ", bytes,
                     " bytes of pinned host memory failed: ", e.what_without_backtrace());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, who, ": ", op, ": allocating ", bytes, " bytes of pinned host memory failed: ",
                e.what_without_backtrace());
  }
}

// Set while cudaWhole runs an op's CPU twin on host mirrors: the twin's enqueue lands here.
struct WholeOp {
  std::vector<cuda::Round> rounds;
  std::vector<at::Tensor> outputs, inputs;  // the device tensors
  at::Tensor ownStaging;                    // pinned, when the round is larger than a half
  bool used = false;
};
thread_local WholeOp* tlsWholeOp = nullptr;

}  // namespace

bool SmddpBackend::isCudaOp(const Tensors& tensors, const char* op) const {
  size_t cudaCount = 0;
  for (const at::Tensor& t : tensors) cudaCount += t.defined() && t.is_cuda();
  if (cudaCount == 0) return false;
  TORCH_CHECK_VALUE(cudaCount == tensors.size(), who(), ": ", op,
                    ": got both CUDA and CPU tensors; all tensors of one op must be on the same device");
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK_VALUE(t.device() == tensors[0].device(), who(), ": ", op, ": tensors on ",
                      tensors[0].device(), " and ", t.device(), "; all tensors of one op must be on the same device");
    TORCH_CHECK_VALUE(t.is_contiguous(), who(), ": ", op,
                      ": CUDA tensors must be contiguous (as with NCCL); call .contiguous() first");
  }
  return true;
}

CudaPath& SmddpBackend::cudaPathFor(const Tensors& tensors, const char* op) {
  const c10::Device device = tensors.at(0).device();
  if (!cuda_) cuda_ = std::make_shared<CudaPath>(rank_, who(), device);
  TORCH_CHECK_VALUE(cuda_->device() == device, who(), ": ", op, ": this process group uses ",
                    cuda_->device(), " and got a tensor on ", device,
                    "; use one CUDA device per process (torch.cuda.set_device(local_rank))");
  return *cuda_;
}

void SmddpBackend::eagerConnectSingleDevice(at::Device device) {
  if (!device.is_cuda()) return;
  std::lock_guard<std::recursive_mutex> lock(cudaMutex_);
  if (cuda_) return;
  try {
    cuda_ = std::make_shared<CudaPath>(rank_, who(), device);
  } catch (const std::exception& e) {
    SMDDP_WARN(kInit, "rank %d: setting up CUDA staging on %s at init failed (the first CUDA op will retry): %s",
               rank_, device.str().c_str(), messageOf(e).c_str());
  }
}

void SmddpBackend::throwIfCudaFailed(const char* op) {
  if (!cudaFailed_.load(std::memory_order_acquire)) return;  // every op passes here: no lock then
  std::lock_guard<std::mutex> lock(cudaFailureMutex_);
  if (cudaFailure_) std::rethrow_exception(cudaFailure_);
}

void SmddpBackend::recordCudaFailure(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(cudaFailureMutex_);
  if (!cudaFailure_) cudaFailure_ = std::move(error);
  cudaFailed_.store(true, std::memory_order_release);
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::enqueueCuda(
    c10d::OpType opType, const char* title, Tensors outputs, Tensors inputs, std::chrono::milliseconds timeout,
    const std::vector<cuda::Round>& rounds,
    const std::function<std::vector<CudaStep>(const CudaPath::Launch&)>& makeSteps, const Tensors& held,
    P2pPeer peer) {
  std::lock_guard<std::recursive_mutex> lock(cudaMutex_);
  throwIfCudaFailed(title);
  std::shared_ptr<CudaPath> path = cuda_;
  if (opType != c10d::OpType::SEND) issued_.fetch_add(1);  // collectives only, as for CPU tensors: p2p is one-sided
  // The tensors stay referenced until the device has copied the results back, so the caching
  // allocator cannot hand their memory to someone else while the staging stream still uses it.
  Tensors keep = outputs;
  keep.insert(keep.end(), inputs.begin(), inputs.end());
  keep.insert(keep.end(), held.begin(), held.end());
  auto work = newWork(opType, title, outputs, inputs, timeout, peer);
  const CudaPath::Launch launch = path->launch(rounds);
  try {
    work->setCuda(path->stagingStream(), inputs);
  } catch (...) {
    path->release(launch);
    throw;
  }
  std::vector<CudaStep> steps = makeSteps(launch);
  for (CudaStep& s : steps) s = describedBody(opType, title, outputs, inputs, std::move(s));
  algo::Communicator* comm = comm_.get();
  // A send that fails fails itself, as on the CPU path; a collective's failure breaks the group.
  const bool send = opType == c10d::OpType::SEND;
  auto task = [this, work, comm, path, launch, steps = std::move(steps), keep = std::move(keep), timeout,
               size = size_, title, send]() mutable {
    std::exception_ptr error;
    work->traceStarted();
    try {
      path->runHost(launch, steps, *comm, timeout);
    } catch (...) {
      error = send ? asTorchError(std::current_exception(), work->who()) : bodyError(*comm, work->who(), size, title);
    }
    if (error) recordCudaFailure(error);
    // The Work and the tensors go to the completion thread: dropping the last reference to a
    // tensor may enter the CUDA allocator, and to a Work destroys its future's CUDA event. After
    // a failure the stream may still copy into or out of them (the op's rounds were released).
    // A raw pointer: the CudaPath finishes its queued completions before it goes (cudaRecv).
    path->completeLater([p = path.get(), work = std::move(work), keep = std::move(keep), error]() {
      if (error) p->holdForStream(keep, p->stagingStream());
      work->complete(error);
    });
  };
  try {
    progress_->enqueue(std::move(task));
  } catch (const std::logic_error&) {
    path->release(launch);
    TORCH_CHECK(false, who(), ": ", title, ": the process group has been shut down");
  }
  return work;
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::cudaFlat(c10d::OpType opType, const char* title,
                                                      const Tensors& tensors, std::chrono::milliseconds timeout,
                                                      std::vector<FlatPart> parts) {
  std::lock_guard<std::recursive_mutex> lock(cudaMutex_);
  CudaPath& path = cudaPathFor(tensors, title);
  std::vector<cuda::Round> rounds;
  std::vector<size_t> partOf;  // round -> part
  Tensors held;
  for (size_t k = 0; k < parts.size(); ++k) {
    const FlatPart& p = parts[k];
    const size_t n = static_cast<size_t>(p.tensor.numel()), es = p.tensor.element_size();
    std::vector<cuda::Round> plan =
        cuda::planFlat(bytePtr(p.tensor), n, es, path.pipelinedRoundBytes(), p.copyIn && !p.readFrom.defined(),
                       p.copyOut);
    if (p.readFrom.defined()) {
      held.push_back(p.readFrom);
      const std::vector<cuda::Round> in =
          cuda::planFlat(bytePtr(p.readFrom), n, es, path.pipelinedRoundBytes(), p.copyIn, false);
      for (size_t i = 0; i < plan.size(); ++i) plan[i].toHost = in[i].toHost;  // alike: same count and size
    }
    for (cuda::Round& r : plan) {
      rounds.push_back(std::move(r));
      partOf.push_back(k);
    }
  }
  return enqueueCuda(opType, title, tensors, tensors, timeout, rounds, [&](const CudaPath::Launch& l) {
    std::vector<CudaStep> steps;
    for (size_t i = 0; i < rounds.size(); ++i) {
      void* data = l.bases[i];
      const size_t count = rounds[i].count;
      steps.push_back([run = parts[partOf[i]].run, data, count](algo::Communicator& c, std::chrono::milliseconds to) {
        run(c, to, data, count);
      });
    }
    return steps;
  }, held);
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::cudaColumns(c10d::OpType opType, const char* title,
                                                         const Tensors& outputs, const Tensors& inputs,
                                                         std::chrono::milliseconds timeout, bool gather,
                                                         std::vector<ColumnPart> parts) {
  std::lock_guard<std::recursive_mutex> lock(cudaMutex_);
  Tensors all = outputs;
  all.insert(all.end(), inputs.begin(), inputs.end());
  CudaPath& path = cudaPathFor(all, title);
  std::vector<cuda::Round> rounds;
  std::vector<size_t> partOf;
  for (size_t k = 0; k < parts.size(); ++k) {
    const ColumnPart& p = parts[k];
    const size_t n = static_cast<size_t>(p.single.numel());
    auto plan = gather ? cuda::planGather(bytePtr(p.single), bytePtr(p.blocks), n, size_, p.single.element_size(),
                                          path.pipelinedRoundBytes())
                       : cuda::planScatter(bytePtr(p.blocks), bytePtr(p.single), n, size_, p.single.element_size(),
                                           path.pipelinedRoundBytes());
    for (cuda::Round& r : plan) {
      rounds.push_back(std::move(r));
      partOf.push_back(k);
    }
  }
  const int size = size_;
  return enqueueCuda(opType, title, outputs, inputs, timeout, rounds, [&](const CudaPath::Launch& l) {
    std::vector<CudaStep> steps;
    for (size_t i = 0; i < rounds.size(); ++i) {
      const cuda::Round& r = rounds[i];
      const ColumnPart& p = parts[partOf[i]];
      const cuda::Copy& one = gather ? r.toHost[0] : r.toDevice[0];
      const cuda::Copy& cols = gather ? r.toDevice[0] : r.toHost[0];
      uint8_t* single = l.bases[i] + one.hostOffset;
      std::vector<void*> blocks;
      for (int k = 0; k < size; ++k) blocks.push_back(l.bases[i] + cols.hostOffset + k * cols.hostPitch);
      const size_t count = r.count;
      if (gather) {
        steps.push_back([dtype = p.dtype, single, blocks, count, size](algo::Communicator& c,
                                                                        std::chrono::milliseconds to) {
          c.allgather({dtype, single, blocks, std::vector<size_t>(size, count)}, to);
        });
      } else {
        steps.push_back([dtype = p.dtype, red = p.red, single, blocks, count](algo::Communicator& c,
                                                                              std::chrono::milliseconds to) {
          std::vector<const void*> ins(blocks.begin(), blocks.end());
          c.reduceScatter({dtype, red, ins, single, count, {}}, to);
        });
      }
    }
    return steps;
  });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::cudaWhole(const char* op, const Tensors& reads, const Tensors& writes,
                                                       const CpuTwin& cpuTwin) {
  std::lock_guard<std::recursive_mutex> lock(cudaMutex_);
  Tensors all = reads;
  all.insert(all.end(), writes.begin(), writes.end());
  CudaPath& path = cudaPathFor(all, op);
  // One round: the tensors read, then the tensors written, each at an aligned offset.
  WholeOp whole;
  whole.inputs = reads;
  whole.outputs = writes;
  cuda::Round round;
  auto place = [&](const at::Tensor& t, std::vector<cuda::Copy>& copies) {
    const size_t bytes = t.nbytes();
    copies.push_back(cuda::Copy{bytePtr(t), bytes, round.stagingBytes, bytes, bytes, 1});
    round.stagingBytes += cuda::alignStaging(bytes);
  };
  for (const at::Tensor& t : reads) place(t, round.toHost);
  for (const at::Tensor& t : writes) place(t, round.toDevice);
  uint8_t* base = path.nextStaging();
  if (round.stagingBytes > path.roundCapacity()) {
    whole.ownStaging = pinnedBytes(round.stagingBytes, who(), op);
    base = round.host = bytePtr(whole.ownStaging);
  }
  auto mirror = [&](const at::Tensor& t, const cuda::Copy& c) {
    return at::from_blob(base + c.hostOffset, t.sizes(), t.options().device(at::kCPU));
  };
  Tensors hostReads, hostWrites;
  for (size_t i = 0; i < reads.size(); ++i) hostReads.push_back(mirror(reads[i], round.toHost[i]));
  for (size_t i = 0; i < writes.size(); ++i) hostWrites.push_back(mirror(writes[i], round.toDevice[i]));
  whole.rounds.push_back(std::move(round));
  tlsWholeOp = &whole;
  struct Reset {
    ~Reset() { tlsWholeOp = nullptr; }
  } reset;
  Work work = cpuTwin(hostReads, hostWrites);
  TORCH_CHECK(whole.used, who(), ": ", op, ": internal error: the CUDA op was not staged");
  return work;
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::divertToCuda(c10d::OpType opType, const char* title,
                                                          std::chrono::milliseconds timeout, const Body& body) {
  WholeOp* whole = tlsWholeOp;
  if (whole == nullptr) return {};
  tlsWholeOp = nullptr;  // the twin's body is the one op
  whole->used = true;
  return enqueueCuda(opType, title, whole->outputs, whole->inputs, timeout, whole->rounds,
                     [&body](const CudaPath::Launch&) { return std::vector<CudaStep>{body}; },
                     whole->ownStaging.defined() ? Tensors{whole->ownStaging} : Tensors{});
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::cudaSend(const at::Tensor& t, int peer, int tag) {
  std::lock_guard<std::recursive_mutex> lock(cudaMutex_);
  cudaPathFor({t}, "send");
  const size_t bytes = t.nbytes();
  // The copy engine moves the tensor straight into the message, pinned memory of its own that
  // the engine may send from later; the host copies nothing. One round: the engine takes the
  // message whole anyway, and the staging stream still orders the copy among the group's ops.
  at::Tensor message = pinnedBytes(bytes, who(), "send");
  std::vector<cuda::Round> rounds = cuda::planFlat(bytePtr(t), bytes, 1, SIZE_MAX, true, false);  // one round
  rounds[0].host = bytePtr(message);
  engine::P2pOp o = p2pOp(true, peer, tag, message);
  o.done = [this, message, rank = rank_, who = whoShared(), peer](std::exception_ptr error, int) {
    if (!error) return;
    error = asTorchError(error, *who);
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      SMDDP_WARN(kColl, "rank %d: send of a CUDA tensor to rank %d failed after its Work completed: %s", rank, peer,
                 e.what());
    }
    recordCudaFailure(error);
  };
  // Counts this send as queued while its step exists: until it is handed to the engine, or
  // fails, or is never queued.
  auto queued = std::make_shared<QueuedSend>(sendsQueued_);
  return enqueueCuda(c10d::OpType::SEND, "smddp:send", {t}, {t}, std::chrono::milliseconds(timeoutMs_.load()), rounds,
                     [&](const CudaPath::Launch&) {
                       return std::vector<CudaStep>{[this, o, queued](algo::Communicator&, std::chrono::milliseconds) {
                         submitP2p(o);
                       }};
                     },
                     {message}, {peer, tag});
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::cudaRecv(const at::Tensor& t, int peer, int tag) {
  std::lock_guard<std::recursive_mutex> lock(cudaMutex_);
  throwIfCudaFailed("recv");
  cudaPathFor({t}, "recv");  // created at the group's first CUDA tensor; checks the device
  const std::shared_ptr<CudaPath> path = cuda_;
  const size_t bytes = t.nbytes();
  at::Tensor message = pinnedBytes(bytes, who(), "recv");
  auto work = newWork(c10d::OpType::RECV, "smddp:recv", Tensors{t}, Tensors{t}, std::chrono::milliseconds(timeoutMs_.load()),
                      {peer, tag});
  work->traceStarted();
  const uint64_t number = path->launchReceive(bytePtr(t), bytePtr(message), bytes);
  // A receive that fails before its message is handed to the engine lets the stream copy the
  // (unwritten) message into `t` all the same: both stay held for the stream.
  auto abandon = [&] {
    path->received(number);
    path->holdForStream({t, message}, path->receiveStream());
  };
  try {
    work->setCuda(path->receiveStream(), {});
  } catch (...) {
    abandon();
    throw;
  }
  engine::P2pOp o = p2pOp(false, peer, tag, message);
  const std::chrono::milliseconds timeout(timeoutMs_.load());
  o.done = [this, path, work, message, number, peer, timeout](std::exception_ptr error, int source) mutable {
    error = asTorchError(error, work->who());
    work->setSourceRank(peer >= 0 ? peer : source);
    path->received(number);  // the receive stream copies it now (or, after a failure, moves on)
    if (error) recordCudaFailure(error);
    // The pinned message (and, through the Work, the tensor) is held until the copy is done,
    // after a failure too: the stream still writes into the tensor then. A raw pointer: the
    // CudaPath finishes its queued completions before it goes, and a shared one dropped last on
    // the completion thread would make that thread join itself. The Work moves there: dropped
    // last on this thread, its future's CUDA event would be destroyed here.
    path->completeLater([p = path.get(), work = std::move(work), message, number, timeout, error]() mutable {
      try {
        p->awaitDelivered(number, timeout);
      } catch (const Error& e) {
        if (!error) error = toTorchError(e, work->who());
      }
      work->complete(error);
    });
  };
  try {
    submitP2p(o);
  } catch (...) {
    abandon();
    throw;
  }
  return work;
}

}  // namespace smddp::torchext
