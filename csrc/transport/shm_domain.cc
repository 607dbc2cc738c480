#include "transport/shm_domain.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <thread>

#include "core/env.h"
#include "core/error.h"
#include "core/interrupt.h"
#include "core/log.h"
#include "core/random.h"
#include "core/spin.h"
#include "transport/shm_owner.h"

namespace smddp::shm {

namespace {
constexpr uint64_t kMagic = 0x736d646470736d32ull;  // "smddpsm2"
constexpr size_t kHeaderBytes = 4096;
constexpr auto kSleepTick = std::chrono::milliseconds(50);  // how often a sleeper checks deadline/peers

// The futex word is the low half of the 64-bit phase counter (little endian).
inline uint32_t* futexWord(std::atomic<uint64_t>* phase) { return reinterpret_cast<uint32_t*>(phase); }

void futexWait(std::atomic<uint64_t>* phase, uint32_t expected, std::chrono::nanoseconds timeout) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  // Not FUTEX_PRIVATE: the word is shared between processes.
  syscall(SYS_futex, futexWord(phase), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint64_t>* phase) {
  syscall(SYS_futex, futexWord(phase), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}


}  // namespace

// Lives at the start of each rank's segment. Fields written by the owner and fields written by
// peers sit on separate cache lines.
struct Domain::Control {
  OwnerStamp owner;  // first, as in every name smddp creates in /dev/shm (sweepStaleNames reads it)
  uint64_t magic;
  int32_t rank;
  uint64_t slotBytes;
  alignas(64) std::atomic<uint64_t> phase;     // written by the owner; peers wait on it
  std::atomic<int32_t> cpu;                     // the CPU the owner last published from; -1: none yet
  alignas(64) std::atomic<uint32_t> sleepers;  // peers asleep on `phase`; the owner wakes them
  alignas(64) OpDescriptor desc[2];             // by phase parity, like the slots
  alignas(64) std::atomic<uint32_t> doorbell;   // point-to-point: rung by anyone the owner may wait for
  alignas(64) std::atomic<uint32_t> doorbellSleepers;
  // Set (after `failure`) when the owner gave up on a collective, so that peers waiting for it
  // fail at once with its reason instead of waiting out the timeout.
  alignas(64) std::atomic<uint32_t> failed;
  char failure[1024];  // room for a reason relayed from another host (a farewell, nested)
  // Set when the owner's group shut down or aborted (markClosed), so that a peer's receive from it
  // fails once it has taken what the owner sent, and a peer's wait for it in a collective once
  // its phase falls short, instead of waiting out the timeout.
  alignas(64) std::atomic<uint32_t> closed;
  // Single-copy reads: a random token, where the owner keeps a copy of it in its own memory;
  // whether the owner could read every peer's copy (0: not checked yet, 1: yes, 2: no, 3: not
  // tried), and whether it also takes point-to-point messages by address (the same, and
  // SMDDP_P2P_SINGLE_COPY_BYTES is not 0 there).
  uint64_t probeToken;
  uint64_t probeAddress;
  alignas(64) std::atomic<uint32_t> canReadPeers;
  std::atomic<uint32_t> readsPeers;
};

namespace {
// Per-peer point-to-point counters follow the control page: [sentTo peer][consumedFrom peer],
// each on its own cache line; consumedFrom's also holds whether the owner gave up on the pair
// (written by the owner too, read by the peer). Then, per peer, why the owner gave up on it: a
// slot per pair, so that pairs breaking at once each keep their own reason.
constexpr size_t kCounterStride = 64;
constexpr size_t kGaveUpOffset = 8;  // in consumedFrom's line
constexpr size_t kPairReasonBytes = 512;
size_t roundUpPage(size_t n) { return (n + 4095) / 4096 * 4096; }
size_t countersBytes(int size) {
  return roundUpPage(static_cast<size_t>(size) * (2 * kCounterStride + kPairReasonBytes));
}

const std::string kTokenKey = "smddp/shm/token";
std::string createdKey(int rank) { return "smddp/shm/created/" + std::to_string(rank); }
std::string attachedKey(int rank) { return "smddp/shm/attached/" + std::to_string(rank); }
}  // namespace

std::vector<std::string> Domain::keysOwedBy(int rank) {
  std::vector<std::string> keys = {createdKey(rank), attachedKey(rank)};
  if (rank == 0) keys.push_back(kTokenKey);
  return keys;
}


Domain::Domain(int rank, int size, size_t slotBytes) : rank_(rank), size_(size), slotBytes_(slotBytes) {
  static_assert(sizeof(Control) <= kHeaderBytes, "control block must fit the header page");
}

Domain::~Domain() = default;

Domain::Control* Domain::control(int rank) const { return static_cast<Control*>(segments_[rank].data()); }

OpDescriptor& Domain::descriptor(int rank, uint64_t phase) const { return control(rank)->desc[phase & 1]; }

// One rank's segment: header, p2p counters, two slots, p2p outboxes (layout in create()).
size_t Domain::segmentBytes(int size, size_t slotBytes) {
  return kHeaderBytes + countersBytes(size) + 2 * slotBytes +
         static_cast<size_t>(size) * 2 * kP2pChunkBytes;
}

void Domain::checkCapacity(int rank, size_t slotBytes) {
  // Before the topology: which ranks share this host is not known yet.
  shm::checkShmFits(segmentBytes(1, slotBytes), 0, rank);
}

std::unique_ptr<Domain> Domain::create(Store& store, int rank, int size, size_t slotBytes,
                                       const CpuShare& machine, bool probeReads) {
  // Bounded above too: a negative setting comes here as a huge size_t.
  constexpr size_t kMaxSlotBytes = size_t(1) << 40;
  if (slotBytes < 4096 || slotBytes % 4096 != 0 || slotBytes > kMaxSlotBytes) {
    throwError(ErrorCode::kInvalidUsage, "SMDDP_SHM_SLOT_BYTES=%lld must be a multiple of 4096 from 4096 to 2^40",
               static_cast<long long>(slotBytes));
  }
  std::unique_ptr<Domain> d(new Domain(rank, size, slotBytes));
  // Spinning is bounded in time, not in polls, because the cost of a pause instruction varies
  // tenfold between CPUs. When ranks outnumber cores, yield a few times to let the peer run.
  d->spin_ = spinBudget(machine);
  d->checkCpu_ = env::spinCheckCpu() != 0;
  d->yieldFor_ =
      machine.oversubscribed() ? std::chrono::microseconds(env::yieldMicros()) : std::chrono::microseconds(0);
  if (size == 1) return d;

  if (rank == 0) store.set(kTokenKey, randomHex(8));
  const std::string token = store.get(kTokenKey);
  auto nameOf = [&](int r) { return "/smddp-" + token + "-" + std::to_string(r); };

  d->p2pCountersOffset_ = kHeaderBytes;
  const size_t slotsOffset = kHeaderBytes + countersBytes(size);
  d->p2pOutboxOffset_ = slotsOffset + 2 * slotBytes;
  const size_t segBytes = segmentBytes(size, slotBytes);
  d->segments_.resize(size);
  // Only the control page and counters now; slots and mailboxes on first use (commit*()), so
  // a group that is never used, or never uses point-to-point, costs no staging memory.
  d->segments_[rank] = Segment::create(nameOf(rank), segBytes, segBytes * size, rank, slotsOffset);
  Control* mine = new (d->segments_[rank].data()) Control();
  mine->owner = OwnerStamp::mine();
  mine->cpu.store(-1, std::memory_order_relaxed);
  mine->rank = rank;
  mine->slotBytes = slotBytes;
  mine->phase.store(0);
  mine->sleepers.store(0);
  mine->doorbell.store(0);
  mine->doorbellSleepers.store(0);
  d->probeWord_ = std::stoull(randomHex(8), nullptr, 16) | 1;  // never 0, an unset word
  mine->probeToken = d->probeWord_;
  mine->probeAddress = reinterpret_cast<uint64_t>(&d->probeWord_);
  mine->canReadPeers.store(0);
  mine->readsPeers.store(0);
  for (int p = 0; p < size; ++p) {
    new (&d->sentTo(rank, p)) std::atomic<uint64_t>(0);
    new (&d->consumedFrom(rank, p)) std::atomic<uint64_t>(0);
    new (reinterpret_cast<uint8_t*>(&d->consumedFrom(rank, p)) + kGaveUpOffset) std::atomic<uint32_t>(0);
  }
  mine->magic = kMagic;
  store.set(createdKey(rank), std::to_string(slotBytes));

  const auto others = [rank](int r) { return r != rank; };
  // A peer that could not create its segment published its error here: multiGet throws it.
  // The others' slot sizes come with it, so that a difference fails every rank alike, before any
  // rank opens a segment of the wrong size (or finds one a failed peer already removed).
  const std::vector<std::string> theirs = store.multiGet(keysOf(size, createdKey, others));
  std::string sizes;
  bool differ = false;
  for (int r = 0, i = 0; r < size; ++r) {
    const std::string v = r == rank ? std::to_string(slotBytes) : theirs[i++];
    differ = differ || v != std::to_string(slotBytes);
    sizes += (r ? ", " : "") + v;
  }
  if (differ) {
    throwError(ErrorCode::kInvalidUsage,
               "SMDDP_SHM_SLOT_BYTES differs between the ranks of this host: [%s] bytes for its ranks in ascending "
               "order (local ranks 0 to %d; set it alike everywhere, or not at all)",
               sizes.c_str(), size - 1);
  }
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    try {
      d->segments_[r] = Segment::open(nameOf(r), rank, r);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kRemoteError) throwFirstCauseWithin(store, kFirstCauseWait);
      throw;
    }
    Control* c = d->control(r);
    if (d->segments_[r].size() != segBytes || c->magic != kMagic || c->rank != r || c->slotBytes != slotBytes) {
      throwError(ErrorCode::kInvalidUsage,
                 "smddp rank %d: rank %d's shared memory does not match ours (different SMDDP_SHM_SLOT_BYTES or "
                 "smddp version across ranks?)",
                 rank, r);
    }
  }
  // Before the last exchange, so that every rank's answer is in by the end of create(): the
  // collectives pick their single-copy path from all of them (allReadPeers()) at their first op.
  d->probePeerReads(probeReads);
  // Once everybody has mapped everything the names are no longer needed: remove them now, so a
  // crash later cannot leave anything behind in /dev/shm.
  store.set(attachedKey(rank), "1");
  store.multiGet(keysOf(size, attachedKey, others));
  d->segments_[rank].unlink();
  d->allReadPeers_ = true;
  for (int r = 0; r < size; ++r) d->allReadPeers_ = d->allReadPeers_ && d->control(r)->canReadPeers.load() == 1;

