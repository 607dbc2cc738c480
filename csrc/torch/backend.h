// The c10d::Backend that torch.distributed talks to: the only place (with module.cc) that
// includes torch. Each op runs in three phases, as in ProcessGroupGloo: (1) validate and stage
// on the caller's thread, raising usage errors at once; (2) run on the group's progress thread
// via the torch-free Communicator; (3) complete the Work and its future, or fail both.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "algo/communicator.h"
#include "engine/p2p_engine.h"
#include "engine/progress_thread.h"

namespace smddp::torchext {

class SmddpWork : public c10d::Work {
 public:
  SmddpWork(int rank, c10d::OpType opType, const char* profilingTitle, std::vector<at::Tensor> outputs,
            const std::optional<std::vector<at::Tensor>>& inputs, std::chrono::microseconds spin);

  // Polls briefly before blocking: an async op is often waited on right after a short op, and
  // a sleep plus wake-up costs tens of microseconds.
  bool wait(std::chrono::milliseconds timeout) override;

  // DDP consumes its gradient allreduce only through this future.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  // Completed as soon as the future is, so work.is_completed() is true once get_future().wait()
  // returns (the base class flag is set a moment later, by finish()).
  bool isCompleted() override { return future_->completed(); }

  // Called once, on the progress (or p2p) thread.
  void complete(std::exception_ptr error);

  // For recv from any source: the rank the message came from.
  int sourceRank() const override { return sourceRank_.load(); }
  void setSourceRank(int rank) { sourceRank_.store(rank); }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::chrono::microseconds spin_;
  std::atomic<int> sourceRank_{-1};
};

class SmddpBackend : public c10d::Backend {
 public:
  // Collective over the group: checks the ranks share a host and maps the shared memory.
  SmddpBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout);
  ~SmddpBackend() override;

  const std::string getBackendName() const override { return "smddp"; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeoutMs_.store(timeout.count()); }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  // Which hosts the group spans, as {"hosts", "host", "local_rank", "local_size", "transport"}.
  std::map<std::string, std::string> topologySummary() const;

  // split_group / DeviceMesh with a bound device: a new group over `ranks` (ranks of this group),
  // bootstrapped through `store`; nullptr on ranks outside it.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;

  // Collectives issued so far: every rank issues the same ones, so the count agrees across the
  // group from creation on (TORCH_DISTRIBUTED_DEBUG=DETAIL compares it).
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return issued_.load(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // destroy_process_group calls this on every group: fails whatever is still queued promptly
  // (no hang on peers that are gone) and joins the progress thread. Idempotent.
  void shutdown() override;
  void abort() override { shutdown(); }

 private:
  using Body = std::function<void(algo::Communicator&, std::chrono::milliseconds)>;
  // Raises NotImplementedError (before anything is sent, so the group stays usable) for ops the
  // inter-host path does not have yet.
  void requireSingleHost(const char* op) const;
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType opType, const char* title, std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> inputs, std::chrono::milliseconds timeout,
                                         bool async, Body body);
  std::chrono::milliseconds resolveTimeout(std::chrono::milliseconds requested) const;
  c10::intrusive_ptr<c10d::Work> p2p(bool isSend, std::vector<at::Tensor>& tensors, int peer, int tag);

  std::atomic<int64_t> timeoutMs_;
  std::chrono::microseconds spin_;
  std::atomic<uint64_t> issued_{0};
  std::unique_ptr<algo::Communicator> comm_;
  std::unique_ptr<engine::ProgressThread> progress_;
  std::unique_ptr<engine::P2pEngine> p2p_;  // null for a group of one
  std::once_flag shutdownOnce_;
};

c10::intrusive_ptr<c10d::Backend> createBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                std::chrono::milliseconds timeout);

}  // namespace smddp::torchext
