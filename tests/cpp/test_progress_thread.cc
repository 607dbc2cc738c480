// ProgressThread (engine/progress_thread.h): when its thread takes a queued task and when the
// caller does. Timings here only bound from above, generously (CI machines stall): a task owed a
// wake-up must start long before a wake delay of seconds would let it.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "engine/progress_thread.h"
#include "expect.h"

using namespace smddp;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kLong = std::chrono::seconds(30);  // a wake delay no test may wait out
constexpr auto kSoon = std::chrono::seconds(5);   // "promptly", for a loaded CI machine

// A task that records which thread ran it.
struct Probe {
  std::atomic<bool> ran{false};
  std::thread::id by;
  engine::ProgressThread::Task task() {
    return [this] {
      by = std::this_thread::get_id();
      ran.store(true, std::memory_order_release);
    };
  }
  bool waitFor(std::chrono::milliseconds limit) const {
    const auto until = Clock::now() + limit;
    while (!ran.load(std::memory_order_acquire)) {
      if (Clock::now() > until) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return true;
  }
};

// Runs one task through the thread (queued without delay), which starts its doze, after
// telling it that tasks have been waited for soon after their issue.
void warmUp(engine::ProgressThread& progress) {
  for (int i = 0; i < engine::ProgressThread::kDeferAfter; ++i) progress.noteWait(std::chrono::microseconds(5));
  Probe first;
  progress.enqueue(first.task());
  test::expect(first.waitFor(kSoon), "progress thread: a task queued without delay runs promptly");
}

// Starts a thread that runs a task of `progress` inline (as a blocking op does) for `busy`;
// returns once that task has started.
std::thread callerRunningATask(engine::ProgressThread& progress, std::chrono::milliseconds busy) {
  auto started = std::make_shared<std::atomic<bool>>(false);
  std::thread caller([&progress, started, busy] {
    progress.tryRunInline([&] {
      *started = true;
      std::this_thread::sleep_for(busy);
    });
  });
  while (!*started) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return caller;
}

// A deferrable task queued while the thread dozes wakes nobody: the caller that waits for it
// runs it itself, long before the thread's slice ends. Many rounds: a woken thread would win
// some of the races for the task.
void callerRunsADeferredTask() {
  engine::ProgressThread progress("smddp-test-pt", std::chrono::microseconds(0), kLong);
  warmUp(progress);
  int byCaller = 0;
  constexpr int kRounds = 300;
  for (int i = 0; i < kRounds; ++i) {
    Probe p;
    progress.enqueue(p.task(), /*deferWake=*/true);
    std::this_thread::yield();  // a woken thread would get a core here
    progress.runQueuedUntil([&] { return p.ran.load(); });
    if (!p.waitFor(kSoon)) break;
    byCaller += p.by == std::this_thread::get_id();
  }
  test::expect(byCaller == kRounds, "progress thread: deferred tasks the caller waits for run on the caller's thread: " +
                                        std::to_string(byCaller) + " of " + std::to_string(kRounds));
}

// One nobody waits for starts within the wake delay, on the thread.
void threadTakesAnUnwaitedTask() {
  const auto delay = std::chrono::milliseconds(20);
  engine::ProgressThread progress("smddp-test-pt", std::chrono::microseconds(0), delay);
  warmUp(progress);
  Probe p;
  const auto issued = Clock::now();
  progress.enqueue(p.task(), /*deferWake=*/true);
  const bool ran = p.waitFor(kSoon);
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - issued);
  test::expect(ran && p.by != std::this_thread::get_id(),
               "progress thread: a deferred task nobody waits for runs on the thread, after " +
                   std::to_string(took.count()) + " ms (wake delay 20 ms)");
}

