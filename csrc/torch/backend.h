// The c10d::Backend that torch.distributed talks to. Each op runs in three phases, as in
// ProcessGroupGloo: (1) validate and stage on the caller's thread, raising usage errors at once
// (tensor_checks.h, staged.h); (2) run on the group's progress thread via the torch-free
// Communicator; (3) complete the Work and its future, or fail both (work.h, errors.h).
// Its members live in backend.cc (life cycle, issuing), backend_collectives.cc,
// backend_p2p.cc, monitored_barrier.cc and backend_cuda.cc (CUDA tensors).
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
#include "core/error.h"
#include "core/fork.h"
#include "core/store_errands.h"
#include "engine/net_p2p.h"
#include "engine/p2p_engine.h"
#include "engine/progress_thread.h"
#include "torch/cuda_path.h"
#include "torch/errors.h"
#include "torch/flight_recorder.h"
#include "torch/sparse_allreduce.h"
#include "torch/work.h"

namespace smddp::torchext {

class SmddpBackend : public c10d::Backend {
 public:
  // Collective over the group: checks the ranks share a host and maps the shared memory.
  // `globalRanks`: the world rank of each of the group's ranks (empty: the group is the world),
  // for the flight recorder's dumps and the rank's name in messages; `groupUid`: torch's name
  // for the group where it is known before the group is made (else torch sets it afterwards).
  SmddpBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
               std::vector<int64_t> globalRanks = {}, const std::string& groupUid = "");
  // In a process forked from the one that made the group (a child that ends without os._exit:
  // Python's finalisation destroys the group there), its parts are left as they are: its threads
  // are not in the child, and its connections and shared memory are the parent's, still in use.
  ~SmddpBackend() override;
  // c10 calls this as the last strong reference goes, but deletes the object only once its weak
  // references go too, and the registry of live groups (registerLive) holds one until the next
  // group is made or the process exits: the group's store, shared memory, sockets and threads
  // go here, as the destructor would take them.
  void release_resources() override { releaseParts(/*objectStays=*/true); }

  const std::string getBackendName() const override { return "smddp"; }
  void setTimeout(std::chrono::milliseconds timeout) override { timeoutMs_.store(timeout.count()); }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  // Which hosts the group spans, as {"hosts", "host", "local_rank", "local_size", "transport"},
  // how many ranks share this machine's CPUs ("machine_ranks", "machine_cpus": this group's, or
  // those of a more crowded group of this process) and so how long a shared-memory wait spins
  // ("wait_spin_us") and how long the progress thread and Work.wait() poll ("linger_us"), and
  // across hosts "tcp_connections" (this rank's, with every socket of every peer).
  std::map<std::string, std::string> topologySummary() const;
  bool debugChecks() const { return debugChecks_; }
  size_t netScratchBytes() const { return comm_->netScratchBytes(); }

  // split_group / DeviceMesh with a bound device: a new group over `ranks` (ranks of this group),
  // bootstrapped through `store`; nullptr on ranks outside it.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;

