// The all-gather's single-copy path (algo/collectives.h), ranks as threads of this process with
// shared-memory domains bootstrapped through a FileStore: uneven parts (one empty), out of place
// and gathered in place, land whole; ranks that disagree on reading in place (a CUDA rank's
// pinned staging beside a CPU rank's tensor) fail with a message naming both, instead of one
// reading a slot nobody wrote. Skipped, saying so, where the kernel forbids the reads.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "algo/collectives.h"
#include "algo_tests.h"
#include "core/error.h"
#include "core/file_store.h"
#include "core/spin.h"
#include "expect.h"
#include "transport/shm_domain.h"

using namespace smddp;
using test::expect;

namespace {

// Every rank's domain, made together (Domain::create is collective).
std::vector<std::unique_ptr<shm::Domain>> domains(Store& store, int world) {
  std::vector<std::unique_ptr<shm::Domain>> d(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] { d[r] = shm::Domain::create(store, r, world, 1 << 16, CpuShare{world, world}); });
  }
  for (auto& t : threads) t.join();
  return d;
}

algo::OpContext contextFor(shm::Domain& d, uint64_t seq, const std::atomic<bool>& abort) {
  algo::OpContext ctx;
  ctx.domain = &d;
  ctx.rank = d.rank();
  ctx.size = d.size();
  ctx.seq = seq;
  ctx.wait.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  ctx.wait.abort = &abort;
  ctx.oneShotMaxBytes = 0;
  ctx.copyStepBytes = 4096;
  ctx.singleCopyBytes = 1;  // every part read in place
  return ctx;
}

float valueAt(int rank, size_t i) { return static_cast<float>(rank * 100000 + i); }

// Runs fn(rank) on a thread per rank; the error text each rank ended with ("" if none).
template <class Fn>
std::vector<std::string> onEveryRank(int world, Fn fn) {
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

void testUnevenPartsInAndOutOfPlace(const std::string& dir) {
  constexpr int kWorld = 3;
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store, kWorld);
  if (!d[0]->allReadPeers()) {
    std::printf("all-gather single copy: skipped, the kernel does not let these threads' process read itself\n");
    return;
  }
  const std::vector<size_t> counts = {70001, 0, 1025};  // one empty part, none aligned
  size_t total = 0;
  for (size_t c : counts) total += c;
  std::atomic<bool> abort{false};
  for (int inPlace = 0; inPlace < 2; ++inPlace) {
    std::vector<std::vector<float>> outs(kWorld, std::vector<float>(total, -1.0f));
    std::vector<std::vector<float>> ins(kWorld);
    const auto errors = onEveryRank(kWorld, [&](int r) {
      algo::AllgatherOptions o{DataType::kFloat32, nullptr, {}, counts};
      size_t at = 0;
      for (int p = 0; p < kWorld; ++p) {
        o.outputs.push_back(outs[r].data() + at);
        at += counts[p];
      }
      float* mine = static_cast<float*>(o.outputs[r]);
      if (!inPlace) {
        ins[r].resize(counts[r]);
        mine = ins[r].data();
      }
      for (size_t i = 0; i < counts[r]; ++i) mine[i] = valueAt(r, i);
      o.input = mine;
      algo::OpContext ctx = contextFor(*d[r], 1 + inPlace, abort);
      algo::allgather(ctx, o);
    });
    const std::string how = inPlace ? "in place" : "out of place";
    for (int r = 0; r < kWorld; ++r) {
      expect(errors[r].empty(), "single-copy all-gather " + how + ": rank " + std::to_string(r) + " failed: " +
                                    errors[r]);
      size_t wrong = 0, at = 0;
      for (int p = 0; p < kWorld; ++p) {
        for (size_t i = 0; i < counts[p]; ++i) wrong += outs[r][at + i] != valueAt(p, i);
        at += counts[p];
      }
      expect(wrong == 0, "single-copy all-gather " + how + ": rank " + std::to_string(r) + " has " +
                             std::to_string(wrong) + " wrong elements");
    }
  }
}

void testRanksThatDisagreeFail(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store, 2);
  if (!d[0]->allReadPeers()) return;  // said above
  std::atomic<bool> abort{false};
  std::vector<std::vector<float>> ins(2, std::vector<float>(5000, 1.0f)), outs(2, std::vector<float>(10000));
  const auto errors = onEveryRank(2, [&](int r) {
    algo::AllgatherOptions o{DataType::kFloat32, ins[r].data(), {outs[r].data(), outs[r].data() + 5000}, {5000, 5000}};
    o.mayReadInPlace = r == 0;  // rank 1's input is, say, CUDA pinned staging
    algo::OpContext ctx = contextFor(*d[r], 1, abort);
    algo::allgather(ctx, o);
  });
  expect(errors[0].find("this rank reads its host-mates' parts in place, rank 1 stages its part") != std::string::npos,
         "rank 0 of a disagreeing all-gather: \"" + errors[0] + "\"");
  expect(errors[1].find("this rank stages its part, rank 0 reads its host-mates' parts in place") != std::string::npos,
         "rank 1 of a disagreeing all-gather: \"" + errors[1] + "\"");
}

}  // namespace

void allgatherSingleCopyTests() {
  expect(test::runInOwnDirs("smddp_allgather_single_copy", {testUnevenPartsInAndOutOfPlace, testRanksThatDisagreeFail}),
         "could not make a directory for the test's FileStore");
}
