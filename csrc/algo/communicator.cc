#include "algo/communicator.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <new>
#include <optional>
#include <sstream>
#include <system_error>

#include "algo/desync_probe.h"
#include "core/slices.h"
#include "core/env.h"
#include "core/error.h"
#include "core/hash.h"
#include "core/log.h"
#include "core/spin.h"

namespace smddp::algo {

namespace {
// What a PREMUL_SUM's signature carries of its factor (OpSignature::factor).
uint16_t factorOf(const Reduction& r) {
  return r.op == ReduceOp::kPremulSum ? OpSignature::factorTag(r.premulFactor) : 0;
}

void logParamsOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (const auto& p : env::allParams()) SMDDP_INFO(kEnv, "%s=%s", p.name.c_str(), p.value.c_str());
  });
}

// SMDDP_CPU_THREADS, or by default the cores this rank's share of the machine leaves it, up to 4:
// on a 16-core H100 host with 2 ranks, 4 threads made 64 MiB CPU collectives 2.7-3.3x faster
// than 1 (2 threads: 1.8-2.5x, 8 no better than 4); with ranks on every core, helpers would
// only steal them.
int cpuThreadsFor(const CpuShare& machine) {
  const int64_t v = env::cpuThreads();
  if (v >= 1) return static_cast<int>(v);
  return std::clamp(std::min(usableCpus(), machine.cpus / std::max(1, machine.ranks)), 1, 4);
}

// SMDDP_SHM_COPY_STEP_BYTES on a cache-line multiple, at most a slot.
size_t copyStepBytesFromEnv() {
  const size_t step = static_cast<size_t>(std::max<int64_t>(kAlignBytes, env::shmCopyStepBytes()));
  return std::min(static_cast<size_t>(env::shmSlotBytes()), step / kAlignBytes * kAlignBytes);
}

// SMDDP_SHM_SINGLE_COPY_BYTES, SIZE_MAX for never. By default only where every rank has a core:
// 2 ranks on 2 cores, inputs rewritten before each op (smddp_perf --touch 1), reading in place
// made allgathers of 4-64 MiB 1.04-1.46x faster in place and 1.00-1.09x out of place, smaller
// ones up to 1.15x slower (process_vm_readv pins the owner's pages one by one, where the staged
// copies run on both cores at once, each step still in cache); 4 ranks on 2 cores: 0.91-1.10x.
size_t singleCopyBytesFor(const CpuShare& machine) {
  const int64_t v = env::shmSingleCopyBytes();
  if (v == 0) return SIZE_MAX;
  if (v > 0) return static_cast<size_t>(v);
  return machine.oversubscribed() ? SIZE_MAX : kDefaultSingleCopyBytes;
}

// all_to_all's own default, lower than the all-gathers': its staged path copies a whole block per
// step (no small steps read while still in the writer's cache), and reading in place costs it no
// phase more (the addresses come with the split sizes). smddp_perf --touch 1 (each rank rewrites
// its input before every op), interleaved rounds, medians, against staged
// (benchmarks/results/alltoall-single-copy-2cpu-xeon.txt): 2 ranks on 2 cores, blocks of 512 KiB
// to 1 MiB 0.82-0.87x the time (A/A 0.94-1.00x), 64-256 KiB 0.94-1.25x (a block just written on
// the other core reads slower through process_vm_readv than through a slot its writer filled);
// 4 ranks on 2 cores, where each staged step waits for a core per rank, 5 rounds: blocks of
// 512 KiB-1 MiB 0.79-0.85x, 256 KiB 0.97x (a 9-round run with an A/A control could not tell
// 0.70-1.09x from its noise, 0.79-1.05x). An explicit setting holds for both.
size_t alltoallSingleCopyBytesFor(const CpuShare& machine) {
  if (env::shmSingleCopyBytes() >= 0) return singleCopyBytesFor(machine);
  return machine.oversubscribed() ? (256u << 10) : (512u << 10);
}

