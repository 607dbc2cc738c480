// Torch-free tests of the shared-memory point-to-point engine (two ranks as two threads of this
// process, bootstrapped through a FileStore): many messages of mixed sizes in both directions at
// once (the large ones read by the receiver straight from the sender's buffer, unless
// SMDDP_P2P_SINGLE_COPY_BYTES=0 or the kernel refuses: the first line says which), waited on by several threads that run the engine themselves (driveUntil) beside its own
// thread, land whole and in order; a waiter blocked on a recv whose sender never comes is
// released by the op's deadline, and by shutdown() from another thread; a wait after shutdown
// returns at once; of the receives a message matches, the first posted takes it; a message
// handed over by address whose send failed before it was read fails its recv instead of
// delivering the reused buffer, and a send whose message is being read waits for the read; a
// large send from memory its receiver may not read is copied instead of handed over.
// The same binary tests a group's progress thread (test_progress_thread.cc).
// tests/test_core_cpp.py also builds it under ThreadSanitizer when clang can.
// Prints "N passed, N failed".
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/file_store.h"
#include "core/spin.h"
#include "domains.h"
#include "engine/p2p_engine.h"
#include "expect.h"
#include "p2p_harness.h"
#include "secret_memory.h"
#include "transport/shm_domain.h"

using namespace smddp;
using test::expect;
using test::opFor;
using test::Slot;
using Clock = std::chrono::steady_clock;

