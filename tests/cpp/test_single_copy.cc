// The single-copy paths (algo/collectives.h). The all-gather's: ranks as threads of this process with
// shared-memory domains bootstrapped through a FileStore: uneven parts (one empty), out of place
// and gathered in place, land whole; ranks that disagree on reading in place (a CUDA rank's
// pinned staging beside a CPU rank's tensor) fail with a message naming both, instead of one
// reading a slot nobody wrote; a rank whose peer gave up (timed out, aborted) after publishing
// its last step, while this rank read its input, fails instead of returning what it read (the
// peer may have reused that input); a rank whose input other processes may not read (here
// memfd_secret's memory, as a driver's pinned memory may be) makes every rank stage the op, with
// the right result. Skipped, saying so, where the kernel forbids the reads.
// The all_reduce's single-copy path likewise: sums in place and out of place over slices none
// aligned, read in place where the host's first rank chooses to (three steps) and staged where it
// chooses not to; a rank whose buffers may not be read (memfd_secret's, or a rank that says so,
// as one whose buffers are CUDA's pinned staging) makes every rank stage, with the right sums.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "algo/collectives.h"
#include "algo/way_policy.h"
#include "algo_tests.h"
#include "core/error.h"
#include "core/file_store.h"
#include "core/hash.h"
#include "core/spin.h"
#include "core/types.h"
#include "domains.h"
#include "expect.h"
#include "secret_memory.h"
#include "transport/shm_domain.h"

using namespace smddp;
using test::expect;

namespace {

// Every rank's domain, made together (Domain::create is collective).
std::vector<std::unique_ptr<shm::Domain>> domains(Store& store, int world) {
  return test::makeDomains(store, world, 1 << 16, CpuShare{world, world});
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
    algo::OpContext ctx = contextFor(*d[r], 1, abort);
    if (r == 1) ctx.singleCopyBytes = SIZE_MAX;  // its input is, say, CUDA pinned staging
    algo::allgather(ctx, o);
  });
  expect(errors[0].find("this rank reads its host-mates' parts in place, rank 1 stages its part") != std::string::npos,
         "rank 0 of a disagreeing all-gather: \"" + errors[0] + "\"");
  expect(errors[1].find("this rank stages its part, rank 0 reads its host-mates' parts in place") != std::string::npos,
         "rank 1 of a disagreeing all-gather: \"" + errors[1] + "\"");
}

// Rank 0 plays an owner that announced its input, published both steps and then gave up (its
// timeout or an abort while it waited for rank 1's last step), all before rank 1 read anything:
// rank 1's all-gather must fail naming rank 0. (Until 2026-11-29 it returned success, and, with
// the owner's caller writing its input during the read, rank 1 got part of the new values.)
void testOwnerThatGaveUpFailsTheReader(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store, 2);
  if (!d[0]->allReadPeers()) return;  // said above
  constexpr uint64_t kCount = 5000;
  std::vector<float> ownerInput(kCount, 1.0f), readerInput(kCount, 2.0f), out(2 * kCount);
  // What algo::allgather announces at its first step (collectives.cc: writeDescriptor).
  const uint64_t k = d[0]->nextPhase();
  shm::OpDescriptor& desc = d[0]->descriptor(0, k);
  desc.seq = 1;
  desc.kind = static_cast<uint32_t>(OpKind::kAllgather);
  desc.dtype = static_cast<uint32_t>(DataType::kFloat32);
  desc.redop = static_cast<uint32_t>(ReduceOp::kSum);
  desc.root = -1;
  desc.count = kCount;
  desc.signature = 0;
  uint64_t layout = kFnv1aBasis;
  for (int p = 0; p < 2; ++p) layout = fnv1a(layout, &kCount, sizeof kCount);
  desc.layout = layout;
  desc.fingerprint = 0;
  desc.address = reinterpret_cast<uint64_t>(ownerInput.data());
  desc.readsInPlace = 1;
  d[0]->publish(k);
  d[0]->publish(d[0]->nextPhase());  // its last step, then it gives up
  d[0]->markFailed("rank 0: allgather #1: timed out waiting for rank(s) [1] to reach step 2");
  std::atomic<bool> abort{false};
  std::string error;
  try {
    algo::AllgatherOptions o{DataType::kFloat32, readerInput.data(), {out.data(), out.data() + kCount}, {kCount, kCount}};
    algo::OpContext ctx = contextFor(*d[1], 1, abort);
    algo::allgather(ctx, o);
  } catch (const std::exception& e) {
    error = e.what();
  }
  expect(error.find("rank 0 gave up on this collective while this rank read its part: rank 0: allgather #1: timed "
                    "out") != std::string::npos,
         "the reader of an owner that gave up: \"" + error + "\"");
}