const std::string kScheduleKey = "smddp/schedule";

// The keys of the group's set-up that peers wait for from `rank`, but the host's shared-memory
// ones (its host is not known before the topology, and its host-mates fail on the topology's),
// and `later`, those of the caller's set-up after the communicator's (Communicator()).
std::vector<std::string> groupKeysOwedBy(int rank, const std::vector<std::string>& later) {
  std::vector<std::string> keys = Topology::keysOwedBy(rank);
  for (const std::string& k : net::TcpMesh::keysOwedBy(rank)) keys.push_back(k);
  if (rank == 0) keys.push_back(kScheduleKey);
  keys.insert(keys.end(), later.begin(), later.end());
  return keys;
}

// fn(), or, if it throws, the error told to the peers first.
template <class Fn>
auto tellingPeers(BootstrapStore& store, int rank, int size, std::chrono::milliseconds timeout,
                  const std::vector<std::string>& later, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::exception& e) {
    store.tellPeersOfFailure(groupKeysOwedBy(rank, later), rank, size, timeout, e.what());
    throw;
  }
}

Topology discoverAfterShmCheck(Store& store, int rank, int size) {
  if (size == 1) return Topology::singleHost(rank, size);
  shm::Domain::checkCapacity(rank, static_cast<size_t>(env::shmSlotBytes()));
  return Topology::discover(store, rank, size);
}

std::string hostPrefix(const Topology& t) { return "smddp/host" + std::to_string(t.host()) + "/"; }
}  // namespace

void Communicator::refuseSetUp(BootstrapStore& store, int rank, int size, std::chrono::milliseconds timeout,
                               const FreshNamespace& ns) {
  if (ns.refusalCode == ErrorCode::kTimeout) {
    store.tellPeersOfFailure(groupKeysOwedBy(rank, {}), rank, size, timeout, ns.refusal);
  } else {
    store.publishFailure(groupKeysOwedBy(rank, {}), rank, ns.refusal);
  }
  throwError(ns.refusalCode, "%s", ns.refusal.c_str());
}

Communicator::Communicator(BootstrapStore& store, int rank, int size, std::chrono::milliseconds timeout,
                           const std::vector<std::string>& keysOwedLater)
    : store_(store),
      rank_(rank),
      size_(size),
      // Local choices first, before any store exchange: a setting that fails them (a malformed
      // integer, SMDDP_STAGE_STREAM, SMDDP_SOCKET_IFNAME, SMDDP_SOCKET_FAMILY) then fails every
      // rank alike, instead of failing rank 0 first and taking the store its process hosts from
      // ranks still using it, or leaving a rank's host-mates waiting for its shared memory.
      stagingPolicy_(tellingPeers(store, rank, size, timeout, keysOwedLater,
                                  [] {
                                    env::checkSettings();
                                    return WayPolicy::parseMode("SMDDP_STAGE_STREAM", env::stageStream());
                                  }),
                     "staging", "cached", "streamed"),
      allreduceReads_(tellingPeers(store, rank, size, timeout, keysOwedLater, [] {
        return WayPolicy::parseMode("SMDDP_SHM_ALLREDUCE_SINGLE_COPY", env::shmAllreduceSingleCopy());
      })),
      allreduceReadPolicy_(WayPolicy::Mode::kNever, "single copy", "staged", "read in place"),
      netAddrs_(size > 1 ? tellingPeers(store, rank, size, timeout, keysOwedLater, [] { return net::chooseLocalAddresses(); })
                         : std::vector<net::LocalAddress>{}),
      topo_(tellingPeers(store, rank, size, timeout, keysOwedLater, [&] { return discoverAfterShmCheck(store, rank, size); })),
      cpuClaim_(topo_.cpuShare),
      machine_(cpuClaim_.busiest()),
      oneShotMaxBytes_(static_cast<size_t>(env::allreduceOneShotMaxBytes())),
      copyStepBytes_(copyStepBytesFromEnv()),
      singleCopyBytes_(singleCopyBytesFor(machine_)),
      alltoallSingleCopyBytes_(alltoallSingleCopyBytesFor(machine_)),
      cpuThreads_(cpuThreadsFor(machine_)) {
  logParamsOnce();
  try {
    setUp(timeout);
  } catch (const std::exception& e) {
    store.tellPeersOfFailure(keysOwed(keysOwedLater), rank, size, timeout, e.what());
    throw;
  }
}

