// How long a thread may busy-wait before it sleeps. Spinning buys microseconds of latency when
// every rank has a core; when ranks outnumber cores it steals the core the awaited rank needs.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

namespace smddp {

inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// CPUs this process may run on.
int usableCpus();
// Their ids, ascending.
std::vector<int> usableCpuIds();

// The ranks of a group that run on one machine (one kernel: ranks in other network namespaces or
// containers count too, since they take the same cores) and the CPUs they may run on together.
struct CpuShare {
  int ranks = 1;
  int cpus = 1;
  bool oversubscribed() const { return ranks > cpus; }
  // A rank's two busy threads (the caller's and its group's progress thread) share a core.
  bool underTwoCoresPerRank() const { return int64_t{ranks} * 2 > cpus; }
};

// A group sees only its own ranks, but a subgroup of a job whose ranks outnumber the cores is
// just as crowded: its ranks' cores are also taken by the job's other ranks. Every group of this
// process holds a claim for its life; busiest() is the most crowded share among the claims
// alive, this one's included (the world group is made first, so its subgroups see its share).
class CpuShareClaim {
 public:
  explicit CpuShareClaim(const CpuShare& share);
  ~CpuShareClaim();
  CpuShareClaim(const CpuShareClaim&) = delete;
  CpuShareClaim& operator=(const CpuShareClaim&) = delete;
  CpuShare busiest() const;

 private:
  CpuShare share_;
};

// How long a rank polls a peer's flag inside a collective: SMDDP_SPIN_US when set (>= 0), else
// 500 us, or 2 us when the machine's ranks outnumber its cores.
std::chrono::microseconds spinBudget(const CpuShare& share);
// How long a point-to-point engine's thread polls for more work, and a caller driving it for
// its op, before sleeping: at most 50 us, since these spins run between ops, beside the user's
// compute.
std::chrono::microseconds lingerBudget(const CpuShare& share);
// How long a group's progress thread polls for the next op, and Work::wait for an op that thread
// runs, before sleeping: SMDDP_LINGER_US when set (>= 0), else lingerBudget, or 0 where the
// machine has fewer than two cores per rank. An async op keeps two threads of a rank busy at
// once (the caller's, in wait() or computing, and the progress thread running the op), so
// there a polling thread takes the core that the other, or a peer's, needs.
std::chrono::microseconds handOffLinger(const CpuShare& share);
// How long an op queued for a group's progress thread may wait for it, where the group's ops are
// waited for that soon (ProgressThread's wakeDelay): SMDDP_DEFER_WAKE_US when set (>= 0), else
// 1000 us where the machine has fewer than two cores per rank and a wait() runs a queued op
// itself (SMDDP_WAIT_RUNS_OP), else 0. There the wake-up of a thread that then finds its op
// taken, or takes it while the caller sleeps, costs a core that the caller or a peer needs.
std::chrono::microseconds progressWakeDelay(const CpuShare& share);

// Whether a waiter that yields its core (where ranks outnumber cores) should. With nothing else
// running, a yield hands the core to a rank of the job, which soon blocks or yields it back.
// Beside unrelated busy processes it hands it to one of them for a whole scheduler slice:
// 4 ranks on 2 cores beside 4 busy processes took 2.7-3.6 ms per 8-byte allreduce yielding,
// 0.26 ms sleeping at once (README, "Under unrelated CPU load"). So a yield that takes
// kSlowYield or more closes the gate for the next `backoff` waits (doubling while it keeps
// happening, up to kMaxSkip); a later try whose yields all came back sooner halves the backoff
// and closes the gate for that many waits again, so that after long load yielding resumes within
// about 2 * kMaxSkip waits. A yield may also take that long without unrelated load (a rank of
// the job computing for milliseconds), and then sleeping costs no more. One per group; its waits
// run on one thread at a time, so relaxed counters do.
class YieldGate {
 public:
  static constexpr std::chrono::microseconds kSlowYield{1000};
  static constexpr uint32_t kMinSkip = 16, kMaxSkip = 4096;  // waits
  // Whether this wait may yield.
  bool open() {
    const uint32_t skip = skip_.load(std::memory_order_relaxed);
    if (skip == 0) return true;
    skip_.store(skip - 1, std::memory_order_relaxed);
    return false;
  }
  // After a wait that yielded: whether one of its yields took kSlowYield or more.
  void yielded(bool slow);
  uint32_t backoff() const { return backoff_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint32_t> skip_{0}, backoff_{0};
};

// Polls `done()` until it returns true or the budget is spent; returns done()'s last value.
template <class Done>
bool spinUntil(std::chrono::microseconds budget, Done done) {
  if (done()) return true;
  if (budget.count() <= 0) return false;
  const auto end = std::chrono::steady_clock::now() + budget;
  do {
    for (int i = 0; i < 32; ++i) {
      if (done()) return true;
      cpuRelax();
    }
  } while (std::chrono::steady_clock::now() < end);
  return done();
}

}  // namespace smddp
