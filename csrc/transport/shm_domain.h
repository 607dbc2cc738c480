// The shared-memory domain of one process group on one host: every rank's segment mapped into
// every rank, and the step ("phase") flags ranks use to hand data to each other.
//
// Protocol. Each rank owns two staging slots and a monotonically increasing phase counter. In
// phase k a rank (1) writes its slot k%2, (2) publishes k, (3) waits until every peer published
// k, (4) reads any peer's slot k%2 and may write its own slot (k+1)%2. Because a rank publishes
// k+1 only after it finished reading phase k, a slot written in phase k+2 is never still being
// read: the two slots rotate with no trailing barrier, across ops as well as within them.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/spin.h"
#include "core/store.h"
#include "transport/shm_segment.h"

namespace smddp::shm {

// What a rank says it is doing at the first phase of each op, so peers can refuse a mismatch
// (different op, dtype or size) instead of silently reducing garbage.
constexpr size_t kOpTextBytes = 176;
struct alignas(64) OpDescriptor {
  uint64_t seq;
  uint32_t kind;
  uint32_t dtype;
  uint32_t redop;
  int32_t root;
  uint64_t count;  // elements this rank contributes or expects
  // The caller's collective (OpSignature::packed()): kind, dtype, etc. above describe the step
  // the algorithm runs, which is the same for some different collectives (across hosts the
  // ranks of a gather's or scatter's other hosts run a barrier's step).
  uint64_t signature;
  uint64_t shape;  // and its OpSignature::shape: the sizes told when ranks' ops differ
  // A digest of the element count this rank takes every rank's part to have. Each rank checks
  // the count its peers announce for themselves; this catches the rest: with uneven
  // reduce-scatter blocks, a rank that is wrong about another's block stages a block of the
  // wrong size for it, which that rank alone would read, misaligned, without noticing.
  uint64_t layout;
  // Debug checks (SMDDP_DEBUG_CHECKS): a hash of the caller's full description of the op (API,
  // shapes) and the description itself, for the message; 0 when the checks are off.
  uint64_t fingerprint;
  // Collectives that read their peers' buffers in place (single copy): whether this rank does,
  // and where its buffer for the op is, in its own address space.
  uint64_t address;
  uint32_t readsInPlace;
  uint32_t way;  // an all_reduce's first step: whether the host's first rank chose to read in place
  char text[kOpTextBytes];
};

// What a wait that has made no progress for a while tells (algo/desync_probe.h): it may throw,
// when a rank waited for is known to run another collective. It limits its own rate.
class StallProbe {
 public:
  virtual ~StallProbe() = default;
  // `since`: when the wait last moved; `waitedFor()`: the group ranks it needs to move on (asked
  // only when the probe looks).
  virtual void stalled(std::chrono::steady_clock::time_point since,
                       const std::function<std::vector<int>()>& waitedFor) = 0;
};

struct WaitContext {
  std::chrono::steady_clock::time_point deadline;
  const std::atomic<bool>* abort = nullptr;  // set by shutdown/abort: waits end with kAborted
  StallProbe* stall = nullptr;               // groups that span hosts only
};

class Domain {
 public:
  // Collective over the group: creates this rank's segment, maps every peer's and unlinks the
  // names once all ranks are attached. size == 1 creates nothing.
  // `machine`: how this host's ranks share cores with the rest of the machine (it sets how long
  // waits spin before they sleep).
  // `probeReads`: check whether this rank may read its peers' memory (single copy; a rank that
  // would use it neither way, by the group's settings and its own, does not try).
  static std::unique_ptr<Domain> create(Store& store, int rank, int size, size_t slotBytes, const CpuShare& machine,
                                        bool probeReads = true);
  // The keys create() sets for `rank`, which its peers wait for (BootstrapStore::publishFailure).
  static std::vector<std::string> keysOwedBy(int rank);
  // Fails fast, before any bootstrap traffic, when even the slots of this rank's segment cannot
  // fit in /dev/shm: every rank then reports the cause itself, rather than some losing the store
  // (rank 0 hosts it) and reporting a closed connection. (create() checks the full size.)
  static void checkCapacity(int rank, size_t slotBytes);
  ~Domain();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The group ranks of this domain's ranks, for messages, when the domain spans only one host
  // of a larger group (domain rank i is group rank groupRanks[i]).
  void setGroupRanks(std::vector<int> groupRanks) { groupRanks_ = std::move(groupRanks); }
  int groupRank(int rank) const { return groupRanks_.empty() ? rank : groupRanks_[rank]; }
  size_t slotBytes() const { return slotBytes_; }

  // The next phase number this rank will publish.
  uint64_t nextPhase() { return ++phase_; }
  uint64_t lastPhase() const { return phase_; }  // the steps this rank has taken (tests count them)
  uint8_t* slot(int rank, uint64_t phase) const { return slots_[rank][phase & 1]; }
  OpDescriptor& descriptor(int rank, uint64_t phase) const;