std::vector<std::string> Communicator::keysOwed(const std::vector<std::string>& later) const {
  std::vector<std::string> keys = groupKeysOwedBy(rank_, later);
  const std::string prefix = topo_.hosts() == 1 ? "" : hostPrefix(topo_);
  for (const std::string& k : shm::Domain::keysOwedBy(topo_.localRank())) keys.push_back(prefix + k);
  return keys;
}

void Communicator::setUp(std::chrono::milliseconds timeout) {
  const size_t slotBytes = static_cast<size_t>(env::shmSlotBytes());
  agreeOnSchedule(store_);
  // Whether this rank would read its host-mates' memory at all: for the all-gathers (the group's
  // setting, the same on every rank), the all_to_alls or its own point-to-point receives.
  const bool probeReads = singleCopyBytes_ != SIZE_MAX || alltoallSingleCopyBytes_ != SIZE_MAX ||
                          allreduceReads_ != WayPolicy::Mode::kNever || env::p2pSingleCopyBytes() != 0;
  if (topo_.hosts() == 1) {
    domain_ = shm::Domain::create(store_, rank_, size_, slotBytes, machine_, probeReads);
    return;
  }
  PrefixStore hostStore(store_, hostPrefix(topo_));
  domain_ = shm::Domain::create(hostStore, topo_.localRank(), topo_.localSize(), slotBytes, machine_, probeReads);
  domain_->setGroupRanks(topo_.members[topo_.host()]);
  mesh_ = net::TcpMesh::create(store_, topo_, netAddrs_, hierarchicalPeers(topo_), timeout);
  SMDDP_INFO(kInit, "rank %d/%d: %d hosts, inter-host algorithm %s over %s", rank_, size_, topo_.hosts(),
             netAlgoName(netAlgo_), net::interfaceNames(netAddrs_).c_str());
}

