#include "torch/backend.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>

#include "algo/desync_probe.h"
#include "algo/group_keys.h"
#include "core/env.h"
#include "core/log.h"
#include "core/spin.h"
#include "torch/c10d_store.h"
#include "torch/tensor_checks.h"

namespace smddp::torchext {

namespace {
// Rank 0's debug-checks setting, which holds for the group (agreeOnDebugChecks).
constexpr char kDebugChecksKey[] = "smddp/debug_checks";

// An op's tensors in a log line: "float32, 2 inputs (2048 elements), 1 output (1024 elements)";
// for a send or recv (which passes its one buffer as both) "int64, 3 elements (24 bytes)".
std::string describeTensors(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs, bool p2p) {
  if (outputs.empty() && inputs.empty()) return "no tensors";
  const at::ScalarType st = (outputs.empty() ? inputs : outputs)[0].scalar_type();
  const std::optional<DataType> dt = toDataType(st);
  std::ostringstream text;
  text << (dt ? dataTypeName(*dt) : c10::toString(st));
  if (p2p) {
    text << ", " << outputs[0].numel() << " elements (" << outputs[0].nbytes() << " bytes)";
    return text.str();
  }
  auto list = [&](const char* what, const std::vector<at::Tensor>& ts) {
    if (ts.empty()) return;
    int64_t n = 0;
    for (const at::Tensor& t : ts) n += t.numel();
    text << ", " << ts.size() << " " << what << (ts.size() == 1 ? "" : "s") << " (" << n << " elements)";
  };
  list("input", inputs);
  list("output", outputs);
  return text.str();
}
}  // namespace

SmddpBackend::SmddpBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout, std::vector<int64_t> globalRanks,
                           const std::string& groupUid)
    : c10d::Backend(rank, size),
      timeoutMs_(timeout.count()),
      globalRanks_(std::move(globalRanks)),
      defaultGroup_(globalRanks_.empty()) {
  if (globalRanks_.empty()) {
    for (int r = 0; r < size; ++r) globalRanks_.push_back(r);
  }
  if (!groupUid.empty()) setGroupUid(groupUid);
  // Every rank refuses it alike, before waiting for any other (0 would be a deadline of now).
  // torch's conversion of a timedelta beyond int64 microseconds (timedelta.max) wraps around.
  TORCH_CHECK_VALUE(timeout.count() > 0, who(), ": the process group's timeout must be positive, got ",
                    timeout.count(), " ms",
                    timeout.count() < -(int64_t{1} << 50) ? " (what torch makes of a timedelta past about 292,000 "
                                                            "years, such as timedelta.max)"
                                                          : "");
  c10dStore_ = store;
  store_ = std::make_shared<C10dStore>(store, timeout);
  std::vector<std::string> spentKeys;  // of store_: those this rank removes as its set-up ends
  try {
    FreshNamespace ns = freshNamespace(*store_, rank, size, timeout, spentKeys);
    groupPrefix_ = std::move(ns.prefix);
    groupStore_ = std::make_shared<PrefixStore>(store_, groupPrefix_);
    bootstrap_ = std::make_unique<BootstrapStore>(*groupStore_);
    if (!ns.refusal.empty()) algo::Communicator::refuseSetUp(*bootstrap_, rank, size, timeout, ns);
    // What this constructor sets after the communicator's set-up, which peers done with theirs
    // wait for: a failure is published there too.
    std::vector<std::string> later = engine::NetP2p::keysOwedBy(rank);
    if (rank == 0) later.push_back(kDebugChecksKey);
    comm_ = settingUp(*groupStore_, [&] {
      return std::make_unique<algo::Communicator>(*bootstrap_, rank, size, timeout, later);
    });
  } catch (const Error& e) {
    std::rethrow_exception(toTorchError(e, who()));
  }
  // After the set-up, which checked every integer setting on every rank alike (read before it,
  // a malformed SMDDP_DEBUG_CHECKS failed this rank alone, its peers waiting out the timeout).
  debugChecks_ = agreeOnDebugChecks();
  handOffLinger_ = handOffLinger(comm_->machineShare());
  // A blocking point-to-point wait runs its engine on the caller's thread: no second thread of
  // this rank is busy meanwhile, so the engines keep the plain linger budget.
  const std::chrono::microseconds p2pLinger = lingerBudget(comm_->machineShare());
  try {
    progress_ = std::make_shared<engine::ProgressThread>("smddp-r" + std::to_string(rank), handOffLinger_,
                                                         progressWakeDelay(comm_->machineShare()));
    if (comm_->topology().localSize() > 1) {
      p2p_ = std::make_shared<engine::P2pEngine>(comm_->domain(), p2pLinger,
                                                 engine::P2pEngine::singleCopyBytesFor(comm_->machineShare()),
                                                 "smddp-p2p" + std::to_string(rank));
    }
    if (comm_->multiHost()) {
      netP2p_ = std::make_shared<engine::NetP2p>(*bootstrap_, comm_->topology(), comm_->netAddresses(),
                                                 comm_->netLanes(), p2pLinger, "smddp-np2p" + std::to_string(rank));
    }
  } catch (const std::exception& e) {
    // A thread that cannot start (a pids limit, no memory for its stack: std::system_error) or
    // a descriptor that cannot be had. Peers wait for NetP2p's addresses, or, past their own
    // set-up, in endSetUp for every rank's: the cause is published there.
    const auto* ours = dynamic_cast<const Error*>(&e);
    const Error error = ours ? *ours
                             : Error(ErrorCode::kSystemError,
                                     formatString("rank %d: cannot start the group's threads: %s", rank, e.what()));
    std::vector<std::string> owed = engine::NetP2p::keysOwedBy(rank);
    owed.push_back(algo::group_keys::kAllSetUpKey);
    bootstrap_->tellPeersOfFailure(owed, rank, size, timeout, error.what());
    std::rethrow_exception(toTorchError(error, who()));
  }
  // The group's store itself (thread-safe), not bootstrap_, whose record of its keys is not.
  storeErrands_ = std::make_shared<StoreErrands>(groupStore_);
  stallInterval_ = std::chrono::milliseconds(env::desyncCheckMs());
  if (size > 1 && stallInterval_.count() > 0) {
    comm_->setStoreErrands(storeErrands_);
    engine::StallBoard board;
    board.interval = stallInterval_;
    board.post = [errands = storeErrands_, rank](const std::string& what) {
      algo::DesyncProbe::postP2p(*errands, rank, what);
    };
    board.whereIs = [errands = storeErrands_, interval = stallInterval_](int peer) {
      return algo::DesyncProbe::whereIs(*errands, peer, interval);
    };
    if (p2p_) p2p_->setStallBoard(board);
    if (netP2p_) netP2p_->setStallBoard(board);
  }
  endSetUpInStore(std::move(spentKeys));
  pgId_ = FlightRecorder::get().addGroup(globalRanks_);  // last: a set-up that fails has no destructor to remove it
  SMDDP_INFO(kInit, "rank %d/%d: process group ready", rank, size);
}

