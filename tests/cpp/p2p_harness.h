// What the tests of the two point-to-point engines share (tests/cpp/test_p2p_engine.cc, shared
// memory; tests/cpp/test_net_p2p.cc, TCP): a message's bookkeeping, an op for it, and the
// many-messages exchange both run with two ranks as threads of the test's process.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/p2p_engine.h"
#include "expect.h"

namespace smddp::test {

// One message's bookkeeping, shared by the op's done callback and the threads that wait for it.
struct Slot {
  std::vector<uint8_t> data;
  std::atomic<bool> done{false};
  std::atomic<int> errors{0};
  std::string why;  // the error's text, written before `done`
};

inline engine::P2pOp opFor(bool isSend, int peer, Slot& s, std::chrono::milliseconds within, int tag = 3) {
  engine::P2pOp o;
  o.isSend = isSend;
  o.peer = peer;
  o.tag = tag;
  o.buffer = s.data.data();
  o.bytes = s.data.size();
  o.deadline = std::chrono::steady_clock::now() + within;
  o.done = [&s](std::exception_ptr e, int) {
    if (e) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        s.why = x.what();
      }
      s.errors.fetch_add(1);
    }
    s.done.store(true);
  };
  return o;
}

inline uint8_t pattern(int from, size_t msg, size_t i) { return static_cast<uint8_t>(from * 131 + msg * 7 + i * 13); }

// Each rank submits 60 sends and 60 recvs to the other (sizes cycled from `sizes`), sends and
// recvs interleaved, while three threads per rank wait for them in a shuffled order through
// `waitFor(rank, slot)` (started before the submissions end); then `shutdown()` (the engines'),
// and every op must be done, none failed, and every message must have arrived whole at its
// receive. Message m has tag m % 3 and the receives of each three go in reverse (tags 2, 1, 0), so
// most messages arrive while a receive waits for another tag and are read aside (p2p_matching.h).
inline void manyMessagesManyWaiters(const std::string& label, const std::vector<size_t>& sizes,
                                    const std::function<void(int, engine::P2pOp)>& submit,
                                    const std::function<void(int, Slot&)>& waitFor,
                                    const std::function<void()>& shutdown) {
  constexpr int kMessages = 60;
  // Both ranks' messages, out then in: they outlive the engines' callbacks (shutdown() below).
  std::vector<std::unique_ptr<Slot>> slots[2][2];
  for (int r = 0; r < 2; ++r) {
    for (auto& dir : slots[r]) dir.resize(kMessages);
    for (int m = 0; m < kMessages; ++m) {
      const size_t n = sizes[m % sizes.size()];
      for (auto& dir : slots[r]) {
        dir[m] = std::make_unique<Slot>();
        dir[m]->data.resize(n);
      }
      for (size_t i = 0; i < n; ++i) slots[r][0][m]->data[i] = pattern(r, m, i);
    }
  }
  std::atomic<int> stuck{0};
  auto rank = [&](int r) {
    auto& [out, in] = slots[r];
    std::vector<Slot*> order;
    for (int m = 0; m < kMessages; ++m) order.insert(order.end(), {out[m].get(), in[m].get()});
    std::shuffle(order.begin(), order.end(), std::mt19937(r));
    std::vector<std::thread> waiters;
    for (int w = 0; w < 3; ++w) {
      waiters.emplace_back([&, w] {
        for (size_t i = w; i < order.size(); i += 3) {
          waitFor(r, *order[i]);
          if (!order[i]->done.load()) stuck.fetch_add(1);
        }
      });
    }
    for (int m = 0; m < kMessages; ++m) {
      const int back = m / 3 * 3 + 2 - m % 3;  // the receives of each three in reverse
      submit(r, opFor(true, 1 - r, *out[m], std::chrono::seconds(60), m % 3));
      submit(r, opFor(false, 1 - r, *in[back], std::chrono::seconds(60), back % 3));
    }
    for (auto& t : waiters) t.join();
  };
  std::thread r1(rank, 1);
  rank(0);
  r1.join();
  shutdown();
  int failedOps = 0, wrong = 0;
  std::string firstError;
  for (int r = 0; r < 2; ++r) {
    for (int m = 0; m < kMessages; ++m) {
      const Slot& in = *slots[r][1][m];
      failedOps += slots[r][0][m]->errors.load() + in.errors.load();
      for (const Slot* s : {static_cast<const Slot*>(slots[r][0][m].get()), &in}) {
        // The error that broke the pair, rather than one that reports it as an earlier error.
        if (s->errors.load() > 0 && (firstError.empty() || firstError.rfind("an earlier", 0) == 0)) firstError = s->why;
      }
      for (size_t i = 0; i < in.data.size(); ++i) {
        if (in.data[i] != pattern(1 - r, m, i)) {
          ++wrong;
          break;
        }
      }
    }
  }
  expect(stuck == 0, label + "every wait returned with its op done (" + std::to_string(stuck) + " did not)");
  expect(failedOps == 0, label + "no op failed (" + std::to_string(failedOps) + " did" +
                             (firstError.empty() ? "" : ", e.g. " + firstError) + ")");
  expect(wrong == 0, label + "every message arrived whole at its receive (" + std::to_string(wrong) + " wrong)");
}

// MPI's rule for a message that several waiting receives match: the first posted takes it. Rank 1
// posts a recv from any source, then one from rank 0, both with tag 0; rank 0 sends m0 then m1
// with that tag, of sizes `first` and `second` (the receives' sizes in that order). The any-source
// recv must get m0 and the named one m1, whether the messages come while both wait
// (`recvsFirst`) or were sent before either was posted: it used to depend on that, the named one
// taking m0 whenever it waited (and failing on the size if the two differ).
inline void firstPostedReceiveTakes(const std::string& label, bool recvsFirst, size_t first, size_t second,
                                    const std::function<void(int, engine::P2pOp)>& submit,
                                    const std::function<void(int, Slot&)>& waitFor) {
  Slot m0, m1, anyRecv, namedRecv;
  m0.data.assign(first, 10);
  m1.data.assign(second, 11);
  anyRecv.data.resize(first);
  namedRecv.data.resize(second);
  const auto within = std::chrono::seconds(5);
  auto post = [&] {
    submit(1, opFor(false, -1, anyRecv, within, 0));
    submit(1, opFor(false, 0, namedRecv, within, 0));
  };
  if (recvsFirst) post();
  submit(0, opFor(true, 1, m0, within, 0));
  submit(0, opFor(true, 1, m1, within, 0));
  for (Slot* s : {&m0, &m1}) waitFor(0, *s);
  if (!recvsFirst) post();
  for (Slot* s : {&anyRecv, &namedRecv}) waitFor(1, *s);
  auto holds = [](const Slot& s, uint8_t v) {
    return s.done.load() && s.errors.load() == 0 &&
           std::all_of(s.data.begin(), s.data.end(), [v](uint8_t b) { return b == v; });
  };
  const std::string what = label + (recvsFirst ? "receives posted before the sends, " : "sends before the receives, ") +
                           std::to_string(first) + "- and " + std::to_string(second) + "-byte messages: ";
  expect(m0.errors.load() == 0 && m1.errors.load() == 0, what + "both sends succeed (" + m0.why + m1.why + ")");
  expect(holds(anyRecv, 10) && holds(namedRecv, 11),
         what + "the any-source recv, posted first, gets the first message and the named one the second (" +
             anyRecv.why + (anyRecv.why.empty() ? "" : "; ") + namedRecv.why + ")");
}

}  // namespace smddp::test