// How the collectives cut messages, on a host and across hosts: both ends of every step must cut
// alike, so rank 0's settings hold for the group (as SMDDP_NET_SOCKETS_PER_PEER's do), and a rank
// whose own differ says so instead of failing its first op across hosts on a header mismatch, or
// on a host reading another step's bytes (silently wrong until 2026-11-29).
void Communicator::agreeOnSchedule(Store& store) {
  const std::string algo = env::netAlgo();
  netAlgo_ = netAlgoFromName(algo);  // this rank's own value must be valid too
  netBufferBytes_ = static_cast<size_t>(env::netBufferBytes());
  netOneShotBytes_ = static_cast<size_t>(env::netOneShotBytes());
  // auto reads in place only where every rank has a core: 4 ranks on 2 cores, 4 KiB pages, it
  // took 1.4-1.8x the staged time at 2-8 MiB (0.86x at 32 MiB), whose pipelined steps let the
  // ranks that share a core take turns.
  if (allreduceReads_ == WayPolicy::Mode::kAuto && machine_.oversubscribed()) allreduceReads_ = WayPolicy::Mode::kNever;
  std::ostringstream mine;
  mine << algo << ' ' << netBufferBytes_ << ' ' << netOneShotBytes_ << ' ' << oneShotMaxBytes_ << ' ' << copyStepBytes_
       << ' ' << (singleCopyBytes_ == SIZE_MAX ? 0 : singleCopyBytes_)  // as the setting says never
       << ' ' << static_cast<int>(allreduceReads_);
  const std::string group = rank0Value(store, rank_, kScheduleKey, mine.str());
  if (group != mine.str()) {
    SMDDP_WARN(kInit,
               "rank %d: SMDDP_NET_ALGO, SMDDP_NET_BUFFER_BYTES, SMDDP_NET_ONESHOT_BYTES, "
               "SMDDP_ALLREDUCE_ONESHOT_MAX_BYTES, SMDDP_SHM_COPY_STEP_BYTES, SMDDP_SHM_SINGLE_COPY_BYTES, "
               "SMDDP_SHM_ALLREDUCE_SINGLE_COPY come to \"%s\" here, but rank 0's \"%s\" hold for the group",
               rank_, mine.str().c_str(), group.c_str());
    std::istringstream fields(group);
    std::string groupAlgo;
    int reads = 0;
    if (!(fields >> groupAlgo >> netBufferBytes_ >> netOneShotBytes_ >> oneShotMaxBytes_ >> copyStepBytes_ >>
          singleCopyBytes_ >> reads) ||
        reads < 0 || reads > static_cast<int>(WayPolicy::Mode::kNever)) {
      throwError(ErrorCode::kRemoteError, "rank 0 published malformed settings \"%s\"", group.c_str());
    }
    if (singleCopyBytes_ == 0) singleCopyBytes_ = SIZE_MAX;
    allreduceReads_ = static_cast<WayPolicy::Mode>(reads);
    // A step fits a slot, whose size host-mates share (shm::Domain checks) but hosts need not.
    copyStepBytes_ = std::min(copyStepBytes_, static_cast<size_t>(env::shmSlotBytes()));
    netAlgo_ = netAlgoFromName(groupAlgo);
  }
  allreduceReadPolicy_ = WayPolicy(allreduceReads_, "single copy", "staged", "read in place");
}

template <class Flat, class Hier>
void Communicator::runEither(const OpSignature& op, std::chrono::milliseconds timeout, Flat flat, Hier hierarchical) {
  run(op, timeout, [&](OpContext& ctx) {
    if (!mesh_) return flat(ctx);
    HierContext h = hier(ctx);
    hierarchical(h);
  });
}

HierContext Communicator::hier(const OpContext& ctx) {
  HierContext h;
  h.topo = &topo_;
  h.local = ctx;
  h.mesh = mesh_.get();
  h.algo = netAlgo_;
  h.scratch = &netScratch_;
  h.bufferBytes = netBufferBytes_;
  h.oneShotBytes = netOneShotBytes_;
  return h;
}

Communicator::~Communicator() = default;

void Communicator::abort() {
  aborted_.store(true);
  // Host-mates waiting for this rank in a collective fail now, naming the cause, not at their
  // timeout (ranks of other hosts see its connections close).
  if (domain_) domain_->markClosed();
}

std::unique_ptr<HelperPool> Communicator::startHelpers() {
  try {
    return std::make_unique<HelperPool>(cpuThreads_ - 1, "smddp-cpu" + std::to_string(rank_) + "-");
  } catch (const std::system_error& e) {
    throwError(ErrorCode::kSystemError, "could not start %d helper threads (SMDDP_CPU_THREADS=%d): %s; set "
               "SMDDP_CPU_THREADS=1 to run without them", cpuThreads_ - 1, cpuThreads_, e.what());
  }
}

void Communicator::stopHelpers() {
  std::lock_guard<std::mutex> lock(helpersMutex_);
  helpers_.reset();
}

void Communicator::describeNextOps(std::string text) {
  opText_ = std::move(text);
  const uint64_t h = fnv1a(kFnv1aBasis, opText_.data(), opText_.size());
  opFingerprint_ = opText_.empty() ? 0 : (h == 0 ? 1 : h);
}