  d->slotsOffset_ = slotsOffset;
  d->groupBytes_ = segBytes * size;
  d->slots_.resize(size);
  for (int r = 0; r < size; ++r) {
    uint8_t* base = static_cast<uint8_t*>(d->segments_[r].data()) + slotsOffset;
    d->slots_[r] = {base, base + slotBytes};
  }
  SMDDP_INFO(kInit, "rank %d/%d: shm domain ready, 2 x %zu byte slots per rank, spin %lld us%s + yield %d us", rank,
             size, slotBytes, static_cast<long long>(d->spin_.count()),
             d->checkCpu_ ? " (none for a rank on this CPU)" : "", static_cast<int>(d->yieldFor_.count()));
  return d;
}

void Domain::commitSlots() {
  if (slotsCommitted_ || segments_.empty()) return;
  segments_[rank_].commit(slotsOffset_, 2 * slotBytes_, groupBytes_, rank_);
  slotsCommitted_ = true;
}

void Domain::commitOutboxes() {
  if (outboxesCommitted_.load(std::memory_order_acquire) || segments_.empty()) return;
  std::lock_guard<std::mutex> lock(commitMutex_);
  if (outboxesCommitted_.load()) return;
  segments_[rank_].commit(p2pOutboxOffset_, static_cast<size_t>(size_) * 2 * kP2pChunkBytes, groupBytes_, rank_);
  outboxesCommitted_.store(true, std::memory_order_release);
}