// While the callers run every deferred task, the thread's doze slices lengthen to
// kMaxSliceFactor x the wake delay. A deferred task left queued for longer than the wake delay
// (behind a task a caller runs inline) ends the deferral: the thread runs it.
void slicesLengthenUntilATaskIsLeft() {
  const auto delay = std::chrono::milliseconds(2);
  engine::ProgressThread progress("smddp-test-pt", std::chrono::microseconds(0), delay);
  warmUp(progress);
  const auto longest = delay * engine::ProgressThread::kMaxSliceFactor;
  const auto until = Clock::now() + kSoon;
  int tasks = 0;
  while (progress.dozeSlice() < longest && Clock::now() < until) {
    Probe p;
    progress.enqueue(p.task(), /*deferWake=*/true);
    progress.runQueuedUntil([&] { return p.ran.load(); });
    p.waitFor(kSoon);
    progress.noteWait(std::chrono::microseconds(5));  // as SmddpWork::wait() reports it
    ++tasks;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  test::expect(progress.dozeSlice() == longest, "progress thread: doze slices lengthen to " +
                                                    std::to_string(longest.count()) + " ms while callers run "
                                                    "every task (" + std::to_string(tasks) + " tasks)");
  test::expect(progress.deferring(), "progress thread: ...and deferral stays on");
  std::thread caller = callerRunningATask(progress, 10 * delay);
  Probe left;
  progress.enqueue(left.task(), /*deferWake=*/true);
  caller.join();
  test::expect(left.waitFor(kSoon) && left.by != std::this_thread::get_id(),
               "progress thread: a deferred task nobody runs runs on the thread");
  test::expect(!progress.deferring(),
               "progress thread: a deferred task left queued past the wake delay ends the deferral");
}

// Where a task was waited for late, the next deferrable one wakes the thread at once; a few
// waits soon after issue turn the deferral back on.
void lateWaitsEndTheDeferral() {
  engine::ProgressThread progress("smddp-test-pt", std::chrono::microseconds(0), kLong);
  warmUp(progress);
  progress.noteWait(kLong + std::chrono::seconds(1));
  Probe p;
  progress.enqueue(p.task(), /*deferWake=*/true);
  test::expect(p.waitFor(kSoon) && p.by != std::this_thread::get_id(),
               "progress thread: after a late wait a deferrable task wakes the thread");
  for (int i = 0; i < engine::ProgressThread::kDeferAfter; ++i) progress.noteWait(std::chrono::microseconds(5));
  Probe kick;  // a task queued since the thread last slept, so that it dozes again
  progress.enqueue(kick.task());
  test::expect(kick.waitFor(kSoon), "progress thread: a task queued without delay runs promptly");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // ...and the thread is back asleep
  Probe q;
  progress.enqueue(q.task(), /*deferWake=*/true);
  const bool byCaller = progress.runQueuedUntil([&] { return q.ran.load(); }) && q.by == std::this_thread::get_id();
  test::expect(byCaller, "progress thread: after soon waits again a deferrable task waits for its caller");
}

// hurry() and a task queued without delay end the wait at once.
void hurryWakesTheThread(bool byHurry) {
  engine::ProgressThread progress("smddp-test-pt", std::chrono::microseconds(0), kLong);
  warmUp(progress);
  Probe p;
  if (byHurry) {
    progress.enqueue(p.task(), /*deferWake=*/true);
    progress.hurry();
  } else {
    progress.enqueue(p.task());
  }
  test::expect(p.waitFor(kSoon) && p.by != std::this_thread::get_id(),
               std::string("progress thread: ") + (byHurry ? "hurry()" : "a task queued without delay") +
                   " wakes the dozing thread");
}

// hurry() while a caller runs a task inline: the thread takes the queued one as that task ends.
void hurryWhileACallerRunsATask() {
  engine::ProgressThread progress("smddp-test-pt", std::chrono::microseconds(0), kLong);
  warmUp(progress);
  std::thread caller = callerRunningATask(progress, std::chrono::milliseconds(100));
  Probe p;
  progress.enqueue(p.task(), /*deferWake=*/true);
  progress.hurry();
  test::expect(p.waitFor(kSoon), "progress thread: a task hurried while a caller runs one starts as that one ends");
  caller.join();
  test::expect(p.by != caller.get_id() && p.by != std::this_thread::get_id(), "...on the thread");
}

// stop() runs what is queued, deferred or not, without waiting out the delay.
void stopRunsDeferredTasks() {
  Probe p;
  const auto issued = Clock::now();
  {
    engine::ProgressThread progress("smddp-test-pt", std::chrono::microseconds(0), kLong);
    warmUp(progress);
    progress.enqueue(p.task(), /*deferWake=*/true);
    progress.stop();
  }
  test::expect(p.ran && Clock::now() - issued < kSoon, "progress thread: stop() runs a deferred task at once");
}

// A task refused after stop() stays with its caller, who can still run it (CudaPath finishes a
// Work that way; until 2026-12-07 the task was moved out before the refusal and calling it threw
// std::bad_function_call, found by static analysis).
void aRefusedTaskStaysWithItsCaller() {
  engine::ProgressThread progress("smddp-test-pt", std::chrono::microseconds(0));
  progress.stop();
  bool ran = false;
  engine::ProgressThread::Task task = [&ran] { ran = true; };
  bool refused = false;
  try {
    progress.enqueue(std::move(task));
  } catch (const std::logic_error&) {
    refused = true;
  }
  test::expect(refused && static_cast<bool>(task), "progress thread: a task refused after stop() is left whole");
  if (task) task();
  test::expect(ran, "...and its caller can run it");
}

}  // namespace

// stop() from another thread while a caller runs a task on its own thread (a blocking op run
// inline, or a wait() that took its queued op) returns once that task ends: the progress thread,
// asleep until then, must be woken to see it end.
void testProgressThreadStopsWhileACallerRunsATask(const std::string&) {
  engine::ProgressThread progress("smddp-test-pt", std::chrono::microseconds(0));
  std::thread caller = callerRunningATask(progress, std::chrono::milliseconds(300));
  auto stopped = std::async(std::launch::async, [&] { progress.stop(); });
  const bool ok = stopped.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  test::expect(ok, "progress thread: stop() while a caller runs a task returns once the task ends");
  if (!ok) {  // the stop() left hanging cannot be joined
    const int rc = test::report();
    std::fflush(stdout);
    std::_Exit(rc);
  }
  caller.join();
}

void progressThreadTests() {
  callerRunsADeferredTask();
  threadTakesAnUnwaitedTask();
  slicesLengthenUntilATaskIsLeft();
  lateWaitsEndTheDeferral();
  hurryWakesTheThread(true);
  hurryWakesTheThread(false);
  hurryWhileACallerRunsATask();
  stopRunsDeferredTasks();
  aRefusedTaskStaysWithItsCaller();
}
