// Collective algorithms over the shared-memory domain, as option structs + free functions.
//
// All algorithms are "direct" (mesh): every rank reads every peer's staging slot in one hop.
//   allreduce, small: one-shot. Everyone stages its input, then every rank reduces all inputs
//                     (in rank order, so results are bit-identical everywhere).
//   allreduce, large: per slot-sized chunk, reduce-scatter (rank r reduces slice r of the chunk
//                     from all slots) then all-gather (every rank copies every reduced slice).
//   reduce_scatter:   per chunk, each rank stages the W blocks of its input; rank r reduces block r.
//   allgather:        per chunk, each rank stages its piece; everyone copies all pieces.
//   broadcast:        per chunk, the root stages; everyone copies.
// Messages larger than a slot are pipelined chunk by chunk, so staging memory is fixed. The
// copy-only ops (allgather, broadcast) take smaller steps than a slot (SMDDP_SHM_COPY_STEP_BYTES):
// on a 2-core EPYC VM, 256 KiB steps made a 4-rank allgather of 4 MiB 1.7-2.4x faster than 1 MiB
// steps (other sizes within noise): readers copy a piece while it is still in the writer's cache.
// Large ops may stage with streaming stores instead, as the group's WayPolicy decides.
//
// Single copy. Where every rank of the host may read the others' memory, an allreduce whose
// slice per rank is at least kAllreduceSingleCopyMinBytes may read in place, as the host's first
// rank's WayPolicy decides (way_policy.h): the op's first step announces every rank's input and
// the decision; each rank reduces its slice from its own input and its peers' (read in pieces
// into a scratch buffer that stays in cache), a second step announces the outputs and holds the
// inputs until all are read, each rank reads every peer's reduced slice into its output, and a
// last step holds the outputs. Two copies and one reduction per byte instead of three copies:
// staged, a rank copies its input into a slot, its reduced slice out of one and every peer's out
// of theirs. 2 ranks on 2 cores, inputs rewritten before each op: on huge pages it took
// 0.51-0.88x the staged time at 2-64 MiB; on 4 KiB pages, where process_vm_readv copies slower,
// 0.64-0.72x at 2-8 MiB and 0.90-1.00x at 16-64 MiB (1.2-1.4x at 16-32 MiB in an earlier, noisier
// run): so it learns rather than follows a threshold.
// An allgather of large
// parts skips the slots: each rank announces its input's address in the op's first phase, reads
// every peer's part straight from that peer's memory (process_vm_readv), and a second phase keeps
// every input unchanged until all reads are done. One copy per part instead of two (the owner's
// in, the reader's out), and none of the caller's own part when it is gathered in place (FSDP).
// An alltoall whose largest block between two ranks is large enough (its own threshold, lower:
// algo/communicator.cc) does the same: the phase that shows every rank the split sizes also
// carries where each rank's blocks are (a rank whose own blocks are all smaller leaves them out,
// and then one more phase announces them).
// Not for broadcast or gather, where only some ranks read: staged, the owner's copy in runs on
// another core at the same time as the readers' (2 ranks on 2 cores: single copy 0.77x at 16 MiB).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "algo/way_policy.h"
#include "core/parallel.h"
#include "core/types.h"
#include "transport/shm_domain.h"

namespace smddp::algo {

// SMDDP_SHM_SINGLE_COPY_BYTES=-1: parts of at least this many bytes are read in place (where
// every rank has a core; see algo/communicator.cc).
constexpr size_t kDefaultSingleCopyBytes = 2 << 20;
// SMDDP_SHM_ALLREDUCE_SINGLE_COPY: all_reduces whose slice per rank is smaller always stage (at
// 1 MiB in all, 2 ranks on 2 cores, reading in place took 0.94-0.98x the staged time: too little to
// learn from ops this short).
constexpr size_t kAllreduceSingleCopyMinBytes = 1 << 20;

// One op's use of one of its group's WayPolicys: asked when the op first needs the choice (for
// staging: when it first stages a large message; the host-local steps of a multi-host op share
// it), and fed the op's time from then on afterwards.
struct WayChoice {
  WayPolicy* policy = nullptr;
  OpKind kind = OpKind::kBarrier;
  int way = -1;          // -1: not asked, or the op could not go the way asked (nothing to learn)
  size_t hostBytes = 0;  // the data of the host's ranks, when asked
  std::chrono::steady_clock::time_point asked;