uint8_t* Domain::outbox(int owner, int peer, uint64_t chunk) const {
  return static_cast<uint8_t*>(segments_[owner].data()) + p2pOutboxOffset_ +
         (static_cast<size_t>(peer) * 2 + (chunk & 1)) * kP2pChunkBytes;
}

std::atomic<uint64_t>& Domain::sentTo(int owner, int peer) const {
  auto* base = static_cast<uint8_t*>(segments_[owner].data()) + p2pCountersOffset_;
  return *reinterpret_cast<std::atomic<uint64_t>*>(base + static_cast<size_t>(peer) * kCounterStride);
}

std::atomic<uint64_t>& Domain::consumedFrom(int owner, int peer) const {
  auto* base = static_cast<uint8_t*>(segments_[owner].data()) + p2pCountersOffset_;
  return *reinterpret_cast<std::atomic<uint64_t>*>(base + static_cast<size_t>(size_ + peer) * kCounterStride);
}

uint32_t Domain::doorbell() const { return control(rank_)->doorbell.load(std::memory_order_seq_cst); }

void Domain::ringDoorbell(int rank) {
  Control* c = control(rank);
  c->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (c->doorbellSleepers.load(std::memory_order_seq_cst) != 0) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&c->doorbell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

void Domain::sleepOnDoorbell(uint32_t seen, std::chrono::nanoseconds max) {
  Control* c = control(rank_);
  c->doorbellSleepers.fetch_add(1, std::memory_order_seq_cst);
  if (c->doorbell.load(std::memory_order_seq_cst) == seen && max.count() > 0) {
    struct timespec ts;
    ts.tv_sec = static_cast<time_t>(max.count() / 1000000000);
    ts.tv_nsec = static_cast<long>(max.count() % 1000000000);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&c->doorbell), FUTEX_WAIT, seen, &ts, nullptr, 0);
  }
  c->doorbellSleepers.fetch_sub(1, std::memory_order_seq_cst);
}