std::shared_ptr<const std::string> SmddpBackend::whoShared() const {
  if (whoSettled_.load(std::memory_order_acquire)) return who_;
  std::lock_guard<std::mutex> lock(whoMutex_);
  if (!who_ || whoUid_ != getGroupUid() || whoDesc_ != getGroupDesc()) {
    if (who_) whoBefore_.push_back(std::move(who_));
    whoUid_ = getGroupUid();
    whoDesc_ = getGroupDesc();
    who_ = std::make_shared<const std::string>(rankName(rank_, defaultGroup_, whoUid_, whoDesc_, globalRanks_));
  }
  if (!whoDesc_.empty()) whoSettled_.store(true, std::memory_order_release);
  return who_;
}

SmddpBackend::~SmddpBackend() { releaseParts(/*objectStays=*/false); }

namespace {
// Groups released from their own callbacks whose parts a thread of their own still drops (see
// releaseParts): the exit handler waits for them, or Python's finalisation would end a thread
// that still runs a callback, and the process with it.
std::mutex releasingMutex;
std::condition_variable releasingDone;
int releasing = 0;
}  // namespace

void SmddpBackend::releaseParts(bool objectStays) {
  if (released_) return;
  released_ = true;
  if (inForkedChild()) {
    abandonInForkedChild();
    return;
  }
  // Released from one of its own ops' callbacks (which destroyed the group, the last reference
  // going with it): shutdown() only aborts there, and the ops still queued use the parts and
  // this object (a CUDA op's task reports its failure to it). A thread of its own joins the
  // group's threads, then drops the parts; a weak reference keeps this object, not destroyed,
  // until then. From the destructor (never registered as live: no weak reference held it) there
  // is no keeping it: as before.
  const bool fromOwnCallbacks = SmddpWork::runningCallbacksOf(serial_);
  shutdown();
  FlightRecorder::get().removeGroup(pgId_);
  if (!fromOwnCallbacks || !objectStays) {
    dropParts();
    return;
  }
  c10::raw::weak_intrusive_ptr::incref(this);
  {
    std::lock_guard<std::mutex> lock(releasingMutex);
    ++releasing;
  }
  auto finish = [this] {
    dropParts();
    c10::raw::weak_intrusive_ptr::decref(this);  // may delete this object
    std::lock_guard<std::mutex> lock(releasingMutex);
    if (--releasing == 0) releasingDone.notify_all();
  };
  try {
    std::thread(finish).detach();
  } catch (const std::system_error&) {
    std::lock_guard<std::mutex> lock(releasingMutex);  // no thread to join them: leaked, not hung
    if (--releasing == 0) releasingDone.notify_all();
  }
}