  // The policy's way for this op (asked once; timed from here, so small ops never read the clock).
  bool take(size_t bytes) {
    if (way < 0) {
      hostBytes = bytes;
      way = policy->choose(kind, bytes) ? 1 : 0;
      asked = std::chrono::steady_clock::now();
    }
    return way == 1;
  }
};

// Per-op state shared by the algorithms.
struct OpContext {
  shm::Domain* domain = nullptr;  // null when the group has one rank
  int rank = 0;
  int size = 1;
  uint64_t seq = 0;  // the op's sequence number in its group (same on every rank)
  uint64_t signature = 0;  // OpSignature::packed() of the collective the caller runs (0: none)
  uint64_t shape = 0;      // and its OpSignature::shape
  shm::WaitContext wait;
  uint64_t fingerprint = 0;        // debug checks: hash of `text`, 0 when off
  const std::string* text = nullptr;
  size_t oneShotMaxBytes = 0;
  size_t copyStepBytes = 0;  // allgather/gather/broadcast: bytes per rank per step (<= the slot)
  size_t singleCopyBytes = SIZE_MAX;  // allgather, alltoall: parts this large are read in place
  HelperPool* helpers = nullptr;  // splits large copies and reductions (SMDDP_CPU_THREADS > 1)
  WayChoice* staging = nullptr;  // shared by the copies of this context an op makes; null: through the cache
  // All_reduces of large slices: whether they read in place (the host's first rank asks); null:
  // never (by setting, or a host-mate may not read the others' memory). The host's ranks agree.
  WayChoice* allreduceReads = nullptr;
  bool buffersReadable = true;  // false: peers may not read this rank's buffers (CUDA's pinned staging)
};

struct AllreduceOptions {
  DataType dtype;
  Reduction reduction;
  size_t count = 0;
  const void* input = nullptr;
  void* output = nullptr;  // may equal input
  int root = -1;           // >= 0: a reduce; only the root's output is written
};
void allreduce(OpContext& ctx, const AllreduceOptions& opts);

struct BroadcastOptions {
  DataType dtype;
  size_t count = 0;
  void* buffer = nullptr;
  int root = 0;
};
void broadcast(OpContext& ctx, const BroadcastOptions& opts);

struct AllgatherOptions {
  DataType dtype;
  const void* input = nullptr;   // counts[rank] elements
  std::vector<void*> outputs;    // one per rank; outputs[rank] may equal input (only the root's for a gather)
  std::vector<size_t> counts;    // elements contributed by each rank (may differ)
  int root = -1;                 // >= 0: a gather; only the root's outputs are written
};
void allgather(OpContext& ctx, const AllgatherOptions& opts);

struct ReduceScatterOptions {
  DataType dtype;
  Reduction reduction;
  std::vector<const void*> inputs;  // one block per rank, `count` elements each
  void* output = nullptr;           // `count` elements; may alias this rank's own input block
  size_t count = 0;
  std::vector<size_t> counts;       // if not empty: block p has counts[p] elements (`count` unused)
};
void reduceScatter(OpContext& ctx, const ReduceScatterOptions& opts);

struct ScatterOptions {
  DataType dtype;
  std::vector<const void*> inputs;  // at the root: one block of `count` elements per rank
  void* output = nullptr;           // `count` elements
  size_t count = 0;
  int root = 0;
};
void scatter(OpContext& ctx, const ScatterOptions& opts);

// Rank r sends inputs[p] (inCounts[p] elements) to rank p, which receives it in its outputs[r]
// (outCounts[r] elements). A mismatch between what one rank sends and what its peer expects is
// an error, never a silent short read: in shared memory the first step exchanges the counts and
// every rank of the host checks them all; across hosts each message's header carries its size.
// No output block may overlap an input block, except this rank's own output being exactly its own
// input: blocks arrive (and this rank's own block is moved) while others are still being sent.
// Communicator::alltoall refuses such buffers (checkAlltoallBuffers); the torch layer copies an
// input that overlaps an output.
struct AlltoallOptions {
  DataType dtype;
  std::vector<const void*> inputs;
  std::vector<size_t> inCounts;
  std::vector<void*> outputs;
  std::vector<size_t> outCounts;
  // Across hosts, exchange the counts before any data, so that a mismatch fails the op on every
  // rank alike. It costs one more network round trip; without it the rank that receives a wrong
  // size raises, and its peers fail at this op or their next one (the group is broken).
  bool countsFirst = false;
};
void alltoall(OpContext& ctx, const AlltoallOptions& opts);
// Throws kInvalidUsage, naming both blocks, if an output block of `opts` overlaps an input block
// (the rule above); `rank` is this rank's index in the blocks. O(W) when the inputs and outputs
// lie in separate ranges, O(W log W) otherwise.
void checkAlltoallBuffers(const AlltoallOptions& opts, int rank);
// The error for a block whose size is not the one its receiver expects (group ranks).
[[noreturn]] void throwSplitMismatch(int sender, uint64_t sends, int receiver, uint64_t expects);

void barrier(OpContext& ctx);

}  // namespace smddp::algo