void Domain::probePeerReads(bool tryReads) {
  if (!tryReads) {
    control(rank_)->canReadPeers.store(3, std::memory_order_release);
    control(rank_)->readsPeers.store(2, std::memory_order_release);
    return;
  }
  bool ok = true;
  for (int r = 0; r < size_ && ok; ++r) {
    if (r == rank_) continue;
    uint64_t word = 0;
    const int err = readFromPeer(r, &word, control(r)->probeAddress, sizeof(word));
    // A pid of another pid namespace names another process: its word (if any) is not the token.
    ok = err == 0 && word == control(r)->probeToken;
    if (!ok) {
      SMDDP_INFO(kInit,
                 "rank %d: no single-copy reads from rank %d (%s): large messages and collectives go through the "
                 "staging buffers",
                 rank_, r, err != 0 ? strerror(err) : "another process under its pid");
    }
  }
  control(rank_)->canReadPeers.store(ok ? 1 : 2, std::memory_order_release);
  control(rank_)->readsPeers.store(ok && env::p2pSingleCopyBytes() != 0 ? 1 : 2, std::memory_order_release);
}

bool Domain::readsPeers(int rank) const {
  return control(rank)->readsPeers.load(std::memory_order_acquire) == 1;
}

int Domain::readFromPeer(int peer, void* dst, uint64_t address, size_t bytes) const {
  const pid_t pid = control(peer)->owner.pid;
  auto* at = static_cast<uint8_t*>(dst);
  while (bytes > 0) {  // the kernel may copy less than asked (at most IOV_MAX pages' worth per call)
    struct iovec local{at, bytes};
    struct iovec remote{reinterpret_cast<void*>(address), bytes};
    const ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EFAULT;
    at += n;
    address += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
  return 0;
}

bool Domain::readableByPeers(const void* p, size_t bytes) const {
  if (bytes == 0) return true;
  uint8_t got[2];
  const auto* at = static_cast<const uint8_t*>(p);
  struct iovec local[2] = {{&got[0], 1}, {&got[1], 1}};
  struct iovec remote[2] = {{const_cast<uint8_t*>(at), 1}, {const_cast<uint8_t*>(at + bytes - 1), 1}};
  return process_vm_readv(getpid(), local, 2, remote, 2, 0) == 2;
}

bool Domain::gaveUp(int rank, std::string* why) const {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const Control* c = control(rank);
  if (c->failed.load(std::memory_order_seq_cst) == 0) return false;
  if (why != nullptr) *why = std::string(c->failure, strnlen(c->failure, sizeof(c->failure)));
  return true;
}

bool Domain::peerAlive(int rank) const {
  // Containers that share /dev/shm but not their pids: the peer's pid names another process
  // here, or none, and says nothing of the peer (which then counts as alive: a death shows at
  // the timeout, as on gloo; until 2026-12-05 a slow peer read as exited).
  return control(rank)->owner.creatorAlive();
}

void Domain::markClosed() {
  if (segments_.empty()) return;
  Control* c = control(rank_);
  c->closed.store(1, std::memory_order_seq_cst);
  futexWakeAll(&c->phase);
  for (int p = 0; p < size_; ++p) {
    if (p != rank_) ringDoorbell(p);
  }
}

bool Domain::closed(int rank) const { return control(rank)->closed.load(std::memory_order_seq_cst) != 0; }

namespace {
std::atomic<uint32_t>& gaveUpWord(std::atomic<uint64_t>& consumed) {
  return *reinterpret_cast<std::atomic<uint32_t>*>(reinterpret_cast<uint8_t*>(&consumed) + kGaveUpOffset);
}
}  // namespace

char* Domain::pairReason(int owner, int peer) const {
  return reinterpret_cast<char*>(static_cast<uint8_t*>(segments_[owner].data()) + p2pCountersOffset_ +
                                 2 * static_cast<size_t>(size_) * kCounterStride +
                                 static_cast<size_t>(peer) * kPairReasonBytes);
}

void Domain::markPairGaveUp(int peer, const std::string& why) {
  if (segments_.empty()) return;
  std::atomic<uint32_t>& flag = gaveUpWord(consumedFrom(rank_, peer));
  if (flag.load(std::memory_order_relaxed) != 0) return;  // a pair gives up once: its reason stays
  snprintf(pairReason(rank_, peer), kPairReasonBytes, "%s", why.c_str());
  flag.store(1, std::memory_order_release);  // after the reason
  ringDoorbell(peer);
}

bool Domain::pairGaveUp(int owner, int peer, std::string* why) const {
  if (gaveUpWord(consumedFrom(owner, peer)).load(std::memory_order_acquire) == 0) return false;
  if (why != nullptr) *why = std::string(pairReason(owner, peer), strnlen(pairReason(owner, peer), kPairReasonBytes));
  return true;
}

void Domain::markFailed(const std::string& why) {
  if (segments_.empty()) return;
  Control* c = control(rank_);
  snprintf(c->failure, sizeof(c->failure), "%s", why.c_str());
  c->failed.store(1, std::memory_order_seq_cst);
  // Nothing this rank writes after the flag (the caller reusing an input peers read in place,
  // once the failed op returns) may be seen before it (gaveUp()). A seq_cst store alone does not
  // promise that for later plain stores on every CPU (aarch64's stlr lets them pass); the fence does.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  futexWakeAll(&c->phase);
}

void Domain::publish(uint64_t phase) {
  Control* c = control(rank_);
  // Recorded whatever this rank's SMDDP_SPIN_CHECK_CPU: its host-mates' own settings decide
  // whether they look. glibc 2.35+ reads it from rseq, older ones from the vDSO on x86-64.
  c->cpu.store(sched_getcpu(), std::memory_order_relaxed);
  c->phase.store(phase, std::memory_order_seq_cst);
  // Pairs with the sleeper's increment-then-recheck: either it sees the new phase, or we see it.
  if (c->sleepers.load(std::memory_order_seq_cst) != 0) futexWakeAll(&c->phase);
}

bool Domain::waitFor(int peer, uint64_t phase, const WaitContext& ctx) {
  Control* c = control(peer);
  std::atomic<uint64_t>& flag = c->phase;
  auto arrived = [&] { return flag.load(std::memory_order_acquire) >= phase; };
  if (arrived()) return true;  // before sched_getcpu(): most waits end here
  // A peer that last published from the CPU this thread runs on most likely waits for this very
  // core: unrelated load makes the scheduler put communicating ranks on one run queue, and waking
  // a rank moves it next to its waker. Polling would hold it off the core for the whole budget:
  // beside 4 busy processes on 2 cores, a 4 KiB allreduce of 2 ranks took 652 us per op on
  // average (900 us in runs where they shared a core throughout), 36 us with this check (README,
  // "Under unrelated CPU load"). The peer's CPU may be out of date; a wrong guess costs one futex
  // wake-up, or one poll.
  const int peerCpu = checkCpu_ ? c->cpu.load(std::memory_order_relaxed) : -1;
  const bool peerOnThisCpu = peerCpu >= 0 && peerCpu == sched_getcpu();
  if (!peerOnThisCpu && spinUntil(spin_, arrived)) return true;
  // Oversubscribed: the awaited rank is probably runnable on our core, so hand the core over
  // (cheap) for a while before paying for a futex sleep and wake-up; not while yields hand it to
  // unrelated work for whole scheduler slices (YieldGate).
  if (yieldFor_.count() > 0 && yieldGate_.open()) {
    auto before = std::chrono::steady_clock::now();
    const auto end = before + yieldFor_;
    int yields = 0;
    bool slow = false;
    while (!arrived() && !slow && before < end) {
      sched_yield();
      ++yields;
      const auto after = std::chrono::steady_clock::now();
      slow = after - before >= YieldGate::kSlowYield;
      before = after;
    }
    if (yields > 0) yieldGate_.yielded(slow);
    if (arrived()) return true;
  }
  const auto since = std::chrono::steady_clock::now();
  while (true) {
    interrupt::watch();
    c->sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint64_t seen = flag.load(std::memory_order_seq_cst);
    if (seen < phase) {
      auto now = std::chrono::steady_clock::now();
      auto left = ctx.deadline - now;
      auto tick = left < kSleepTick ? left : std::chrono::duration_cast<std::chrono::nanoseconds>(kSleepTick);
      if (tick.count() > 0) futexWait(&flag, static_cast<uint32_t>(seen), tick);
    }
    c->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (!arrived() && c->failed.load(std::memory_order_acquire)) {
      throwError(ErrorCode::kRemoteError, "rank %d gave up on this collective: %s", groupRank(peer),
                 inTheWordsOf(groupRank(peer), std::string(c->failure, strnlen(c->failure, sizeof(c->failure)))).c_str());
    }
    if (arrived()) return true;
    // A peer that shut its group down never comes (destroy_process_group, abort, exit: its own
    // ops have ended, and published all they will). Read after the flag, its phase is final.
    if (closed(peer) && !arrived()) {
      throwError(ErrorCode::kRemoteError, "rank %d shut down or aborted the process group", groupRank(peer));
    }
    if (ctx.abort != nullptr && ctx.abort->load(std::memory_order_relaxed)) {
      throwError(ErrorCode::kAborted, "the process group was shut down or aborted while waiting for rank %d",
                 groupRank(peer));
    }
    if (interrupt::noted() && interrupt::endsWait()) {
      interrupt::throwInterrupted(("waiting for rank " + std::to_string(groupRank(peer))).c_str());
    }
    if (!peerAlive(peer)) {
      throwError(ErrorCode::kRemoteError, "rank %d (pid %d) exited while this rank was waiting for it", groupRank(peer),
                 c->owner.pid);
    }
    if (std::chrono::steady_clock::now() >= ctx.deadline) return false;
    if (ctx.stall != nullptr) ctx.stall->stalled(since, [&] { return std::vector<int>{groupRank(peer)}; });
  }
}

void Domain::waitAll(uint64_t phase, const WaitContext& ctx) {
  for (int i = 1; i < size_; ++i) {
    const int peer = (rank_ + i) % size_;
    if (waitFor(peer, phase, ctx)) continue;
    // Timed out: report every rank that has not arrived, not just the first.
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && control(r)->phase.load() < phase) missing.push_back(groupRank(r));
    }
    throwError(ErrorCode::kTimeout,
               "timed out waiting for rank(s) [%s] to reach step %llu; they may have hung, be doing other work, or "
               "be issuing a different sequence of collectives",
               joinRanks(missing).c_str(), static_cast<unsigned long long>(phase));
  }
}

}  // namespace smddp::shm