void SmddpBackend::dropParts() {
  stopThreads();  // done already unless from a callback
  {
    std::lock_guard<std::recursive_mutex> lock(cudaMutex_);
    cuda_.reset();
  }
  // In the order their destruction would take (p2p before the domain it uses).
  sparseScratch_.reset();
  netP2p_.reset();
  p2p_.reset();
  progress_.reset();
  comm_.reset();
  bootstrap_.reset();
  storeErrands_.reset();
  groupStore_.reset();
  store_.reset();
  c10dStore_.reset();
}

void SmddpBackend::endSetUpInStore(std::vector<std::string> spent) {
  // Its mesh address stays: peers read it as long as the group lives (TcpMesh::connect).
  const std::vector<std::string> later =
      comm_->multiHost() ? net::TcpMesh::keysReadLater(rank_) : std::vector<std::string>();
  for (const std::string& k : bootstrap_->keysSet()) {
    if (std::find(later.begin(), later.end(), k) == later.end()) spent.push_back(groupPrefix_ + k);
  }
  algo::group_keys::SetUpEnd end;
  try {
    // Through bootstrap_: a rank that failed after its communicator's set-up published why there.
    end = algo::group_keys::endSetUp(*store_, *bootstrap_, rank_, size_, spent);
  } catch (const Error& e) {
    std::rethrow_exception(toTorchError(e, who()));
  }
  if (!end.failure.empty()) {
    SMDDP_WARN(kInit, "rank %d: removing the set-up's keys from the store failed (%s); %zu of %zu removed, the rest "
               "stay", rank_, end.failure.c_str(), end.removed, spent.size());
  }
}

bool SmddpBackend::agreeOnDebugChecks() {
  const char* torchDebug = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  const bool mine = env::debugChecks() != 0 || (torchDebug != nullptr && std::string(torchDebug) == "DETAIL");
  if (size_ == 1) return mine;
  std::string group;
  try {
    group = rank0Value(*bootstrap_, rank_, kDebugChecksKey, mine ? "1" : "0");
  } catch (const Error& e) {
    std::rethrow_exception(toTorchError(e, who()));
  }
  const bool on = group == "1";
  if (on != mine) {
    SMDDP_WARN(kInit,
               "rank %d: debug checks (SMDDP_DEBUG_CHECKS, TORCH_DISTRIBUTED_DEBUG=DETAIL) are %s here but %s on "
               "rank 0, whose setting holds for the group",
               rank_, mine ? "on" : "off", on ? "on" : "off");
  }
  return on;
}