  // dist.shrink_group: a new group of this group's ranks less `ranksToExclude`, renumbered in
  // order, bootstrapped through this group's store under a key prefix that names the excluded
  // ranks (survivors that disagree on them never meet: each side times out naming the ranks it
  // waited for, instead of forming a group whose ranks disagree on its members). The excluded
  // ranks take no part: they may be dead. `shrinkFlags` SHRINK_ABORT (1) aborts this group first,
  // failing its pending ops; without it this group is left as it is (torch destroys it next).
  bool supportsShrinking() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                           const c10::intrusive_ptr<Options>& optsOverride) override;

  // init_process_group(device_id=cuda:N): sets up the CUDA staging now rather than inside the
  // first CUDA op (where it may wait for the device). A failure here is logged and left for that
  // op to raise, so a group bound to a GPU but used with CPU tensors still works.
  void eagerConnectSingleDevice(at::Device device) override;

  // ProcessGroup._enable_collectives_timing(), which gloo and NCCL need before Work._get_duration():
  // smddp times every op through the flight recorder, so there is nothing to turn on.
  void enableCollectivesTiming() override {}

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
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
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
  // pg.monitored_barrier (smddp.monitored_barrier; torch's own Python function admits gloo
  // only): rank 0 hears from every rank within the timeout over point-to-point messages, names
  // the ranks it missed and where they stand, and tells the ranks that came how it ended.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // destroy_process_group calls this on every group: fails whatever is still queued promptly
  // (no hang on peers that are gone) and joins the progress thread. Idempotent.
  void shutdown() override;  // nothing in a forked child (see the destructor)
  void abort() override { shutdown(); }

  // Every group this process made (each creation site registers its group), shut down: run by an
  // atexit handler, while the interpreter is whole. Groups left for Python's finalisation to
  // destroy fail their pending ops there, and a Python callback on such an op's future needs the
  // GIL then, which ends the progress thread in the middle of it ("terminate called", SIGABRT).
  // It also waits for the groups released from their own callbacks to be dropped (releaseParts).
  static void registerLive(const c10::intrusive_ptr<SmddpBackend>& group);
  static void shutDownLiveGroups();

 private:
  using Body = std::function<void(algo::Communicator&, std::chrono::milliseconds)>;
  using Work = c10::intrusive_ptr<c10d::Work>;
  using Tensors = std::vector<at::Tensor>;

  // This rank as messages name it (rankName()), with the group's name and description as torch
  // has set them by now (it sets them after the constructor, name first). The reference lasts
  // as long as the group; the shared form, for a Work or a queued body, as long as they need it.
  // Once settled, who() is one load: an op's checks call it several times.
  const std::string& who() const {
    return whoSettled_.load(std::memory_order_acquire) ? *who_ : *whoShared();
  }
  std::shared_ptr<const std::string> whoShared() const;

  // ---- CUDA tensors (backend_cuda.cc): staged through pinned host memory ----
  // True when every tensor is a CUDA tensor, false when every one is a CPU tensor; a mix is a
  // ValueError.
  bool isCudaOp(const Tensors& tensors, const char* op) const;
  // An elementwise op, in place on each part (allreduce, reduce, broadcast, their coalesced forms).
  using FlatRun = std::function<void(algo::Communicator&, std::chrono::milliseconds, void* data, size_t count)>;
  struct FlatPart {
    at::Tensor tensor;
    bool copyIn;
    bool copyOut;
    FlatRun run;
    // Where copyIn reads instead of `tensor`: a copy made at the call, for a tensor that shares
    // memory with an earlier part (the earlier part's results are copied back before this one's
    // input is staged, and it would reduce them again).
    at::Tensor readFrom = {};
  };
  Work cudaFlat(c10d::OpType opType, const char* title, const Tensors& tensors, std::chrono::milliseconds timeout,
                std::vector<FlatPart> parts);
  // Flat all-gather (`gather`) or reduce-scatter of [world, n] blocks, column block by column block.
  struct ColumnPart {
    at::Tensor single;  // all-gather: the input; reduce-scatter: the output
    at::Tensor blocks;  // all-gather: the output; reduce-scatter: the input
    DataType dtype;
    Reduction red;      // reduce-scatter only
  };
  Work cudaColumns(c10d::OpType opType, const char* title, const Tensors& outputs, const Tensors& inputs,
                   std::chrono::milliseconds timeout, bool gather, std::vector<ColumnPart> parts);
  // Ops with tensor lists: one round holding every tensor; `cpuTwin` runs the CPU form of the
  // op on host mirrors (in staging) of `reads` and `writes`, and its enqueue is diverted here.
  // A round larger than half the staging gets pinned memory of its own (torch's caching host
  // allocator), held until its results are back: refusing it would fail only the ranks that
  // stage more (a gather's root), and leave their peers in an op they never join.
  using CpuTwin = std::function<Work(const Tensors& hostReads, const Tensors& hostWrites)>;
  Work cudaWhole(const char* op, const Tensors& reads, const Tensors& writes, const CpuTwin& cpuTwin);
  // The staged op: launches its rounds on the staging stream and queues the host side. `held`:
  // memory of the op's own that its copies use (pinned staging, copies of inputs), kept until
  // the results are back as the tensors are.
  Work enqueueCuda(c10d::OpType opType, const char* title, Tensors outputs, Tensors inputs,
                   std::chrono::milliseconds timeout, const std::vector<cuda::Round>& rounds,
                   const std::function<std::vector<CudaStep>(const CudaPath::Launch&)>& makeSteps,
                   const Tensors& held = {}, P2pPeer peer = {});
  CudaPath& cudaPathFor(const Tensors& tensors, const char* op);
  // send: staged like a collective; its host side copies the data out of staging and hands the
  // message to the engine, so the Work is done once the tensor may be reused (a failure later is
  // raised by the next call on the group). recv: into pinned memory, then a copy queued on the
  // receive stream (CudaPath::launchReceive); wait() makes the current stream wait for it.
  Work cudaSend(const at::Tensor& t, int peer, int tag);
  Work cudaRecv(const at::Tensor& t, int peer, int tag);
  // Records a CUDA op's failure, for throwIfCudaFailed.
  void recordCudaFailure(std::exception_ptr error);
  // A CUDA op's failure is reported by the next call on the group too, since wait() does not block.
  void throwIfCudaFailed(const char* op);
  // Inside cudaWhole's CPU twin: queues `body` as the staged op's host side; null otherwise.
  Work divertToCuda(c10d::OpType opType, const char* title, std::chrono::milliseconds timeout, const Body& body);

  // The line SMDDP_DEBUG=INFO logs for an op as it is issued (subsystem COLL, or P2P when `p2p`).
  void logIssue(bool p2p, c10d::OpType opType, const char* title, const Tensors& outputs, const Tensors& inputs,
                P2pPeer peer) const;
  // Every op's Work: recorded in the flight recorder (as scheduled) as it is created; `peer`
  // for a send or recv.
  c10::intrusive_ptr<SmddpWork> newWork(c10d::OpType opType, const char* title, Tensors outputs, Tensors inputs,
                                        std::chrono::milliseconds timeout, P2pPeer peer = {});
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType opType, const char* title, std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> inputs, std::chrono::milliseconds timeout,
                                         bool async, Body body);
  std::chrono::milliseconds resolveTimeout(std::chrono::milliseconds requested) const;
  // Debug checks (SMDDP_DEBUG_CHECKS, TORCH_DISTRIBUTED_DEBUG=DETAIL): `body` preceded by handing
  // the core a description of the op (API, dtypes, and the shapes that must agree across ranks),
  // whose fingerprint peers compare. `body` unchanged when the checks are off.
  Body describedBody(c10d::OpType opType, const char* title, const Tensors& outputs, const Tensors& inputs,
                     Body body) const;
  // `background`: smddp's own message (P2pOp::background), due whenever its peer comes.
  c10::intrusive_ptr<c10d::Work> p2p(bool isSend, std::vector<at::Tensor>& tensors, int peer, int tag,
                                     bool background = false);
  // Whether debug checks are on for the group: rank 0's setting holds (a rank without them runs
  // all_to_all without the split-size round trip its peers wait for, which failed the first one
  // across hosts as collectives that do not match). Collective over the group, at set-up.
  bool agreeOnDebugChecks();
  // Last in the constructor (collective): once every rank is past its set-up, removes the keys
  // this rank's set-up set that no peer reads any more, `spent` (freshNamespace's) and
  // bootstrap_'s, so that a job making groups as it goes does not fill its store
  // (algo/group_keys.h).
  void endSetUpInStore(std::vector<std::string> spent);
  // A ValueError for a tag of the range monitoredBarrier keeps to itself.
  void checkUserTag(int tag, const char* op) const;
  // A message to or from `peer` (-1: any rank) in `buffer`, due within the group's timeout; its done
  // callback is the caller's to set.
  engine::P2pOp p2pOp(bool isSend, int peer, int tag, const at::Tensor& buffer, bool background = false) const;
  // Hands `o` to the engine(s) that reach its peer.
  // `driven`: the op's Work, whose wait() may run the shared-memory engine (setP2pDriver).
  void submitP2p(engine::P2pOp o, SmddpWork* driven = nullptr);

  // This process is a fork of the one that made the group (see the destructor).
  bool inForkedChild() const { return currentPid() != ownerPid_; }
  // Ops from a process forked from the one that made the group raise (see the destructor); the
  // op's Work would wait for a thread that is not there, or run it here on the parent's memory.
  void throwIfForked(const char* op) const;
  // The destructor in a forked child: leaks every part instead of tearing it down.
  void abandonInForkedChild();
  // The destructor's work, once (release_resources, then the destructor): shuts the group down
  // and drops its parts (dropParts). `objectStays`: called from release_resources, where a weak
  // reference may keep this object until the parts are dropped.
  void releaseParts(bool objectStays);
  void dropParts();
  // shutdown()'s joins: the threads that run the group's ops stop, after what is queued. Each
  // part's stop is idempotent; null parts are skipped.
  void stopThreads();
  bool released_ = false;

  const pid_t ownerPid_ = currentPid();
  // Tells this group's Works from others' (SmddpWork::setGroup); never 0, never reused.
  const uint64_t serial_ = nextSerial_.fetch_add(1) + 1;
  static inline std::atomic<uint64_t> nextSerial_{0};
  std::atomic<int64_t> timeoutMs_;
  bool debugChecks_ = false;
  std::chrono::microseconds handOffLinger_;  // the progress thread's and Work::wait's polling
  // SMDDP_DESYNC_CHECK_MS: how often a rank stalled in an op posts where it waits (0: never);
  // the StallBoard of the p2p engines and monitoredBarrier's "where rank N stands" both use it.
  std::chrono::milliseconds stallInterval_{0};
  std::atomic<uint64_t> issued_{0};
  std::atomic<uint32_t> monitoredBarriers_{0};  // calls so far: each takes a tag of its own
  std::vector<int64_t> globalRanks_;  // see the constructor
  const bool defaultGroup_;           // torch's default group (made with no globalRanks)
  // who(): the name and what it was made from; settled once torch has described the group,
  // which it does once, last, so that later calls read it without the lock.
  mutable std::mutex whoMutex_;
  mutable std::shared_ptr<const std::string> who_;
  mutable std::vector<std::shared_ptr<const std::string>> whoBefore_;  // names who() has handed out
  mutable std::string whoUid_, whoDesc_;
  mutable std::atomic<bool> whoSettled_{false};
  int pgId_ = -1;                     // this group in the flight recorder (-1: none, recording off)
  c10::intrusive_ptr<c10d::Store> c10dStore_;  // the store the group was created with (for shrink)
  int shrinks_ = 0;                              // shrink() calls so far: each child's key prefix
  std::shared_ptr<Store> store_;  // c10dStore_ as the core sees it, kept for the communicator (see there)
  std::shared_ptr<Store> groupStore_;  // store_'s namespace for this group alone (freshNamespace)
  // Requests to groupStore_ that no op's thread waits for: where a stalled op or p2p waits, where
  // peers stand when one times out (DesyncProbe, where SMDDP_DESYNC_CHECK_MS is not 0 and size
  // is not 1).
  std::shared_ptr<StoreErrands> storeErrands_;
  std::string groupPrefix_;  // groupStore_'s keys in store_ (freshNamespace)
  std::unique_ptr<BootstrapStore> bootstrap_;  // groupStore_ as the set-up uses it
  std::unique_ptr<algo::Communicator> comm_;
  std::shared_ptr<engine::ProgressThread> progress_;  // shared with the Works of queued ops
  // Ranks of this host; null when it is the only one. Shared with the Works that drive it.
  std::shared_ptr<engine::P2pEngine> p2p_;
  std::shared_ptr<engine::NetP2p> netP2p_;  // ranks of other hosts; null in a one-host group
  // Reused by the sparse all-reduces (held by their bodies, which may outlive the group).
  std::shared_ptr<SparseScratch> sparseScratch_ = std::make_shared<SparseScratch>();
  std::once_flag shutdownOnce_;
  // The last split's child, handed out again when torch asks for the next device type.
  std::mutex splitMutex_;
  const c10d::Store* lastSplitStore_ = nullptr;
  std::vector<int> lastSplitRanks_;
  c10::weak_intrusive_ptr<c10d::Backend> lastSplit_{c10::intrusive_ptr<c10d::Backend>()};
  // CUDA: launches and queueing happen under one lock, so the staging stream and the progress
  // thread see ops in the same order.
  std::recursive_mutex cudaMutex_;
  std::shared_ptr<CudaPath> cuda_;  // created at the first CUDA tensor
  std::mutex cudaFailureMutex_;
  std::exception_ptr cudaFailure_;
  std::atomic<bool> cudaFailed_{false};
  // Sends queued on the progress thread, not yet handed to their engine: CUDA sends (waiting
  // for the device to stage their data) and the CPU sends queued behind them. While any is, a
  // new send queues behind them too, or a receiver matching by tag would take them swapped.
  std::atomic<int> sendsQueued_{0};
  // Counts one such send while it exists (held by its queued task).
  struct QueuedSend {
    std::atomic<int>& count;
    explicit QueuedSend(std::atomic<int>& c) : count(c) { count.fetch_add(1); }
    ~QueuedSend() { count.fetch_sub(1); }
    QueuedSend(const QueuedSend&) = delete;
    QueuedSend& operator=(const QueuedSend&) = delete;
  };
};

c10::intrusive_ptr<c10d::Backend> createBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                std::chrono::milliseconds timeout, std::vector<int64_t> globalRanks,
                                                const std::string& groupUid);

}  // namespace smddp::torchext
