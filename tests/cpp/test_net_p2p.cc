// Torch-free tests of the point-to-point engine between hosts (two ranks as two threads of this
// process, each its own "host" on loopback, bootstrapped through a FileStore): many messages of
// mixed sizes in both directions at once, over one connection per pair and striped over two,
// waited on by several threads that poll the sockets themselves (driveUntil: one at a time, the
// others wait for it) beside the engine's thread, land whole and in order; a waiter blocked on a
// recv whose sender never comes is released by the op's deadline, and by shutdown() from
// another thread; a wait after shutdown returns at once; a rank whose recv timed out tells its
// peer why (a farewell), and the peer's next recv reports it; of the receives a message matches,
// the first posted takes it. tests/test_core_cpp.py also builds it under ThreadSanitizer when
// clang can. Prints "N passed, N failed".
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/file_store.h"
#include "engine/net_p2p.h"
#include "expect.h"
#include "p2p_harness.h"
#include "two_hosts.h"
#include "transport/topology.h"

using namespace smddp;
using test::expect;
using test::opFor;
using test::Slot;
using test::twoHosts;
using Clock = std::chrono::steady_clock;

namespace {

// Both ranks' engines, made together (the constructor reads the peer's address from the store).
std::vector<std::unique_ptr<engine::NetP2p>> engines(Store& store, int lanes) {
  store.set("smddp/net/secret", std::string(32, 's'));
  const std::vector<net::LocalAddress> lo = {{"lo", "127.0.0.1", true, false}};
  std::vector<std::unique_ptr<engine::NetP2p>> e(2);
  auto make = [&](int r) {
    e[r] = std::make_unique<engine::NetP2p>(store, twoHosts(r), lo, lanes, std::chrono::microseconds(20),
                                            "np2ptest" + std::to_string(r));
  };
  std::thread other(make, 1);
  make(0);
  other.join();
  return e;
}

void testManyMessagesManyWaiters(const std::string& dir, int lanes) {
  FileStore store(dir, std::chrono::seconds(30));
  auto eng = engines(store, lanes);
  test::manyMessagesManyWaiters(
      std::to_string(lanes) + " connection(s) per pair: ", {0, 1, 4096, 64 * 1024, 300'001, 1 << 20},
      [&](int r, engine::P2pOp op) { eng[r]->submit(std::move(op)); },
      // One thread drives at a time: the others come back at once and try again until their op
      // is done (by the driver, or by the engine's thread).
      [&](int r, test::Slot& s) {
        const auto until = Clock::now() + std::chrono::seconds(60);
        while (!s.done.load() && Clock::now() < until) {
          eng[r]->driveUntil([&s] { return s.done.load(); });
          if (!s.done.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      },
      [&] {
        for (auto& e : eng) e->shutdown();
      });
}

// Rank 0 waits, driving, for a message rank 1 never sends; `release` ends the wait.
template <class Release>
void waitReleased(const std::string& dir, const char* what, std::chrono::milliseconds within, Release release) {
  FileStore store(dir, std::chrono::seconds(30));
  auto eng = engines(store, 1);
  Slot s;
  s.data.resize(1000);
  eng[0]->submit(opFor(false, 1, s, within));
  const auto t0 = Clock::now();
  std::thread releaser([&] { release(*eng[0]); });
  eng[0]->driveUntil([&] { return s.done.load(); });
  // After shutdown the engine's thread or shutdown() itself fails the op, maybe a moment later.
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (!s.done.load() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  releaser.join();
  expect(s.done.load() && s.errors.load() == 1 && secs < 5,
         std::string(what) + ": the wait returned after " + std::to_string(secs) + " s, done " +
             std::to_string(s.done.load()) + ", errors " + std::to_string(s.errors.load()));
  eng[0]->shutdown();
  const auto t1 = Clock::now();
  eng[0]->driveUntil([] { return false; });
  expect(Clock::now() - t1 < std::chrono::seconds(1), std::string(what) + ": a wait after shutdown returns at once");
}

// Rank 0's recv from rank 1 times out; rank 1's recv from rank 0, posted afterwards, must fail at
// once with rank 0's reason.
void testFarewell(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto eng = engines(store, 1);
  Slot warm0, warm1, timedOut, told;
  warm0.data.assign(8, 1);
  warm1.data.resize(8);
  eng[0]->submit(opFor(true, 1, warm0, std::chrono::seconds(30)));  // rank 0 dials; a message goes through
  eng[1]->submit(opFor(false, 0, warm1, std::chrono::seconds(30)));
  eng[1]->driveUntil([&] { return warm1.done.load(); });
  eng[0]->driveUntil([&] { return warm0.done.load(); });
  timedOut.data.resize(16);
  eng[0]->submit(opFor(false, 1, timedOut, std::chrono::milliseconds(200)));
  eng[0]->driveUntil([&] { return timedOut.done.load(); });
  told.data.resize(16);
  const auto t0 = Clock::now();
  eng[1]->submit(opFor(false, 0, told, std::chrono::seconds(30)));
  eng[1]->driveUntil([&] { return told.done.load(); });
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  expect(warm0.errors == 0 && warm1.errors == 0 && timedOut.errors == 1, "farewell: the set-up went as planned");
  expect(told.errors == 1 && told.why.find("gave up point-to-point with this rank") != std::string::npos &&
             told.why.find("timed out") != std::string::npos && secs < 5,
         "farewell: the peer's recv fails at once with the reason (" + std::to_string(secs) + " s): " + told.why);
}

void testFirstPostedReceiveTakes(const std::string& dir, bool recvsFirst, size_t first, size_t second) {
  FileStore store(dir, std::chrono::seconds(30));
  auto eng = engines(store, 1);
  test::firstPostedReceiveTakes(
      "TCP: ", recvsFirst, first, second, [&](int r, engine::P2pOp op) { eng[r]->submit(std::move(op)); },
      [&](int r, Slot& s) {
        const auto until = Clock::now() + std::chrono::seconds(10);
        while (!s.done.load() && Clock::now() < until) {
          eng[r]->driveUntil([&s] { return s.done.load(); });
          if (!s.done.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      });
  for (auto& e : eng) e->shutdown();
}

}  // namespace

int main() {
  const std::vector<test::DirTest> tests = {
      [](const std::string& dir) { testManyMessagesManyWaiters(dir, 1); },
      [](const std::string& dir) { testManyMessagesManyWaiters(dir, 2); },
      [](const std::string& dir) {
        waitReleased(dir, "deadline", std::chrono::milliseconds(300), [](engine::NetP2p&) {});
      },
      [](const std::string& dir) {
        waitReleased(dir, "shutdown from another thread", std::chrono::seconds(60), [](engine::NetP2p& e) {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          e.shutdown();
        });
      },
      testFarewell,
      [](const std::string& dir) { testFirstPostedReceiveTakes(dir, true, 10, 10); },
      [](const std::string& dir) { testFirstPostedReceiveTakes(dir, true, 10, 20); },
      [](const std::string& dir) { testFirstPostedReceiveTakes(dir, false, 10, 20); },
  };
  if (!test::runInOwnDirs("smddp_net_p2p_tests", tests)) return 1;
  return test::report();
}
