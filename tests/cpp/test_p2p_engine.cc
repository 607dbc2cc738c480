// Torch-free tests of the shared-memory point-to-point engine (two ranks as two threads of this
// process, bootstrapped through a FileStore): many messages of mixed sizes in both directions at
// once (the large ones read by the receiver straight from the sender's buffer, unless
// SMDDP_P2P_SINGLE_COPY_BYTES=0 or the kernel refuses: the first line says which), waited on by several threads that run the engine themselves (driveUntil) beside its own
// thread, land whole and in order; a waiter blocked on a recv whose sender never comes is
// released by the op's deadline, and by shutdown() from another thread; a wait after shutdown
// returns at once. tests/test_core_cpp.py also builds it under ThreadSanitizer when clang can.
// Prints "N passed, N failed".
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/file_store.h"
#include "core/spin.h"
#include "engine/p2p_engine.h"
#include "expect.h"
#include "transport/shm_domain.h"

using namespace smddp;
using test::expect;
using Clock = std::chrono::steady_clock;

namespace {

// One message's bookkeeping, shared by the op's done callback and the threads that wait for it.
struct Slot {
  std::vector<uint8_t> data;
  std::atomic<bool> done{false};
  std::atomic<int> errors{0};
};

engine::P2pOp opFor(bool isSend, int peer, Slot& s, std::chrono::milliseconds within) {
  engine::P2pOp o;
  o.isSend = isSend;
  o.peer = peer;
  o.tag = 3;
  o.buffer = s.data.data();
  o.bytes = s.data.size();
  o.deadline = Clock::now() + within;
  o.done = [&s](std::exception_ptr e, int) {
    if (e) s.errors.fetch_add(1);
    s.done.store(true);
  };
  return o;
}

uint8_t pattern(int from, size_t msg, size_t i) { return static_cast<uint8_t>(from * 131 + msg * 7 + i * 13); }

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
  const size_t sizes[] = {0, 1, 64 * 1024 - 64, 64 * 1024, 200'001, 300'000, 1 << 20};
  constexpr int kMessages = 60;
  std::atomic<int> wrong{0}, failed{0}, stuck{0};
  auto rank = [&](int r) {
    std::vector<std::unique_ptr<Slot>> out(kMessages), in(kMessages);  // outlive the engine's callbacks
    for (int m = 0; m < kMessages; ++m) {
      const size_t n = sizes[m % std::size(sizes)];
      out[m] = std::make_unique<Slot>();
      in[m] = std::make_unique<Slot>();
      out[m]->data.resize(n);
      in[m]->data.resize(n);
      for (size_t i = 0; i < n; ++i) out[m]->data[i] = pattern(r, m, i);
    }
    engine::P2pEngine eng(d[r].get(), std::chrono::microseconds(20), 256 << 10, "p2ptest" + std::to_string(r));
    // Sends and recvs interleaved; the waiters start while the ops are still being submitted.
    std::vector<Slot*> all;
    for (int m = 0; m < kMessages; ++m) {
      all.push_back(out[m].get());
      all.push_back(in[m].get());
    }
    std::mt19937 rng(r);
    std::vector<Slot*> order = all;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::thread> waiters;
    for (int w = 0; w < 3; ++w) {
      waiters.emplace_back([&, w] {
        for (size_t i = w; i < order.size(); i += 3) {
          Slot* s = order[i];
          eng.driveUntil([s] { return s->done.load(); });
          if (!s->done.load()) stuck.fetch_add(1);
        }
      });
    }
    for (int m = 0; m < kMessages; ++m) {
      eng.submit(opFor(true, 1 - r, *out[m], std::chrono::seconds(60)));
      eng.submit(opFor(false, 1 - r, *in[m], std::chrono::seconds(60)));
    }
    for (auto& t : waiters) t.join();
    for (int m = 0; m < kMessages; ++m) {
      failed += out[m]->errors.load() + in[m]->errors.load();
      for (size_t i = 0; i < in[m]->data.size(); ++i) {
        if (in[m]->data[i] != pattern(1 - r, m, i)) {
          wrong.fetch_add(1);
          break;
        }
      }
    }
  };
  std::thread r1(rank, 1);
  rank(0);
  r1.join();
  expect(stuck == 0, "every wait returned with its op done (" + std::to_string(stuck) + " did not)");
  expect(failed == 0, "no op failed (" + std::to_string(failed) + " did)");
  expect(wrong == 0, "every message arrived whole and in order (" + std::to_string(wrong) + " wrong)");
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

}  // namespace

int main() {
  const std::vector<void (*)(const std::string&)> tests = {
      testManyMessagesManyWaiters,
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
  for (auto test : tests) {
    char dir[] = "/tmp/smddp_p2p_tests.XXXXXX";  // each test's own store
    if (!mkdtemp(dir)) return 1;
    test(dir);
    std::filesystem::remove_all(dir);
  }
  return test::report();
}