void SmddpBackend::abandonInForkedChild() {
  // Joining the progress thread would wait forever for a thread that is not in this process;
  // closing the connections with a farewell would shut them down for the parent too. Left
  // alone, they go with the child: its exit only drops its references to them.
  (void)c10dStore_.release();
  new std::shared_ptr<Store>(std::move(store_));
  new std::shared_ptr<Store>(std::move(groupStore_));
  new std::shared_ptr<StoreErrands>(std::move(storeErrands_));  // counts requests of the parent's threads
  (void)bootstrap_.release();
  (void)comm_.release();
  new std::shared_ptr<engine::ProgressThread>(std::move(progress_));
  new std::shared_ptr<engine::P2pEngine>(std::move(p2p_));
  new std::shared_ptr<engine::NetP2p>(std::move(netP2p_));
  new std::shared_ptr<CudaPath>(std::move(cuda_));
}

void SmddpBackend::throwIfForked(const char* op) const {
  if (inForkedChild()) TORCH_CHECK(false, who(), ": ", opName(op), ": ", forkedWhy(ownerPid_));
}

void SmddpBackend::shutdown() {
  if (inForkedChild()) return;  // the parent's group: see the destructor
  // Idempotent, from any thread: every pending op fails, every wait returns.
  {
    std::lock_guard<std::recursive_mutex> lock(cudaMutex_);
    if (cuda_) cuda_->abort();  // no stream stays parked on a host that stopped
  }
  if (comm_) comm_->abort();
  if (p2p_) p2p_->abort();
  if (netP2p_) netP2p_->abort();
  // From a callback of one of the group's ops (one that aborts or destroys the group), on one of
  // its threads, or on a caller's that runs its queued ops or drives its point-to-point engine:
  // joining would wait for the callback that asks. A shutdown from elsewhere joins them (one may
  // be joining now), or the group's release.
  if (SmddpWork::runningCallbacksOf(serial_)) return;
  std::call_once(shutdownOnce_, [this] { stopThreads(); });
}

void SmddpBackend::stopThreads() {
  if (progress_) progress_->stop();
  if (comm_) comm_->stopHelpers();
  // Joined and closed now, kept until the group is destroyed (p2p_ before the domain it uses): a
  // send or recv issued after this, on another thread too, fails in their submit().
  if (p2p_) p2p_->shutdown();
  if (netP2p_) netP2p_->shutdown();  // a Work may still hold it: its sockets and thread go now
}

c10::intrusive_ptr<c10d::Backend::Options> SmddpBackend::getBackendOptions() {
  auto options = c10::make_intrusive<Options>(getBackendName(), std::chrono::milliseconds(timeoutMs_.load()));
  // As gloo's and NCCL's: the group's name, description and world ranks.
  options->group_name = getGroupUid();
  options->group_desc = getGroupDesc();
  options->global_ranks_in_group.assign(globalRanks_.begin(), globalRanks_.end());
  return options;
}

std::map<std::string, std::string> SmddpBackend::topologySummary() const {
  const Topology& t = comm_->topology();
  std::map<std::string, std::string> info = {{"hosts", std::to_string(t.hosts())},
                                              {"host", std::to_string(t.host())},
                                              {"local_rank", std::to_string(t.localRank())},
                                              {"local_size", std::to_string(t.localSize())},
                                              {"transport", comm_->multiHost() ? "shm+tcp" : "shm"},
                                              {"machine_ranks", std::to_string(comm_->machineShare().ranks)},
                                              {"machine_cpus", std::to_string(comm_->machineShare().cpus)},
                                              {"wait_spin_us", std::to_string(comm_->domain()->spin().count())},
                                              {"linger_us", std::to_string(handOffLinger_.count())},
                                              {"defer_wake_us", std::to_string(progress_->wakeDelay().count())}};
  // "from N bytes", or why not.
  auto singleCopy = [&](size_t from, size_t setting, const char* whose) -> std::string {
    if (from != SIZE_MAX) return "from " + std::to_string(from) + " bytes" + whose;
    if (setting == SIZE_MAX) return "off";
    return t.localSize() == 1 ? "off (no host-mates)" : "off (a rank may not read its host-mates' memory)";
  };
  info["allgather_single_copy"] = singleCopy(comm_->singleCopyBytes(), comm_->singleCopyBytesSetting(), "");
  info["alltoall_single_copy"] =
      singleCopy(comm_->alltoallSingleCopyBytes(), comm_->alltoallSingleCopyBytesSetting(), " (this rank's)");
  // "off" also where auto found the machine's ranks outnumbering its cores.
  const size_t slice = algo::kAllreduceSingleCopyMinBytes;
  const bool learnt = comm_->allreduceReads() == algo::WayPolicy::Mode::kAuto;
  info["allreduce_single_copy"] =
      singleCopy(comm_->allreduceReads() != algo::WayPolicy::Mode::kNever ? slice : SIZE_MAX,
                 comm_->allreduceReadsSetting() != algo::WayPolicy::Mode::kNever ? slice : SIZE_MAX,
                 learnt ? " per rank, when learnt faster" : " per rank");
  if (p2p_) {
    // Whether messages to this rank from its host-mates may be read from their memory, and from what size.
    const bool reads = comm_->domain()->readsPeers(t.localRank());
    info["p2p_single_copy"] = p2p_->singleCopyBytes() == SIZE_MAX ? "off"
                              : reads ? "from " + std::to_string(p2p_->singleCopyBytes()) + " bytes"
                                      : "off (this rank may not read its host-mates' memory)";
  }
  if (comm_->multiHost()) {
    info["net_address"] = net::interfaceAddresses(comm_->netAddresses());  // one per interface
    info["net_interface"] = net::interfaceNames(comm_->netAddresses());
    info["tcp_connections"] = std::to_string(comm_->netConnections());
    info["p2p_connections"] = std::to_string(netP2p_->connections());
  }
  return info;
}

