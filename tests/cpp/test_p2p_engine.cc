// Torch-free tests of the shared-memory point-to-point engine (two ranks as two threads of this
// process, bootstrapped through a FileStore): many messages of mixed sizes in both directions at
// once (the large ones read by the receiver straight from the sender's buffer, unless
// SMDDP_P2P_SINGLE_COPY_BYTES=0 or the kernel refuses: the first line says which), waited on by several threads that run the engine themselves (driveUntil) beside its own
// thread, land whole and in order; a waiter blocked on a recv whose sender never comes is
// released by the op's deadline, and by shutdown() from another thread; a wait after shutdown
// returns at once. tests/test_core_cpp.py also builds it under ThreadSanitizer when clang can.
// Prints "N passed, N failed".
#include <atomic>
#include <chrono>
#include <cstdio>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/file_store.h"
#include "core/spin.h"
#include "engine/p2p_engine.h"
#include "engine/progress_thread.h"
#include "expect.h"
#include "p2p_harness.h"
#include "transport/shm_domain.h"

using namespace smddp;
using test::expect;
using test::opFor;
using test::Slot;
using Clock = std::chrono::steady_clock;

namespace {

// Both ranks' domains, made together (Domain::create is collective).
std::vector<std::unique_ptr<shm::Domain>> domains(Store& store) {
  std::vector<std::unique_ptr<shm::Domain>> d(2);
  std::thread other([&] { d[1] = shm::Domain::create(store, 1, 2, 1 << 20, CpuShare{2, usableCpus()}); });
  d[0] = shm::Domain::create(store, 0, 2, 1 << 20, CpuShare{2, usableCpus()});
  other.join();
  return d;
}

void testManyMessagesManyWaiters(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store);
  std::printf("single-copy reads between the two ranks: %s\n", d[0]->readsPeers(1) && d[1]->readsPeers(0) ? "on" : "off");
  std::unique_ptr<engine::P2pEngine> eng[2];
  for (int r = 0; r < 2; ++r) {
    eng[r] = std::make_unique<engine::P2pEngine>(d[r].get(), std::chrono::microseconds(20), 256 << 10,
                                                 "p2ptest" + std::to_string(r));
  }
  test::manyMessagesManyWaiters(
      "", {0, 1, 64 * 1024 - 64, 64 * 1024, 200'001, 300'000, 1 << 20},
      [&](int r, engine::P2pOp op) { eng[r]->submit(std::move(op)); },
      [&](int r, test::Slot& s) { eng[r]->driveUntil([&s] { return s.done.load(); }); },
      [&] {
        for (auto& e : eng) e->shutdown();
      });
}

// Rank 0 waits for a message rank 1 never sends; `release` ends the wait.
template <class Release>
void waitReleased(const std::string& dir, const char* what, std::chrono::milliseconds within, Release release,
                  bool expectError) {
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store);
  Slot s;
  auto eng = std::make_unique<engine::P2pEngine>(d[0].get(), std::chrono::microseconds(20), 256 << 10, "p2ptest0");
  s.data.resize(1000);
  eng->submit(opFor(false, 1, s, within));
  const auto t0 = Clock::now();
  std::thread releaser([&] { release(*eng); });
  eng->driveUntil([&] { return s.done.load(); });
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  releaser.join();
  expect(s.done.load() && (s.errors.load() == 1) == expectError && secs < 5,
         std::string(what) + ": the wait returned after " + std::to_string(secs) + " s, done " +
             std::to_string(s.done.load()) + ", errors " + std::to_string(s.errors.load()));
  // After shutdown a wait on an op that can no longer finish returns at once.
  eng->shutdown();
  const auto t1 = Clock::now();
  eng->driveUntil([] { return false; });
  expect(Clock::now() - t1 < std::chrono::seconds(1), std::string(what) + ": a wait after shutdown returns at once");
}

// A recv nobody waits on (no caller drives the engine) when the engine shuts down: shutdown()
// fails it before returning, whether or not the engine's thread made a pass after the abort
// (one that woke only after the stop flag made no pass: the op was never finished, and a
// future waiting on it hung). Many rounds, since which way the thread goes is a race.
void testShutdownFailsUnwaitedOps(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store);
  int unfinished = 0;
  for (int round = 0; round < 50; ++round) {
    Slot s;
    s.data.resize(100);
    engine::P2pEngine eng(d[0].get(), std::chrono::microseconds(20), 256 << 10, "p2ptest0");
    eng.submit(opFor(false, 1, s, std::chrono::seconds(60)));
    if (round % 2 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the thread asleep, or not
    eng.shutdown();
    unfinished += !(s.done.load() && s.errors.load() == 1);
  }
  expect(unfinished == 0, "shutdown fails every op nobody waits on (" + std::to_string(unfinished) +
                              " of 50 left unfinished)");
}

}  // namespace

// stop() from another thread while a caller runs a task on its own thread (a blocking op run
// inline, or a wait() that took its queued op) returns once that task ends: the progress thread,
// asleep until then, must be woken to see it end.
void testProgressThreadStopsWhileACallerRunsATask(const std::string&) {
  engine::ProgressThread progress("smddp-test-pt", std::chrono::microseconds(0));
  std::atomic<bool> started{false};
  std::thread caller([&] {
    progress.tryRunInline([&] {
      started = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    });
  });
  while (!started) std::this_thread::sleep_for(std::chrono::milliseconds(1));
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

int main() {
  const std::vector<test::DirTest> tests = {
      testProgressThreadStopsWhileACallerRunsATask,
      testManyMessagesManyWaiters,
      testShutdownFailsUnwaitedOps,
      [](const std::string& dir) {
        waitReleased(dir, "deadline", std::chrono::milliseconds(300), [](engine::P2pEngine&) {}, true);
      },
      [](const std::string& dir) {
        waitReleased(
            dir, "shutdown from another thread", std::chrono::seconds(60),
            [](engine::P2pEngine& e) {
              std::this_thread::sleep_for(std::chrono::milliseconds(200));
              e.shutdown();
            },
            true);
      },
  };
  if (!test::runInOwnDirs("smddp_p2p_tests", tests)) return 1;
  return test::report();
}