template <class Fn>
void Communicator::run(const OpSignature& op, std::chrono::milliseconds timeout, Fn&& fn) {
  const OpKind kind = op.kind;
  const uint64_t seq = ++seq_;
  if (aborted_.load()) {
    throwError(ErrorCode::kAborted, "%s #%llu: the process group has been shut down or aborted", opKindName(kind),
               static_cast<unsigned long long>(seq));
  }
  if (!brokenBy_.empty()) {
    throwError(ErrorCode::kAborted,
               "%s #%llu: the process group is unusable after an earlier collective failed (%s); destroy and "
               "re-create it",
               opKindName(kind), static_cast<unsigned long long>(seq), brokenBy_.c_str());
  }
  OpContext ctx;
  ctx.domain = domain_.get();
  ctx.rank = domain_ ? domain_->rank() : rank_;  // host-local when the group spans hosts
  ctx.size = domain_ ? domain_->size() : size_;
  ctx.seq = seq;
  ctx.signature = op.packed();
  ctx.shape = op.shape;
  ctx.wait.deadline = std::chrono::steady_clock::now() + timeout;
  ctx.wait.abort = &aborted_;
  std::optional<DesyncProbe> probe;
  if (storeErrands_) {
    probe.emplace(*storeErrands_, rank_, seq, ctx.signature, std::chrono::milliseconds(env::desyncCheckMs()));
    ctx.wait.stall = &*probe;
  }
  ctx.oneShotMaxBytes = oneShotMaxBytes_;
  ctx.copyStepBytes = copyStepBytes_;
  // all_to_all's threshold is this rank's own, not agreed with rank 0 as the all-gathers' is:
  // every op takes the largest of its ranks'.
  ctx.singleCopyBytes = !peerReads_                 ? SIZE_MAX
                        : kind == OpKind::kAlltoall ? alltoallSingleCopyBytes()
                                                    : singleCopyBytes();
  ctx.fingerprint = opFingerprint_;
  ctx.text = &opText_;
  WayChoice staging;
  staging.policy = &stagingPolicy_;
  staging.kind = kind;
  ctx.staging = &staging;
  WayChoice reads;
  if (kind == OpKind::kAllreduce && allreduceReads() != WayPolicy::Mode::kNever) {
    reads.policy = &allreduceReadPolicy_;
    reads.kind = kind;
    ctx.allreduceReads = &reads;
  }
  ctx.buffersReadable = peerReads_;
  // Held through the op, so stopHelpers() cannot take the pool away from under it (the pool
  // itself relies on this: one run() at a time, none while it is destroyed).
  std::unique_lock<std::mutex> helpersLock(helpersMutex_, std::defer_lock);
  try {
    if (cpuThreads_ > 1 && domain_ && domain_->size() > 1) {
      helpersLock.lock();
      if (!helpers_) helpers_ = startHelpers();
      ctx.helpers = helpers_.get();
    }
    if (domain_) domain_->commitSlots();
    fn(ctx);
    for (const WayChoice* c : {&staging, &reads}) {
      if (c->way < 0) continue;
      const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - c->asked;
      c->policy->record(kind, c->hostBytes, c->way == 1, took.count() / static_cast<double>(c->hostBytes));
    }
  } catch (const Error& e) {
    std::string what = e.what();
    if (e.code() == ErrorCode::kTimeout && probe) what += probe->report();
    failOp(kind, seq, e.code(), what.c_str());
  } catch (const std::bad_alloc&) {
    failOp(kind, seq, ErrorCode::kSystemError, "out of memory (std::bad_alloc)");
  } catch (const std::exception& e) {  // peers must hear of any failure, not only smddp's own
    failOp(kind, seq, ErrorCode::kSystemError, e.what());
  }
}

void Communicator::failOp(OpKind kind, uint64_t seq, ErrorCode code, const char* what) {
  char prefix[96];
  snprintf(prefix, sizeof(prefix), "%s #%llu: ", opKindName(kind), static_cast<unsigned long long>(seq));
  abandon(std::string(prefix) + what);
  throw Error(code, brokenBy_);
}