void testUnreadableInputIsStaged(const std::string& dir) {
  constexpr int kWorld = 3;
  constexpr size_t kCount = 300001;  // several copy steps when staged
  float* secret = test::secretArray<float>(kCount);
  if (secret == nullptr) {
    std::printf("all-gather of an input other processes may not read: skipped, no memfd_secret here\n");
    return;
  }
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store, kWorld);
  if (!d[0]->allReadPeers()) return;  // said above
  expect(!d[1]->readableByPeers(secret, kCount * sizeof(float)), "memfd_secret memory reads as readable by peers");
  std::vector<std::vector<float>> ins(kWorld, std::vector<float>(kCount)), outs(kWorld, std::vector<float>(kWorld * kCount));
  for (int r = 0; r < kWorld; ++r) {
    for (size_t i = 0; i < kCount; ++i) ins[r][i] = valueAt(r, i);
  }
  std::copy(ins[1].begin(), ins[1].end(), secret);  // rank 1's input at #1: unreadable by the others
  std::atomic<bool> abort{false};
  for (uint64_t seq = 1; seq <= 2; ++seq) {  // and the group goes on reading in place afterwards
    const auto errors = onEveryRank(kWorld, [&](int r) {
      algo::AllgatherOptions o{DataType::kFloat32, r == 1 && seq == 1 ? secret : ins[r].data(), {},
                               std::vector<size_t>(kWorld, kCount)};
      for (int p = 0; p < kWorld; ++p) o.outputs.push_back(outs[r].data() + p * kCount);
      algo::OpContext ctx = contextFor(*d[r], seq, abort);
      algo::allgather(ctx, o);
    });
    for (int r = 0; r < kWorld; ++r) {
      size_t wrong = 0;
      for (int p = 0; p < kWorld; ++p) {
        for (size_t i = 0; i < kCount; ++i) wrong += outs[r][p * kCount + i] != valueAt(p, i);
      }
      const std::string what = "all-gather #" + std::to_string(seq) + (seq == 1 ? " (rank 1's input unreadable)" : "");
      expect(errors[r].empty(), what + ": rank " + std::to_string(r) + " failed: " + errors[r]);
      expect(wrong == 0, what + ": rank " + std::to_string(r) + " has " + std::to_string(wrong) + " wrong elements");
      std::fill(outs[r].begin(), outs[r].end(), -1.0f);
    }
  }
  munmap(secret, kCount * sizeof(float));
}

// A group shut down or aborted: its ops end at their next step, staged or read in place, even
// where the peers keep up and no wait sleeps (until 2026-11-29 only a sleeping wait looked, and
// destroy_process_group waited out a 2 GiB all-gather: 17 s).
void testAbortEndsTheOpBetweenSteps(const std::string& dir) {
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store, 2);
  std::atomic<bool> abort{true};
  for (size_t singleCopy : {size_t(1), SIZE_MAX}) {
    std::vector<std::vector<float>> ins(2, std::vector<float>(70000, 1.0f)), outs(2, std::vector<float>(140000));
    const auto errors = onEveryRank(2, [&](int r) {
      algo::AllgatherOptions o{DataType::kFloat32, ins[r].data(), {outs[r].data(), outs[r].data() + 70000},
                               {70000, 70000}};
      algo::OpContext ctx = contextFor(*d[r], 1, abort);
      ctx.singleCopyBytes = d[0]->allReadPeers() ? singleCopy : SIZE_MAX;
      algo::allgather(ctx, o);
    });
    for (int r = 0; r < 2; ++r) {
      expect(errors[r].find("shut down or aborted during the op") != std::string::npos,
             std::string(singleCopy == 1 ? "read in place" : "staged") + ", aborted: rank " + std::to_string(r) +
                 " ended with \"" + errors[r] + "\"");
    }
  }
}

// Small integers, so that float sums are exact in any order.
float addend(int rank, size_t i) { return static_cast<float>((rank + 1) * (i % 1000 + 1)); }