c10::intrusive_ptr<c10d::Backend> SmddpBackend::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::vector<int>& ranks,
                                                     const c10::intrusive_ptr<Options>& opts) {
  throwIfForked("split");
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end()) return nullptr;
  // torch splits once per device type, and this backend serves both cpu and cuda: the second
  // call (same store, same ranks) must get the same child, or two children would bootstrap over
  // the same store keys.
  std::lock_guard<std::mutex> lock(splitMutex_);
  if (lastSplitStore_ == store.get() && lastSplitRanks_ == ranks) {
    if (auto child = lastSplit_.lock()) return child;
  }
  const auto timeout = opts ? opts->timeout : std::chrono::milliseconds(timeoutMs_.load());
  std::vector<int64_t> childGlobalRanks;
  for (int r : ranks) childGlobalRanks.push_back(globalRanks_.at(r));
  auto child = c10::make_intrusive<SmddpBackend>(store, static_cast<int>(it - ranks.begin()),
                                                 static_cast<int>(ranks.size()), timeout, childGlobalRanks);
  registerLive(child);
  lastSplitStore_ = store.get();
  lastSplitRanks_ = ranks;
  lastSplit_ = c10::weak_intrusive_ptr<c10d::Backend>(c10::intrusive_ptr<c10d::Backend>(child));
  return child;
}