void Communicator::abandon(std::string what) {
  if (!brokenBy_.empty()) return;  // the first failure is the cause the peers were told
  brokenBy_ = std::move(what);
  SMDDP_WARN(kColl, "rank %d: %s", rank_, brokenBy_.c_str());
  // Tell the peers that may be waiting for this rank, rather than leave them to time out:
  // ranks of this host see the flag, ranks of other hosts a farewell and their connections close.
  if (domain_) domain_->markFailed("rank " + std::to_string(rank_) + ": " + brokenBy_);
  if (mesh_) mesh_->closeAll(brokenBy_);
}

void Communicator::allreduce(const AllreduceOptions& opts, std::chrono::milliseconds timeout) {
  const OpSignature op{opts.root >= 0 ? OpKind::kReduce : OpKind::kAllreduce, opts.dtype, opts.reduction.op,
                       opts.root, factorOf(opts.reduction), OpSignature::shapeOf(opts.count)};
  runEither(op, timeout, [&](OpContext& ctx) { algo::allreduce(ctx, opts); },
            [&](HierContext& hc) { hierAllreduce(hc, opts); });
}

void Communicator::broadcast(const BroadcastOptions& opts, std::chrono::milliseconds timeout) {
  runEither({OpKind::kBroadcast, opts.dtype, ReduceOp::kSum, opts.root, 0, OpSignature::shapeOf(opts.count)}, timeout,
            [&](OpContext& ctx) { algo::broadcast(ctx, opts); },
            [&](HierContext& hc) { hierBroadcast(hc, opts); });
}

void Communicator::allgather(const AllgatherOptions& opts, std::chrono::milliseconds timeout) {
  const OpSignature op{opts.root >= 0 ? OpKind::kGather : OpKind::kAllgather, opts.dtype, ReduceOp::kSum, opts.root,
                       0, OpSignature::shapeOf(opts.counts)};
  runEither(op, timeout, [&](OpContext& ctx) { algo::allgather(ctx, opts); },
            [&](HierContext& hc) { opts.root >= 0 ? hierGather(hc, opts) : hierAllgather(hc, opts); });
}

void Communicator::scatter(const ScatterOptions& opts, std::chrono::milliseconds timeout) {
  runEither({OpKind::kScatter, opts.dtype, ReduceOp::kSum, opts.root, 0, OpSignature::shapeOf(opts.count)}, timeout,
            [&](OpContext& ctx) { algo::scatter(ctx, opts); },
            [&](HierContext& hc) { hierScatter(hc, opts); });
}

void Communicator::alltoall(const AlltoallOptions& opts, std::chrono::milliseconds timeout) {
  checkAlltoallBuffers(opts, rank_);
  runEither({OpKind::kAlltoall, opts.dtype}, timeout,
            [&](OpContext& ctx) { algo::alltoall(ctx, opts); },
            [&](HierContext& hc) {
              // Only all_to_all needs every rank of the other hosts connected: groups that never
              // run one never hold those connections.
              if (alltoallPeers_.empty()) {
                std::vector<int> peers = alltoallPeers(topo_);
                mesh_->connect(store_, peers, hc.local.wait);
                alltoallPeers_ = std::move(peers);
              }
              hierAlltoall(hc, opts, alltoallPeers_);
            });
}

void Communicator::reduceScatter(const ReduceScatterOptions& opts, std::chrono::milliseconds timeout) {
  const uint64_t shape = opts.counts.empty() ? OpSignature::shapeOf(opts.count) : OpSignature::shapeOf(opts.counts);
  runEither({OpKind::kReduceScatter, opts.dtype, opts.reduction.op, -1, factorOf(opts.reduction), shape}, timeout,
            [&](OpContext& ctx) { algo::reduceScatter(ctx, opts); },
            [&](HierContext& hc) { hierReduceScatter(hc, opts); });
}

void Communicator::barrier(std::chrono::milliseconds timeout) {
  runEither({OpKind::kBarrier}, timeout,
            [&](OpContext& ctx) { algo::barrier(ctx); },
            [&](HierContext& hc) { hierBarrier(hc); });
}

}  // namespace smddp::algo
