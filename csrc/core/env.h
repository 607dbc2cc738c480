// The one registry of SMDDP_* environment variables.
//
// Every tunable is declared once in env.cc with its default and a help line (smddp.env_params()
// lists them; tests/test_env_readme.py checks that README's table names the same ones). Each value
// is read from the environment on first use and then cached for the life of the process, like
// NCCL's NCCL_PARAM (the integers and the settings with fixed values all at the first group's
// set-up: checkSettings). A value out of its range is refused, never clamped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace smddp::env {

struct ParamInfo {
  std::string name;          // full variable name, e.g. "SMDDP_SHM_SLOT_BYTES"
  std::string defaultValue;  // as text
  std::string help;
  std::string value;         // the value read (or, not read yet, the environment's now; default when unset)
};

// All parameters, in declaration order, with the values in force.
std::vector<ParamInfo> allParams();

// Reads every integer parameter: throws (kInvalidUsage) for one that is malformed, so a group's
// set-up fails on it instead of the first op that happens to read it, steps into a run.
// Reads every integer, every setting with a fixed set of values and SMDDP_HOST_ID (one line),
// which raises (kInvalidUsage) for the first malformed or out of range.
void checkSettings();

// Per-rank staging: bytes of one of the two shared-memory slots each rank owns. Read at every
// call, not cached (see env.cc): a size /dev/shm refused must not outlive the caller's fix.
int64_t shmSlotBytes();
// Allgather/gather/broadcast: most bytes a rank stages per step (capped by the slot).
int64_t shmCopyStepBytes();
// Allgathers read parts of at least this many bytes in place (0: never, -1: default).
int64_t shmSingleCopyBytes();
// Allreduce of at most this many bytes uses the one-shot algorithm (every rank reduces all inputs).
int64_t allreduceOneShotMaxBytes();
// Allgather/broadcast stream their output when the host's outputs add up to this; -1 = the LLC.
int64_t streamMinBytes();
// How large collectives stage for peers: auto (learn per kind of op), 1 (streaming stores), 0.
const std::string& stageStream();
// Whether large all_reduces read host-mates' buffers in place: auto (learn per size), 1, 0.
const std::string& shmAllreduceSingleCopy();
// SMDDP_STAGE_STREAM applies where the host's data adds up to this; -1 = the LLC (see copy.h).
int64_t stageStreamMinBytes();
int64_t p2pSingleCopyBytes();
// Most bytes of one sender's point-to-point messages held aside for receives not yet posted.
int64_t p2pUnexpectedBytes();
// Threads per rank for large copies and reductions (1: the op's own thread only; -1: choose).
int64_t cpuThreads();
// Microseconds a waiting thread polls a peer's flag before it sleeps; -1 = choose from the core count.
int64_t spinMicros();
// 1: no polling for a host-mate that last published from the waiter's CPU (shm::Domain::waitFor).
int64_t spinCheckCpu();
// Log level: NONE, WARN (default), INFO, TRACE.
const std::string& debugLevel();
// Comma list of subsystems to log (INIT, ENV, SHM, NET, COLL, P2P or ALL); a leading ^ inverts.
const std::string& debugSubsys();
// Log file pattern (%h host, %p pid); empty = stderr.
const std::string& debugFile();
// 1: compare a fingerprint of each op's full description across ranks.
int64_t debugChecks();
// Milliseconds a multi-host collective waits without progress before it compares where it and
// the ranks it waits for are (algo/desync_probe.h); 0 = never.
int64_t desyncCheckMs();
// Microseconds a waiting rank keeps yielding its core before sleeping, when ranks outnumber cores.
int64_t yieldMicros();
// Microseconds the progress thread and Work::wait poll before sleeping; -1 = choose from the core count.
int64_t lingerMicros();
// 1: Work::wait runs its op on the waiting thread if the progress thread has not started it.
int64_t waitRunsOp();
// 1: Ctrl-C ends a wait of the main thread (core/interrupt.h).
int64_t interruptibleWaits();
// Microseconds the progress thread, asleep, lets an async op wait before it wakes for it; -1 = choose.
int64_t deferWakeMicros();
// all_reduce_coalesced: tensors of at most this many bytes, one after another and of one dtype,
// are reduced as one flat tensor (copied in and out); 0 = every tensor alone.
int64_t coalescePackBytes();
// Splits one machine into several "hosts" (tests); empty = no split.
const std::string& hostId();
// SMDDP_FR_DUMP_FILE: where a failed op dumps the flight recorder (empty: nowhere).
const std::string& frDumpFile();
// Interfaces for the TCP mesh (NCCL_SOCKET_IFNAME syntax); empty = route to MASTER_ADDR. Read
// at every call (net::chooseLocalAddresses keeps what it chose).
std::string socketIfname();
// Address family of the inter-host connections ("", "AF_INET" or "AF_INET6").
const std::string& socketFamily();
// Inter-host schedule: mesh, naive or ring.
const std::string& netAlgo();
// mesh: bytes per peer per round-robin turn.
int64_t netChunkBytes();
int64_t netSocketsPerPeer();
// Receive buffer for inter-host reductions; bigger messages go in pieces.
int64_t netBufferBytes();
// Allreduces across hosts with (hosts - 1) x bytes at most this go one-shot.
int64_t netOneShotBytes();
// TCP congestion control of the inter-host connections ("" = the system's).
const std::string& netCongestion();
// Reduce-kernel instruction set: auto (default), avx512, avx2, scalar.
const std::string& simd();
// CUDA tensors: pinned staging bytes per group (two halves).
int64_t cudaStagingBytes();
// Most bytes a pipelined CUDA collective stages per round (capped by half the staging).
int64_t cudaRoundBytes();
// CUDA flag signalling: auto, memops or kernel.
const std::string& cudaFlags();
// CUDA: 1 = Work::wait blocks the host until the op is done.
int64_t cudaBlockingWait();
// Thread-block cap of smddp's GPU kernels.

}  // namespace smddp::env
