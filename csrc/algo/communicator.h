// One process group's communicator: finds which ranks share a host, owns the shared-memory
// domain of this host's ranks and, when the group spans hosts, the TCP mesh between them; numbers
// the ops and turns any failure into a broken state, since after a failed collective ranks no
// longer agree on where they are in the protocol (as with NCCL, re-create the group to recover).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "algo/collectives.h"
#include "algo/hierarchical.h"
#include "core/error.h"
#include "core/spin.h"
#include "core/store.h"
#include "core/store_errands.h"
#include "transport/shm_domain.h"
#include "transport/tcp_mesh.h"
#include "transport/topology.h"

namespace smddp::algo {

class Communicator {
 public:
  // Collective over the group (bootstrap through `store`; `timeout` bounds connection set-up).
  // `store` must outlive the communicator: a multi-host group's first all_to_all connects more
  // ranks through it. A rank whose set-up fails publishes its error through `store` before it
  // throws, so that its peers fail with it at once; also under `keysOwedLater`, the keys the
  // caller's set-up sets after this one, for peers whose part of this set-up is done and who wait
  // for those (rank 0's debug-checks setting, say, after it failed to reach a third rank).
  Communicator(BootstrapStore& store, int rank, int size, std::chrono::milliseconds timeout,
               const std::vector<std::string>& keysOwedLater = {});
  ~Communicator();
  // Instead of the constructor, on rank 0 where freshNamespace refused the group (`ns.refusal`):
  // throws it with its code, published first under the keys the peers' set-up waits for from
  // this rank, so that they fail at once with it; for ranks that never came, after the peers
  // know (rank 0's process may host the store; a rank given another world_size was given
  // freshNamespace's grace already).
  [[noreturn]] static void refuseSetUp(BootstrapStore& store, int rank, int size, std::chrono::milliseconds timeout,
                                       const FreshNamespace& ns);
  // Before the first op, where SMDDP_DESYNC_CHECK_MS is not 0: how an op that stalls that long
  // reaches the group's store (DesyncProbe); without, no op looks.
  void setStoreErrands(std::shared_ptr<StoreErrands> errands) { storeErrands_ = std::move(errands); }

  int rank() const { return rank_; }
  int size() const { return size_; }
  const Topology& topology() const { return topo_; }
  // The machine's ranks and CPUs that waits and helper threads are sized for: this group's, or a
  // more crowded one of another live group of this process (CpuShareClaim).
  const CpuShare& machineShare() const { return machine_; }
  // True when the group spans hosts (then domain() holds only this host's ranks).
  bool multiHost() const { return mesh_ != nullptr; }
  // Allgathers between host-mates read parts of at least this many bytes in place (SIZE_MAX:
  // never, by setting or because a host-mate may not read the others' memory).
  size_t singleCopyBytes() const {
    return domain_ != nullptr && domain_->allReadPeers() ? singleCopyBytes_ : SIZE_MAX;
  }
  // SMDDP_SHM_SINGLE_COPY_BYTES as the group agreed (SIZE_MAX: never), whether or not the ranks
  // may read each other.
  size_t singleCopyBytesSetting() const { return singleCopyBytes_; }
  // All_to_alls between host-mates read blocks of at least this many bytes in place (SIZE_MAX:
  // never, as singleCopyBytes()); this rank's own value: an op goes by the largest of its ranks'.
  size_t alltoallSingleCopyBytes() const {
    return domain_ != nullptr && domain_->allReadPeers() ? alltoallSingleCopyBytes_ : SIZE_MAX;
  }
  size_t alltoallSingleCopyBytesSetting() const { return alltoallSingleCopyBytes_; }
  // How all_reduces of large slices between host-mates choose to read in place (kNever: never,
  // by setting or because a host-mate may not read the others' memory; kAuto: learnt).
  WayPolicy::Mode allreduceReads() const {
    return domain_ != nullptr && domain_->allReadPeers() ? allreduceReads_ : WayPolicy::Mode::kNever;
  }
  WayPolicy::Mode allreduceReadsSetting() const { return allreduceReads_; }
  // While alive, the ops run on this communicator read nothing in place: their buffers are host
  // memory a driver pinned (CUDA's staging), which the kernel may not let other processes read.
  // Ops run one at a time, so a plain flag does.
  class NoPeerReads {
   public:
    explicit NoPeerReads(Communicator& c) : c_(c) { c_.peerReads_ = false; }
    ~NoPeerReads() { c_.peerReads_ = true; }
    NoPeerReads(const NoPeerReads&) = delete;
    NoPeerReads& operator=(const NoPeerReads&) = delete;

   private:
    Communicator& c_;
  };
  // Receive scratch of the inter-host collectives, as grown so far (read when no op runs).
  size_t netScratchBytes() const { return netScratch_.size(); }
  // The addresses the inter-host mesh listens on (one per interface), and its connections
  // (multi-host groups only).
  const std::vector<net::LocalAddress>& netAddresses() const { return mesh_->addresses(); }
  int netConnections() const { return mesh_->connections(); }
  int netLanes() const { return mesh_->lanes(); }
  // The shared-memory domain, for the point-to-point engine (it maps nothing in a group of one).
  shm::Domain* domain() const { return domain_.get(); }