c10::intrusive_ptr<c10d::Backend> SmddpBackend::shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                                      const c10::intrusive_ptr<Options>& optsOverride) {
  throwIfForked("shrink");
  // torch.distributed.shrink_group checks the same; a direct call on the backend may not have.
  const auto refuse = [&](const std::string& why) {
    TORCH_CHECK_VALUE(false, who(), ": shrink: ", why);
  };
  std::vector<bool> excluded(size_, false);
  for (int64_t r : ranksToExclude) {
    if (r < 0 || r >= size_) refuse(c10::str("rank ", r, " to exclude is not in this group of ", size_, " ranks"));
    if (excluded[r]) refuse(c10::str("rank ", r, " is listed twice"));
    if (r == rank_) refuse("this rank is among the ranks to exclude: only the remaining ranks call shrink");
    excluded[r] = true;
  }
  if (ranksToExclude.empty()) refuse("no rank to exclude");
  if (shrinkFlags & ~1) refuse(c10::str("unknown shrink_flags ", shrinkFlags, " (SHRINK_DEFAULT 0, SHRINK_ABORT 1)"));
  if (shrinkFlags & 1) abort();

  std::vector<int64_t> childGlobalRanks;
  int childRank = 0;
  std::string prefix = "smddp-shrink" + std::to_string(shrinks_++) + "-excluding";
  for (int r = 0; r < size_; ++r) {
    if (excluded[r]) {
      prefix += "-" + std::to_string(r);
      continue;
    }
    if (r < rank_) ++childRank;
    childGlobalRanks.push_back(globalRanks_[r]);
  }
  const auto timeout = optsOverride ? optsOverride->timeout : std::chrono::milliseconds(timeoutMs_.load());
  SMDDP_INFO(kInit, "rank %d/%d: shrinking to %zu ranks (%s), this rank becomes %d", rank_, size_,
             childGlobalRanks.size(), prefix.c_str(), childRank);
  try {
    auto child = c10::make_intrusive<SmddpBackend>(c10::make_intrusive<c10d::PrefixStore>(prefix + "/", c10dStore_),
                                                   childRank, static_cast<int>(childGlobalRanks.size()), timeout,
                                                   childGlobalRanks);
    registerLive(child);
    return child;
  } catch (const c10::DistBackendError& e) {
    // The set-up's error names ranks of the new group; the caller knows this group's.
    std::string why = e.what_without_backtrace();
    const std::string named = rankPrefix(rankName(childRank, false, "", "", childGlobalRanks));
    if (why.rfind(named, 0) == 0) why.erase(0, named.size());
    std::string remaining;
    constexpr int kNamed = 16;  // a large group's list would bury the cause
    for (int r = 0, k = 0; r < size_; ++r) {
      if (excluded[r]) continue;
      if (k < kNamed) remaining += c10::str(k ? ", " : "", r, " (now ", k, ")");
      if (++k == kNamed + 1) remaining += ", ...";
    }
    C10_THROW_ERROR(DistBackendError,
                    c10::str(who(), ": shrink: the group of ranks ", remaining,
                             " did not form: ", why,
                             ". Every remaining rank must call shrink with the same ranks to exclude: ranks "
                             "that exclude others wait for each other in vain"));
  }
}

SmddpBackend::Body SmddpBackend::describedBody(c10d::OpType opType, const char* title, const Tensors& outputs,
                                              const Tensors& inputs, Body body) const {
  if (!debugChecks_) return body;
  // Only what every rank must agree on: list ops may have per-rank sizes (uneven all_gather and
  // all_to_all, gather/scatter lists on the root only), so their shapes stay out.
  bool outShapes = false, inShapes = false;
  switch (opType) {
    case c10d::OpType::ALLGATHER:
    case c10d::OpType::ALLGATHER_COALESCED: outShapes = true; break;
    case c10d::OpType::REDUCE_SCATTER: inShapes = true; break;
    case c10d::OpType::GATHER:
    case c10d::OpType::SCATTER:
    case c10d::OpType::ALLTOALL:
    case c10d::OpType::ALLTOALL_BASE: break;
    default: outShapes = inShapes = true;
  }
  std::ostringstream text;
  text << opName(title) << "(";
  const at::Tensor* first = !outputs.empty() ? &outputs[0] : (!inputs.empty() ? &inputs[0] : nullptr);
  if (first) text << first->scalar_type() << " on " << first->device().type();
  auto shapes = [&](const char* what, const Tensors& ts) {
    text << ", " << what << " " << ts.size() << " x [";
    for (size_t i = 0; i < ts.size(); ++i) text << (i ? " " : "") << ts[i].sizes();
    text << "]";
  };
  if (outShapes) shapes("outputs", outputs);
  if (inShapes) shapes("inputs", inputs);
  text << ")";
  return [text = text.str(), body = std::move(body)](algo::Communicator& c, std::chrono::milliseconds to) {
    c.describeNextOps(text);
    body(c, to);
  };
}

std::chrono::milliseconds SmddpBackend::resolveTimeout(std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? std::chrono::milliseconds(timeoutMs_.load()) : requested;
}

c10::intrusive_ptr<SmddpWork> SmddpBackend::newWork(c10d::OpType opType, const char* title, Tensors outputs,
                                                     Tensors inputs, std::chrono::milliseconds timeout,
                                                     P2pPeer peer) {
  const bool p2p = opType == c10d::OpType::SEND || opType == c10d::OpType::RECV || opType == c10d::OpType::RECVANYSOURCE;
  const int64_t traceId = FlightRecorder::get().record(pgId_, *this, p2p, title, inputs, outputs, timeout, peer);
  if (log::enabled(log::kInfo, p2p ? log::kP2p : log::kColl)) logIssue(p2p, opType, title, outputs, inputs, peer);
  auto work = c10::make_intrusive<SmddpWork>(rank_, whoShared(), opType, title, std::move(outputs),
                                             std::optional<Tensors>(std::move(inputs)), handOffLinger_);
  work->setTrace(pgId_, traceId);
  work->setGroup(serial_);
  return work;
}