namespace {

// Both ranks' domains, made together (Domain::create is collective).
std::vector<std::unique_ptr<shm::Domain>> domains(Store& store) {
  return test::makeDomains(store, 2, 1 << 20, CpuShare{2, usableCpus()});
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

// Waits (5 s at most) until rank 0 has published its first chunk to rank 1.
void awaitFirstChunk(shm::Domain& receiver) {
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (receiver.sentTo(0, 1).load() == 0 && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// The two ranks' engines, for a test of its own.
std::vector<std::unique_ptr<engine::P2pEngine>> engines(std::vector<std::unique_ptr<shm::Domain>>& d) {
  std::vector<std::unique_ptr<engine::P2pEngine>> e;
  for (int r = 0; r < 2; ++r) {
    e.push_back(std::make_unique<engine::P2pEngine>(d[r].get(), std::chrono::microseconds(20), 256 << 10,
                                                    "p2ptest" + std::to_string(r)));
  }
  return e;
}

void testFirstPostedReceiveTakes(const std::string& dir, bool recvsFirst, size_t first, size_t second) {
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store);
  auto eng = engines(d);
  test::firstPostedReceiveTakes(
      "shared memory: ", recvsFirst, first, second, [&](int r, engine::P2pOp op) { eng[r]->submit(std::move(op)); },
      [&](int r, Slot& s) { eng[r]->driveUntil([&s] { return s.done.load(); }); });
  for (auto& e : eng) e->shutdown();
}

// The matching itself (p2p_matching.h), for the case the engines cannot be steered into: two
// messages of one tag read aside (unexpected) become takeable while a named receive and an
// any-source one posted before it both wait. The first posted must get the first message; the
// named receives used to be served before any any-source one.
void testServeUnexpectedFirstPosted(const std::string&) {
  for (const bool anyFirst : {true, false}) {
    std::deque<engine::P2pOp> recvs, anyRecvs;
    engine::UnexpectedQueue unexpected;
    for (uint8_t m = 0; m < 2; ++m) {
      unexpected.push_back(std::make_unique<engine::Unexpected>());
      unexpected.back()->data = {m};
      unexpected.back()->whole = true;
    }
    uint8_t gotAny = 9, gotNamed = 9;
    auto recv = [](int peer, uint8_t* into, uint64_t seq) {
      engine::P2pOp op;
      op.peer = peer;
      op.buffer = into;
      op.bytes = 1;
      op.postSeq = seq;
      return op;
    };
    anyRecvs.push_back(recv(-1, &gotAny, anyFirst ? 1 : 2));
    recvs.push_back(recv(0, &gotNamed, anyFirst ? 2 : 1));
    std::string sizeError;
    int served = 0;
    engine::serveUnexpected(recvs, anyRecvs, unexpected, 0, 0,
                            [&](engine::P2pOp, std::exception_ptr e, int) { served += e ? 0 : 1; }, &sizeError);
    const std::string what = anyFirst ? "any-source recv posted first" : "named recv posted first";
    expect(served == 2 && sizeError.empty(), "serveUnexpected, " + what + ": both receives served");
    expect(gotAny == (anyFirst ? 0 : 1) && gotNamed == (anyFirst ? 1 : 0),
           "serveUnexpected, " + what + ": it gets the first message (any-source got " + std::to_string(gotAny) +
               ", named " + std::to_string(gotNamed) + ")");
  }
}

// A send handed over by address (single copy) fails before its receiver read it, and the caller
// reuses the buffer; the receiver then posts its recv (`readAside`: a recv for another tag, which
// reads the message aside). The receiver must get an error naming the withdrawn message, never
// what the buffer holds now: it used to read that, silently.
void testWithdrawnBeforeRead(const std::string& dir, bool byShutdown, bool readAside) {
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store);
  if (!d[0]->readsPeers(1)) {
    std::printf("skipped: no single-copy reads here (a send withdrawn before it was read)\n");
    return;
  }
  auto eng = engines(d);
  Slot send, recv;
  send.data.assign(1 << 20, 0xAA);
  eng[0]->submit(opFor(true, 1, send, byShutdown ? std::chrono::seconds(60) : std::chrono::milliseconds(200)));
  awaitFirstChunk(*d[1]);  // offered: rank 1 could read it from now on
  if (byShutdown) eng[0]->shutdown();
  eng[0]->driveUntil([&] { return send.done.load(); });
  std::fill(send.data.begin(), send.data.end(), 0xEE);  // the caller's again
  recv.data.assign(readAside ? 16 : 1 << 20, 0);
  eng[1]->submit(opFor(false, 0, recv, std::chrono::seconds(3), readAside ? 4 : 3));
  eng[1]->driveUntil([&] { return recv.done.load(); });
  const std::string what = std::string("a send withdrawn by its ") + (byShutdown ? "shutdown" : "timeout") +
                           (readAside ? ", met by a recv for another tag" : "") + ": ";
  expect(send.errors.load() == 1, what + "the send failed (" + send.why + ")");
  const std::string withdrew = "rank 0 withdrew its message (tag 3, 1048576 bytes) before this rank read it, because "
                               "its send failed";
  expect(recv.errors.load() == 1 && recv.why.find(withdrew) != std::string::npos,
         what + "the recv fails, saying why: " + recv.why);
  expect(std::count(recv.data.begin(), recv.data.end(), 0xEE) == 0, what + "the recv got none of the reused buffer");
  for (auto& e : eng) e->shutdown();
}

// Rank 1, played by the test through its domain, claims a message handed over by address as its
// engine would before reading it, holds the claim past the send's deadline or while rank 0 shuts
// down, then reads it and consumes the chunk. The send must not hand its buffer back while it is
// read: after a timeout it completes (the message was delivered), on shutdown it fails only once
// the read is over. Both used to fail the send at once.
void testSendBeingRead(const std::string& dir, bool byShutdown) {
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store);
  if (!d[0]->readsPeers(1)) {
    std::printf("skipped: no single-copy reads here (a send being read)\n");
    return;
  }
  engine::P2pEngine eng(d[0].get(), std::chrono::microseconds(20), 256 << 10, "p2ptest0");
  Slot send;
  send.data.assign(1 << 20, 0xAA);
  eng.submit(opFor(true, 1, send, byShutdown ? std::chrono::seconds(60) : std::chrono::milliseconds(200)));
  awaitFirstChunk(*d[1]);
  uint32_t offered = engine::P2pEngine::kOffered;
  const bool claimed =
      engine::P2pEngine::claimOf(d[1]->outbox(0, 1, 0)).compare_exchange_strong(offered, engine::P2pEngine::kReading);
  const std::string what =
      std::string("a send being read when ") + (byShutdown ? "its engine shuts down" : "its deadline passes") + ": ";
  expect(claimed, what + "the message was offered by address (claim word " + std::to_string(offered) + ")");
  std::thread shutdown;
  if (byShutdown) shutdown = std::thread([&] { eng.shutdown(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const bool waits = !send.done.load();  // `why` is the engine's to write until `done`
  expect(waits, what + "the send waits for the read" + (waits ? "" : " (" + send.why + ")"));
  std::vector<uint8_t> got(send.data.size());
  const int err = d[1]->readFromPeer(0, got.data(), reinterpret_cast<uint64_t>(send.data.data()), got.size());
  d[1]->consumedFrom(1, 0).store(1, std::memory_order_release);
  d[1]->ringDoorbell(0);
  if (byShutdown) shutdown.join();
  eng.driveUntil([&] { return send.done.load(); });
  expect(err == 0 && std::count(got.begin(), got.end(), 0xAA) == static_cast<std::ptrdiff_t>(got.size()),
         what + "the read got the message whole");
  expect(send.done.load() && send.errors.load() == (byShutdown ? 1 : 0),
         what + (byShutdown ? "the send fails once read" : "the send completes once read") + " (" + send.why + ")");
  eng.shutdown();
}

// A send large enough to be read in place, from memory its receiver may not read (memfd_secret's,
// as a driver's pinned memory may be): it must go through the mailboxes. It was handed over by
// address, and the receiver's read failed with EFAULT, failing both ops and the pair after them.
void testUnreadableSendIsCopied(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store);
  if (!d[0]->readsPeers(1)) {
    std::printf("skipped: no single-copy reads here (a send from memory peers may not read)\n");
    return;
  }
  constexpr size_t kBytes = 1 << 20;  // well past the engines' 256 KiB
  uint8_t* secret = test::secretArray<uint8_t>(kBytes);
  if (secret == nullptr) {
    std::printf("skipped: no memfd_secret here (a send from memory peers may not read)\n");
    return;
  }
  auto eng = engines(d);
  for (int m = 0; m < 2; ++m) {  // and the pair carries on
    Slot send, recv;
    send.data.resize(kBytes);
    for (size_t i = 0; i < kBytes; ++i) secret[i] = test::pattern(0, m, i);
    recv.data.assign(kBytes, 0);
    engine::P2pOp op = opFor(true, 1, send, std::chrono::seconds(10));
    op.buffer = secret;
    eng[0]->submit(std::move(op));
    eng[1]->submit(opFor(false, 0, recv, std::chrono::seconds(10)));
    eng[1]->driveUntil([&] { return recv.done.load(); });
    eng[0]->driveUntil([&] { return send.done.load(); });
    size_t wrong = 0;
    for (size_t i = 0; i < kBytes; ++i) wrong += recv.data[i] != test::pattern(0, m, i);
    const std::string what = "a send from memory peers may not read, #" + std::to_string(m + 1) + ": ";
    expect(send.errors.load() == 0, what + "the send failed: " + send.why);
    expect(recv.errors.load() == 0, what + "the recv failed: " + recv.why);
    expect(wrong == 0, what + std::to_string(wrong) + " wrong bytes");
  }
  for (auto& e : eng) e->shutdown();
  munmap(secret, kBytes);
}

}  // namespace

// test_progress_thread.cc
void testProgressThreadStopsWhileACallerRunsATask(const std::string&);
void progressThreadTests();

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
      [](const std::string& dir) { testFirstPostedReceiveTakes(dir, true, 10, 10); },
      [](const std::string& dir) { testFirstPostedReceiveTakes(dir, true, 10, 20); },
      [](const std::string& dir) { testFirstPostedReceiveTakes(dir, false, 10, 20); },
      testServeUnexpectedFirstPosted,
      [](const std::string& dir) { testWithdrawnBeforeRead(dir, false, false); },
      [](const std::string& dir) { testWithdrawnBeforeRead(dir, true, false); },
      [](const std::string& dir) { testWithdrawnBeforeRead(dir, false, true); },
      [](const std::string& dir) { testSendBeingRead(dir, false); },
      [](const std::string& dir) { testSendBeingRead(dir, true); },
      testUnreadableSendIsCopied,
  };
  if (!test::runInOwnDirs("smddp_p2p_tests", tests)) return 1;
  progressThreadTests();
  return test::report();
}
