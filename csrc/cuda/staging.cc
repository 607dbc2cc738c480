#include "cuda/staging.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/error.h"

namespace smddp::cuda {
namespace {

// Elements per round when a round stages `slots` pieces of `es`-byte elements.
size_t piece(size_t roundBytes, size_t slots, size_t es) {
  // Each slot is aligned, so leave room for the padding.
  const size_t perSlot = roundBytes / slots;
  const size_t usable = perSlot >= kStagingAlign ? perSlot - kStagingAlign + 1 : 0;
  const size_t elems = usable / es;
  if (elems == 0) throw std::length_error("smddp: the CUDA staging buffer is too small for one element per rank");
  return elems;
}
}  // namespace

StagingPipeline::StagingPipeline(DeviceOps& ops, size_t capacityBytes)
    : ops_(ops), half_(capacityBytes / 2 / kStagingAlign * kStagingAlign), flags_(ops, 3) {
  if (half_ == 0) throw std::length_error("smddp: SMDDP_CUDA_STAGING_BYTES is too small");
  buffer_ = static_cast<uint8_t*>(ops_.hostAlloc(2 * half_));
}

StagingPipeline::~StagingPipeline() {
  abort();
  ops_.hostFree(buffer_);
}

Ticket StagingPipeline::enqueue(const std::vector<Round>& rounds, Stream stream) {
  for (const Round& r : rounds) {
    if (r.host == nullptr && r.stagingBytes > half_) {
      throw std::length_error("smddp: a staging round of " + std::to_string(r.stagingBytes) +
                              " bytes does not fit the half of SMDDP_CUDA_STAGING_BYTES (" + std::to_string(half_) +
                              " bytes)");
    }
  }
  std::lock_guard<std::mutex> lock(enqueueMutex_);
  Ticket t{nextRound_, rounds.size()};
  auto base = [&](size_t i) { return stagingOf(t, rounds, i); };
  auto stageIn = [&](size_t i) {
    for (const Copy& c : rounds[i].toHost) ops_.toHost(base(i), c, stream);
    ops_.signal(flags_.device(kReady), t.first + i, stream);
  };
  try {
    if (!rounds.empty()) stageIn(0);
    for (size_t i = 0; i < rounds.size(); ++i) {
      if (i + 1 < rounds.size()) stageIn(i + 1);  // overlaps the host work of round i
      ops_.waitFor(flags_.device(kDone), t.first + i, stream);
      for (const Copy& c : rounds[i].toDevice) ops_.toDevice(base(i), c, stream);
    }
    if (!rounds.empty()) ops_.signal(flags_.device(kBack), t.first + rounds.size() - 1, stream);
  } catch (...) {
    // Part of the op is on the stream (a device call refused a later copy). Its round numbers
    // are spent and released: the stream must not wait on them for ever, and the next op must
    // not take them, whose host side would then read this op's staged data as its own.
    nextRound_ += rounds.size();
    releaseAll(t);
    throw;
  }
  nextRound_ += rounds.size();
  return t;
}

void StagingPipeline::awaitRound(const Ticket& t, size_t i, std::chrono::steady_clock::time_point deadline) {
  awaitFlag(flags_.host(kReady), t.first + i, deadline, aborted_, "copy the op's data to pinned staging", "round");
}

void StagingPipeline::awaitCopiedBack(const Ticket& t, std::chrono::steady_clock::time_point deadline) {
  if (t.rounds > 0) {
    awaitFlag(flags_.host(kBack), t.first + t.rounds - 1, deadline, aborted_,
              "copy the op's results back from pinned staging", "round");
  }
}

// Rounds finish in order, but a release after a failure may run ahead: raiseFlag never moves back.
void StagingPipeline::publishDone(uint64_t g) { raiseFlag(flags_.host(kDone), g); }

void StagingPipeline::finishRound(const Ticket& t, size_t i) { publishDone(t.first + i); }

void StagingPipeline::releaseAll(const Ticket& t) {
  if (t.rounds > 0) publishDone(t.first + t.rounds - 1);
}

void StagingPipeline::abort() {
  aborted_.store(true);
  publishDone(kReleasedForever);
}

namespace {
// Rounds of `per` elements over `count`, each completed by `fill(round)`. An empty op still gets
// one (empty) round, so its host side runs and peers see it.
template <class Fill>
std::vector<Round> rounds(size_t count, size_t per, Fill fill) {
  std::vector<Round> out;
  size_t off = 0;
  do {
    Round r;
    r.offset = off;
    r.count = std::min(per, count - off);
    fill(r);
    out.push_back(std::move(r));
    off += per;
  } while (off < count);
  return out;
}

// Shared by gather and scatter: the single piece and the `world` pieces of a column block.
std::vector<Round> planColumns(uint8_t* single, uint8_t* blocks, size_t n, int world, size_t es,
                               size_t roundBytes, bool gather) {
  return rounds(n, piece(roundBytes, static_cast<size_t>(world) + 1, es), [&](Round& r) {
    const size_t bytes = r.count * es;
    const size_t pitch = alignStaging(bytes);
    // gather: [input piece][world output pieces]; scatter: [world input pieces][output piece].
    const size_t singleAt = gather ? 0 : pitch * world;
    const size_t blocksAt = gather ? pitch : 0;
    r.stagingBytes = pitch * (world + 1);
    const Copy one{single + r.offset * es, bytes, singleAt, bytes, bytes, 1};
    const Copy cols{blocks + r.offset * es, n * es, blocksAt, pitch, bytes, static_cast<size_t>(world)};
    if (gather) {
      r.toHost.push_back(one);
      r.toDevice.push_back(cols);
    } else {
      r.toHost.push_back(cols);
      r.toDevice.push_back(one);
    }
  });
}
}  // namespace

std::vector<Round> planFlat(uint8_t* device, size_t count, size_t es, size_t roundBytes, bool copyIn, bool copyOut) {
  return rounds(count, piece(roundBytes, 1, es), [&](Round& r) {
    const size_t bytes = r.count * es;
    r.stagingBytes = bytes;
    const Copy c{device + r.offset * es, bytes, 0, bytes, bytes, 1};
    if (copyIn) r.toHost.push_back(c);
    if (copyOut) r.toDevice.push_back(c);
  });
}

std::vector<Round> planGather(const uint8_t* input, uint8_t* output, size_t n, int world, size_t es,
                              size_t roundBytes) {
  return planColumns(const_cast<uint8_t*>(input), output, n, world, es, roundBytes, true);
}

std::vector<Round> planScatter(const uint8_t* input, uint8_t* output, size_t n, int world, size_t es,
                               size_t roundBytes) {
  return planColumns(output, const_cast<uint8_t*>(input), n, world, es, roundBytes, false);
}

}  // namespace smddp::cuda