  // Each runs one collective to completion on the calling thread; calls must be serialised by
  // the caller (the engine runs them in issue order). Errors throw smddp::Error whose message
  // names the op and its sequence number.
  void allreduce(const AllreduceOptions& opts, std::chrono::milliseconds timeout);
  void broadcast(const BroadcastOptions& opts, std::chrono::milliseconds timeout);
  void allgather(const AllgatherOptions& opts, std::chrono::milliseconds timeout);
  void reduceScatter(const ReduceScatterOptions& opts, std::chrono::milliseconds timeout);
  void scatter(const ScatterOptions& opts, std::chrono::milliseconds timeout);
  void alltoall(const AlltoallOptions& opts, std::chrono::milliseconds timeout);
  void barrier(std::chrono::milliseconds timeout);

  // Makes every current and future wait fail promptly with kAborted, this rank's and its
  // host-mates' waits for it in this group. Thread-safe.
  void abort();
  bool aborted() const { return aborted_.load(); }
  // For an op that fails on this rank outside its collectives (staging before the first, work
  // between two: its peers may already wait in one): marks the group broken as a failed one does
  // and tells the peers `what`, so they fail at once instead of at the timeout. Same thread as
  // the collectives. Once the group is broken, the first cause stands and this does nothing.
  void abandon(std::string what);
  // Joins the SMDDP_CPU_THREADS helpers (after abort(): a later op fails before it needs them).
  void stopHelpers();

  // Debug checks: the caller's description of the ops it runs next (API, shapes); peers on the
  // host compare its hash at each op's first step. Empty turns the check off. Same thread as
  // the collectives.
  void describeNextOps(std::string text);

 private:
  template <class Fn>
  void run(const OpSignature& op, std::chrono::milliseconds timeout, Fn&& fn);
  // Marks the group broken by op `seq`, tells the peers (shm flag, closed connections) and throws.
  [[noreturn]] void failOp(OpKind kind, uint64_t seq, ErrorCode code, const char* what);
  // run() with the one-host algorithm, or the multi-host one when the group spans hosts.
  template <class Flat, class Hier>
  void runEither(const OpSignature& op, std::chrono::milliseconds timeout, Flat flat, Hier hierarchical);
  HierContext hier(const OpContext& ctx);
  // The set-up after the topology: shared memory, and across hosts settings and the mesh.
  void setUp(std::chrono::milliseconds timeout);
  // The store keys this rank's set-up sets that its peers wait for, and `later`.
  std::vector<std::string> keysOwed(const std::vector<std::string>& later) const;
  // Sets netAlgo_, netBufferBytes_, netOneShotBytes_, oneShotMaxBytes_, copyStepBytes_,
  // singleCopyBytes_, allreduceReads_: rank 0's values (collective, store).
  void agreeOnSchedule(Store& store);
  std::unique_ptr<HelperPool> startHelpers();

  BootstrapStore& store_;
  std::shared_ptr<StoreErrands> storeErrands_;
  int rank_;
  int size_;
  WayPolicy stagingPolicy_;  // a local choice, made before any exchange; one op at a time uses it
  // SMDDP_SHM_ALLREDUCE_SINGLE_COPY as the group agreed (auto: kNever where ranks outnumber cores).
  WayPolicy::Mode allreduceReads_;
  WayPolicy allreduceReadPolicy_;   // the host's first rank's; one op at a time uses it
  std::vector<net::LocalAddress> netAddrs_;  // where the TCP mesh listens, should the group span hosts
  Topology topo_;
  CpuShareClaim cpuClaim_;
  CpuShare machine_;
  std::unique_ptr<shm::Domain> domain_;
  std::unique_ptr<net::TcpMesh> mesh_;
  NetAlgo netAlgo_ = NetAlgo::kMesh;
  size_t netBufferBytes_ = 0;
  size_t netOneShotBytes_ = 0;
  std::vector<int> alltoallPeers_;  // alltoallPeers(), once mesh_ holds their connections
  std::vector<uint8_t> netScratch_;
  size_t oneShotMaxBytes_;
  size_t copyStepBytes_;
  size_t singleCopyBytes_;  // SIZE_MAX: never
  size_t alltoallSingleCopyBytes_;  // this rank's own (not agreed)
  bool peerReads_ = true;   // NoPeerReads
  int cpuThreads_;
  std::mutex helpersMutex_;
  std::unique_ptr<HelperPool> helpers_;  // started at the first op when cpuThreads_ > 1
  uint64_t seq_ = 0;
  std::atomic<bool> aborted_{false};
  std::string brokenBy_;  // set by the first failed op; later ops fail fast with it
  std::string opText_;
  uint64_t opFingerprint_ = 0;
};

}  // namespace smddp::algo