void SmddpBackend::logIssue(bool p2p, c10d::OpType opType, const char* title, const Tensors& outputs,
                            const Tensors& inputs, P2pPeer peer) const {
  std::ostringstream what;
  if (opType == c10d::OpType::SEND) {
    what << "send to rank " << peer.rank << ", tag " << peer.tag;
  } else if (p2p) {
    what << "recv from " << (peer.rank >= 0 ? "rank " + std::to_string(peer.rank) : "any rank") << ", tag "
         << peer.tag;
  } else {
    what << opName(title) << " #" << issued_.load();  // as getSequenceNumberForGroup() counts
  }
  const std::string tensors = describeTensors(inputs, outputs, p2p);
  log::write(log::kInfo, p2p ? log::kP2p : log::kColl, __FILE__, __LINE__, "rank %d/%d, group %s (%s): %s: %s",
             rank_, size_, getGroupUid().c_str(), getGroupDesc().c_str(), what.str().c_str(), tensors.c_str());
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::enqueue(c10d::OpType opType, const char* title,
                                                     std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
                                                     std::chrono::milliseconds timeout, bool async, Body body) {
  throwIfForked(title);
  if (Work staged = divertToCuda(opType, title, timeout, body)) return staged;
  throwIfCudaFailed(title);
  issued_.fetch_add(1);
  body = describedBody(opType, title, outputs, inputs, std::move(body));
  auto work = newWork(opType, title, std::move(outputs), std::move(inputs), timeout);
  algo::Communicator* comm = comm_.get();
  auto task = [work, comm, size = size_, title, timeout, body = std::move(body)]() {
    std::exception_ptr error;
    work->traceStarted();
    try {
      body(*comm, timeout);
    } catch (...) {
      error = bodyError(*comm, work->who(), size, title);
    }
    work->complete(error);
  };
  work->setRunner(progress_, timeout);
  // A blocking call (async_op=False) is waited at once: when the group is idle, running it here
  // saves two thread hand-offs, which dominate small-message latency.
  if (!async && progress_->tryRunInline(task)) return work;
  work->setQueued();
  try {
    progress_->enqueue(std::move(task), /*deferWake=*/true);  // its wait() may come soon and run it
  } catch (const std::logic_error& e) {
    C10_THROW_ERROR(DistBackendError,
                    c10::str(who(), ": ", opName(title), ": the process group has been shut down"));
  }
  return work;
}

namespace {
std::mutex liveMutex;
std::vector<c10::weak_intrusive_ptr<SmddpBackend>> liveGroups;  // expired ones pruned as groups are added
}  // namespace

void SmddpBackend::registerLive(const c10::intrusive_ptr<SmddpBackend>& group) {
  std::lock_guard<std::mutex> lock(liveMutex);
  liveGroups.erase(std::remove_if(liveGroups.begin(), liveGroups.end(), [](const auto& g) { return g.expired(); }),
                   liveGroups.end());
  liveGroups.emplace_back(group);
}

void SmddpBackend::shutDownLiveGroups() {
  std::vector<c10::weak_intrusive_ptr<SmddpBackend>> groups;
  {
    std::lock_guard<std::mutex> lock(liveMutex);
    groups.swap(liveGroups);
  }
  // Not under the lock: a pending op's callback may make or drop a group.
  for (const auto& weak : groups) {
    if (auto group = weak.lock()) group->shutdown();
  }
  std::unique_lock<std::mutex> lock(releasingMutex);
  releasingDone.wait(lock, [] { return releasing == 0; });
}

c10::intrusive_ptr<c10d::Backend> createBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                std::chrono::milliseconds timeout, std::vector<int64_t> globalRanks,
                                                const std::string& groupUid) {
  auto group = c10::make_intrusive<SmddpBackend>(store, rank, size, timeout, std::move(globalRanks), groupUid);
  SmddpBackend::registerLive(group);
  return group;
}

}  // namespace smddp::torchext