  void publish(uint64_t phase);
  // Back this rank's staging slots / point-to-point outboxes with memory before their first use
  // (idempotent; a full /dev/shm throws the clear "too small" error). commitSlots() is called by
  // the collectives' thread only; commitOutboxes() from any thread.
  void commitSlots();
  void commitOutboxes();
  // This rank gave up on the current collective (error, timeout): peers waiting for it in this
  // domain stop waiting and report `why`.
  void markFailed(const std::string& why);
  // Whether `rank` gave up on the current collective (markFailed), and why. Ordered after what
  // this thread did before (a full fence): a rank marks its failure before it returns from the op.
  bool gaveUp(int rank, std::string* why) const;

  // ---- point-to-point mailboxes (used by engine/p2p_engine) ----
  // Each rank owns, for every peer, an outbox of two chunks; chunk i of the stream to that peer
  // lives in buffer i % 2. Counters: chunks the owner published for a peer, chunks the owner
  // consumed from a peer. A rank's doorbell is rung whenever something it may wait for changes.
  static constexpr size_t kP2pChunkBytes = 64 * 1024;
  uint8_t* outbox(int owner, int peer, uint64_t chunk) const;
  std::atomic<uint64_t>& sentTo(int owner, int peer) const;
  std::atomic<uint64_t>& consumedFrom(int owner, int peer) const;
  uint32_t doorbell() const;
  void ringDoorbell(int rank);
  // Sleeps until this rank's doorbell differs from `seen` (or `max` passes).
  void sleepOnDoorbell(uint32_t seen, std::chrono::nanoseconds max);
  bool peerAlive(int rank) const;
  // This rank's group shut down or aborted: nothing more comes from it, in point-to-point ops or
  // collectives, and it takes nothing more. Ordered after everything it published (a full
  // fence); wakes the peers, in waitFor and on their doorbells. Idempotent.
  void markClosed();
  bool closed(int rank) const;
  // This rank gave up on its point-to-point stream with `peer` (a size mismatch, a timeout):
  // `why` for the peer, which treats this rank as closed for the pair (its sends fail, its
  // receives once they have taken what this rank had sent, as a farewell does across hosts), and
  // the peer's doorbell rung; only the first call per pair counts. Whether `owner` gave up on its
  // stream with `peer`, and why.
  void markPairGaveUp(int peer, const std::string& why);
  bool pairGaveUp(int owner, int peer, std::string* why = nullptr) const;

  // ---- single-copy reads between processes (process_vm_readv) ----
  // Whether `rank` found, when the domain was made, that it may read every other rank's memory
  // (same user, no seccomp or security module rule against it, one pid namespace), and
  // SMDDP_P2P_SINGLE_COPY_BYTES is not 0 there. Messages to it may then hand over an address.
  bool readsPeers(int rank) const;
  // Whether every rank of the domain may read every other's memory (the same on every rank once
  // create() returned): collectives then may read their inputs in place (algo/collectives.h).
  bool allReadPeers() const { return allReadPeers_; }
  // Whether other processes may read `bytes` at `p` in this one with readFromPeer(): not memory a
  // driver mapped for itself (CUDA's pinned host memory may be) or memfd_secret's. Reads its first
  // and last byte through the kernel as a peer would (one allocation is one mapping).
  bool readableByPeers(const void* p, size_t bytes) const;
  // Copies `bytes` at `address` in `peer`'s process to `dst`; 0 or the errno of the failure.
  int readFromPeer(int peer, void* dst, uint64_t address, size_t bytes) const;

  // How long a wait polls before it yields or sleeps (see spinBudget()).
  std::chrono::microseconds spin() const { return spin_; }
  // Waits until every peer has published `phase`. Throws kTimeout naming the missing ranks,
  // kRemoteError if one of them exited, kAborted if ctx.abort was set.
  void waitAll(uint64_t phase, const WaitContext& ctx);

 private:
  static size_t segmentBytes(int size, size_t slotBytes);
  struct Control;
  Domain(int rank, int size, size_t slotBytes);
  Control* control(int rank) const;
  char* pairReason(int owner, int peer) const;  // markPairGaveUp's text
  bool waitFor(int peer, uint64_t phase, const WaitContext& ctx);
  // Reads every peer's probe word (their tokens in their control blocks say what it must hold)
  // and publishes in this rank's control block whether all reads succeeded (not tried: `tryReads`
  // false).
  void probePeerReads(bool tryReads);

  int rank_;
  int size_;
  std::vector<int> groupRanks_;
  size_t slotsOffset_ = 0;
  size_t groupBytes_ = 0;  // for messages: what the group needs on this host
  bool slotsCommitted_ = false;
  std::atomic<bool> outboxesCommitted_{false};
  std::mutex commitMutex_;
  size_t slotBytes_;
  uint64_t phase_ = 0;
  std::chrono::microseconds spin_{0};
  std::chrono::microseconds yieldFor_{0};
  YieldGate yieldGate_;
  bool checkCpu_ = true;  // SMDDP_SPIN_CHECK_CPU: no polling for a peer that last ran on this CPU
  std::vector<Segment> segments_;
  std::vector<std::array<uint8_t*, 2>> slots_;
  size_t p2pCountersOffset_ = 0;
  size_t p2pOutboxOffset_ = 0;
  bool allReadPeers_ = false;
  uint64_t probeWord_ = 0;  // peers read it through process_vm_readv (its address is in our control block)
};

}  // namespace smddp::shm