void testAllreduceReadsInPlace(const std::string& dir) {
  constexpr int kWorld = 3;
  constexpr size_t kCount = kWorld * (algo::kAllreduceSingleCopyMinBytes / sizeof(float)) + 77;
  FileStore store(dir, std::chrono::seconds(30));
  auto d = domains(store, kWorld);
  if (!d[0]->allReadPeers()) return;  // said above
  float* secret = test::secretArray<float>(kCount);
  enum class Case { kRead, kStage, kRankSaysUnreadable, kSecretInput };
  std::atomic<bool> abort{false};
  uint64_t seq = 0;
  for (Case c : {Case::kRead, Case::kStage, Case::kRankSaysUnreadable, Case::kSecretInput}) {
    if (c == Case::kSecretInput && secret == nullptr) {
      std::printf("all_reduce of an input other processes may not read: skipped, no memfd_secret here\n");
      continue;
    }
    for (int inPlace = 0; inPlace < 2; ++inPlace) {
      const std::string what = std::string(c == Case::kRead                 ? "read in place"
                                           : c == Case::kStage              ? "staged by rank 0's choice"
                                           : c == Case::kRankSaysUnreadable ? "rank 2's buffers unreadable"
                                                                            : "rank 1's input memfd_secret's") +
                               (inPlace ? ", in place" : ", out of place");
      std::vector<std::vector<float>> ins(kWorld, std::vector<float>(kCount)), outs(kWorld, std::vector<float>(kCount));
      for (int r = 0; r < kWorld; ++r) {
        for (size_t i = 0; i < kCount; ++i) ins[r][i] = addend(r, i);
      }
      if (c == Case::kSecretInput) std::copy(ins[1].begin(), ins[1].end(), secret);
      std::vector<uint64_t> steps(kWorld);
      std::vector<int> ways(kWorld);
      ++seq;
      const auto errors = onEveryRank(kWorld, [&](int r) {
        algo::WayPolicy policy(c == Case::kStage ? algo::WayPolicy::Mode::kNever : algo::WayPolicy::Mode::kAlways,
                               "single copy", "staged", "read in place");
        algo::WayChoice reads;
        reads.policy = &policy;
        reads.kind = OpKind::kAllreduce;
        algo::OpContext ctx = contextFor(*d[r], seq, abort);
        ctx.allreduceReads = &reads;
        ctx.buffersReadable = !(c == Case::kRankSaysUnreadable && r == 2);
        float* in = c == Case::kSecretInput && r == 1 ? secret : ins[r].data();
        algo::AllreduceOptions o{DataType::kFloat32, Reduction{}, kCount, in, inPlace ? in : outs[r].data(), -1};
        const uint64_t before = d[r]->lastPhase();
        algo::allreduce(ctx, o);
        steps[r] = d[r]->lastPhase() - before;
        ways[r] = reads.way;
        if (inPlace) std::copy(in, in + kCount, outs[r].begin());
      });
      for (int r = 0; r < kWorld; ++r) {
        size_t wrong = 0;
        for (size_t i = 0; i < kCount; ++i) wrong += outs[r][i] != 6.0f * static_cast<float>(i % 1000 + 1);
        const std::string who = "all_reduce, " + what + ": rank " + std::to_string(r);
        expect(errors[r].empty(), who + " failed: " + errors[r]);
        expect(wrong == 0, who + " has " + std::to_string(wrong) + " wrong elements");
        const bool reads = c == Case::kRead;
        expect(reads ? steps[r] == 3 : steps[r] > 3, who + " took " + std::to_string(steps[r]) + " steps (" +
                                                         (reads ? "read in place: 3" : "staged: more than 3") + ")");
      }
      // Where a buffer may not be read, the op cannot go the way asked: nothing to learn from it.
      const int asked = c == Case::kRead ? 1 : c == Case::kStage ? 0 : -1;
      expect(ways[0] == asked && ways[1] == -1 && ways[2] == -1,
             "all_reduce, " + what + ": the host's first rank alone asks its policy, and learns from what ran");
    }
  }
  if (secret != nullptr) munmap(secret, kCount * sizeof(float));
}

}  // namespace

void singleCopyTests() {
  expect(test::runInOwnDirs("smddp_single_copy",
                            {testUnevenPartsInAndOutOfPlace, testRanksThatDisagreeFail, testOwnerThatGaveUpFailsTheReader,
                             testUnreadableInputIsStaged, testAbortEndsTheOpBetweenSteps, testAllreduceReadsInPlace}),
         "could not make a directory for the test's FileStore");
}
