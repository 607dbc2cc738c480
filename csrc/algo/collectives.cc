#include "algo/collectives.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>

#include "core/slices.h"
#include "core/copy.h"
#include "core/error.h"
#include "core/hash.h"
#include "core/log.h"
#include "core/reduce.h"

namespace smddp::algo {
namespace {

// Whether this op stages with streaming stores (way_policy.h); only large ones may.
bool stagesStreamed(OpContext& ctx, size_t bytesPerRank) {
  WayChoice* c = ctx.staging;
  if (c == nullptr || !isLargeStaging(bytesPerRank, ctx.size)) return false;
  return c->take(bytesPerRank * static_cast<size_t>(ctx.size));
}

struct Expect {
  OpKind kind;
  DataType dtype;
  ReduceOp redop;
  int root;
  bool readsInPlace = false;  // single copy (see the header)
  uint32_t way = 0;  // an all_reduce that may read in place: the host's first rank's choice
};

// FNV-1a over the element count this rank expects of each rank (OpDescriptor::layout).
template <class CountOf>
uint64_t layoutOf(int size, CountOf countOf) {
  uint64_t h = kFnv1aBasis;
  for (int p = 0; p < size; ++p) {
    const uint64_t c = countOf(p);
    h = fnv1a(h, &c, sizeof c);
  }
  return h;
}

void writeDescriptor(OpContext& ctx, uint64_t phase, const Expect& e, uint64_t count, uint64_t layout,
                     const void* address) {
  shm::OpDescriptor& d = ctx.domain->descriptor(ctx.rank, phase);
  d.address = reinterpret_cast<uint64_t>(address);
  d.readsInPlace = e.readsInPlace ? 1 : 0;
  d.way = e.way;
  d.seq = ctx.seq;
  d.kind = static_cast<uint32_t>(e.kind);
  d.dtype = static_cast<uint32_t>(e.dtype);
  d.redop = static_cast<uint32_t>(e.redop);
  d.root = e.root;
  d.count = count;
  d.signature = ctx.signature;
  d.shape = ctx.shape;
  d.layout = layout;
  d.fingerprint = ctx.fingerprint;
  if (ctx.fingerprint != 0 && ctx.text != nullptr) {
    const size_t n = std::min(ctx.text->size(), shm::kOpTextBytes - 1);
    std::memcpy(d.text, ctx.text->data(), n);
    d.text[n] = '\0';
  }
}

// After the first phase of an op: every peer must be running the same collective with matching
// arguments. `countOf(p)` is the element count this rank expects rank p to have announced.
template <class CountOf>
void checkDescriptors(OpContext& ctx, uint64_t phase, const Expect& e, CountOf countOf, uint64_t layout) {
  for (int p = 0; p < ctx.size; ++p) {
    if (p == ctx.rank) continue;
    const shm::OpDescriptor& d = ctx.domain->descriptor(p, phase);
    const int who = ctx.domain->groupRank(p);  // p counts this host's ranks
    if (d.seq == ctx.seq && d.signature != ctx.signature) {
      throwError(ErrorCode::kInvalidUsage,
                 "collectives do not match across ranks: this rank runs %s but rank %d runs %s. Every rank must "
                 "issue the same collectives in the same order with matching sizes and dtypes",
                 OpSignature::unpack(ctx.signature).describe(ctx.seq).c_str(), who,
                 OpSignature::unpack(d.signature).describe(d.seq).c_str());
    }
    if (d.seq == ctx.seq && d.kind == static_cast<uint32_t>(e.kind) && d.dtype == static_cast<uint32_t>(e.dtype) &&
        d.redop == static_cast<uint32_t>(e.redop) && d.root == e.root && d.count == countOf(p) &&
        d.shape == ctx.shape) {
      continue;
    }
    if (d.seq != ctx.seq || d.shape != ctx.shape) {  // what the caller passed differs: told in its terms
      OpSignature ours = OpSignature::unpack(ctx.signature), theirs = OpSignature::unpack(d.signature);
      ours.shape = ctx.shape;
      theirs.shape = d.shape;
      throw Error(ErrorCode::kInvalidUsage, OpSignature::mismatchText(ours, ctx.seq, who, theirs, d.seq));
    }
    // The algorithm's own step differs (smddp's settings differ between ranks?): told in the
    // step's terms, as the signatures describe themselves.
    throwError(ErrorCode::kInvalidUsage,
               "collectives do not match across ranks: this rank runs %s, expecting %llu elements from rank %d, but "
               "rank %d runs %s with %llu elements. Every rank must issue the same collectives in the same order "
               "with matching sizes and dtypes",
               OpSignature::unpack(ctx.signature).describe(ctx.seq).c_str(),
               static_cast<unsigned long long>(countOf(p)), who, who,
               OpSignature::unpack(d.signature).describe(d.seq).c_str(), static_cast<unsigned long long>(d.count));
  }
  for (int p = 0; p < ctx.size; ++p) {
    if (p == ctx.rank || ctx.domain->descriptor(p, phase).layout == layout) continue;
    std::string mine;
    for (int q = 0; q < ctx.size && q < 16; ++q) mine += (q ? ", " : "") + std::to_string(countOf(q));
    throwError(ErrorCode::kInvalidUsage,
               "collectives do not match across ranks: at %s #%llu this rank takes the ranks' parts to have [%s%s] "
               "elements, rank %d takes them to have other sizes (uneven reduce_scatter blocks, all_gather outputs "
               "or gather lists must have the same sizes on every rank)",
               opKindName(e.kind), static_cast<unsigned long long>(ctx.seq), mine.c_str(),
               ctx.size > 16 ? ", ..." : "", ctx.domain->groupRank(p));
  }
  // Only all-gathers and all_reduces may read in place (other kinds always announce 0): the loop,
  // and the descriptor line it reads, stay off every other op's first step. All_reduce ranks
  // agree on it (the group's setting), so a mismatch there is smddp's own bug, told all the same.
  const bool mayRead = e.kind == OpKind::kAllgather || e.kind == OpKind::kAllreduce;
  for (int p = 0; mayRead && p < ctx.size; ++p) {
    if (p == ctx.rank || (ctx.domain->descriptor(p, phase).readsInPlace != 0) == e.readsInPlace) continue;
    throwError(ErrorCode::kInvalidUsage,
               "collectives do not match across ranks: at %s #%llu this rank %s, rank %d %s%s",
               opKindName(e.kind), static_cast<unsigned long long>(ctx.seq),
               e.readsInPlace ? "reads its host-mates' parts in place" : "stages its part",
               ctx.domain->groupRank(p), e.readsInPlace ? "stages its part" : "reads its host-mates' parts in place",
               e.kind == OpKind::kAllgather ? " (an all_gather of CUDA tensors on some ranks and CPU tensors on "
                                              "others?)"
                                            : "");
  }
  // Debug checks: the callers' full descriptions must agree too (shapes, API), where both sides
  // have them on.
  if (ctx.fingerprint == 0) return;
  for (int p = 0; p < ctx.size; ++p) {
    if (p == ctx.rank) continue;
    const shm::OpDescriptor& d = ctx.domain->descriptor(p, phase);
    if (d.fingerprint == 0 || d.fingerprint == ctx.fingerprint) continue;
    const std::string theirs(d.text, strnlen(d.text, shm::kOpTextBytes));
    throwError(ErrorCode::kInvalidUsage,
               "collectives do not match across ranks (SMDDP_DEBUG_CHECKS): at %s #%llu this rank runs %s but "
               "rank %d runs %s",
               opKindName(e.kind), static_cast<unsigned long long>(ctx.seq), ctx.text ? ctx.text->c_str() : "?",
               ctx.domain->groupRank(p), theirs.c_str());
  }
}

bool abortedIn(const OpContext& ctx) {
  return ctx.wait.abort != nullptr && ctx.wait.abort->load(std::memory_order_relaxed);
}

// A shutdown or abort ends a long op between its steps (and a single copy between its pieces),
// not only where a wait sleeps: a step whose peers keep up never sleeps (a 2 GiB all-gather held
// destroy_process_group 17 s).
void throwIfAborted(const OpContext& ctx) {
  if (abortedIn(ctx)) throwError(ErrorCode::kAborted, "the process group was shut down or aborted during the op");
}

// One step of the protocol in shm_domain.h: stage, announce (first phase only), publish, wait,
// verify. A template, not std::function: it runs once per chunk on every op's hot path.
// `address`: this rank's buffer, announced for peers that read it in place (single copy), in
// the step's descriptor (any step's: an all_reduce announces its output in its second).
template <class CountOf, class Stage>
uint64_t step(OpContext& ctx, bool first, const Expect& e, uint64_t myCount, CountOf countOf, Stage stage,
              const void* address = nullptr) {
  throwIfAborted(ctx);
  const uint64_t k = ctx.domain->nextPhase();
  stage(ctx.domain->slot(ctx.rank, k));
  const uint64_t layout = first ? layoutOf(ctx.size, countOf) : 0;
  if (first) {
    writeDescriptor(ctx, k, e, myCount, layout, address);
  } else if (address != nullptr) {
    ctx.domain->descriptor(ctx.rank, k).address = reinterpret_cast<uint64_t>(address);
  }
  ctx.domain->publish(k);
  ctx.domain->waitAll(k, ctx.wait);
  if (first) checkDescriptors(ctx, k, e, countOf, layout);
  return k;
}

void noStaging(uint8_t*) {}

// Single-copy reads and copies go in pieces of this size, between which an abort (shutdown,
// abort()) or a peer that gave up is seen: a GiB takes most of a second.
constexpr size_t kPieceBytes = 64 << 20;

// Throws why what this rank read from `peer` cannot be trusted: it gave up on the op (its
// timeout, an abort) and may have handed its input back to its caller, or it exited.
void throwIfPeerLeft(OpContext& ctx, int peer, int err = 0) {
  std::string why;
  if (ctx.domain->gaveUp(peer, &why)) {
    throwError(ErrorCode::kRemoteError, "rank %d gave up on this collective while this rank read its part: %s",
               ctx.domain->groupRank(peer), inTheWordsOf(ctx.domain->groupRank(peer), why).c_str());
  }
  if (err == ESRCH) {
    throwError(ErrorCode::kRemoteError, "rank %d exited while this rank read its part", ctx.domain->groupRank(peer));
  }
}

// Copies this rank's own part to its output in pieces, seeing an abort between them.
void copyOwnInPieces(OpContext& ctx, void* dst, const void* src, size_t n, bool stream) {
  for (size_t at = 0; at < n; at += kPieceBytes) {
    throwIfAborted(ctx);
    copyParallel(ctx.helpers, bytes(dst) + at, static_cast<const uint8_t*>(src) + at, std::min(kPieceBytes, n - at),
                 stream);
  }
}

// Throws why reading `n` bytes of `peer`'s failed with `err` (ECANCELED: an abort here), if it did.
void throwIfReadFailed(OpContext& ctx, int peer, int err, size_t n) {
  if (err == ECANCELED) {
    throwError(ErrorCode::kAborted, "the process group was shut down or aborted while this rank read rank %d's part",
               ctx.domain->groupRank(peer));
  }
  if (err != 0) {
    throwIfPeerLeft(ctx, peer, err);  // a read fails once a peer that gave up frees its input: say so
    throwError(ErrorCode::kRemoteError, "cannot read rank %d's %zu bytes in its memory: %s",
               ctx.domain->groupRank(peer), n, strerror(err));
  }
}

// One piece of a read from `peer`'s memory, unless the op was aborted (ECANCELED) or the peer
// gave up on it (ECONNABORTED): 0 or the errno that ends the read (throwIfReadFailed tells why).
int readPiece(OpContext& ctx, int peer, void* dst, uint64_t address, size_t n) {
  if (abortedIn(ctx)) return ECANCELED;
  if (ctx.domain->gaveUp(peer, nullptr)) return ECONNABORTED;
  return ctx.domain->readFromPeer(peer, dst, address, n);
}

// Copies `n` bytes at `address` in host-mate `peer`'s memory to `dst`, in parts across the
// helpers (process_vm_readv copies in the calling thread), each in pieces.
void readFromPeer(OpContext& ctx, int peer, uint64_t address, void* dst, size_t n) {
  std::atomic<int> failure{0};
  forEachPart(ctx.helpers, n, 1, kAlignBytes, [&](size_t b, size_t m) {
    for (size_t at = b; at < b + m && failure.load(std::memory_order_relaxed) == 0; at += kPieceBytes) {
      if (const int err = readPiece(ctx, peer, bytes(dst) + at, address + at, std::min(kPieceBytes, b + m - at))) {
        failure.store(err);
      }
    }
  });
  throwIfReadFailed(ctx, peer, failure.load(), n);
}

// After this rank's reads of its peers' inputs (those where `read(peer)`): trusts them, and
// holds its own input until every peer has read it. A peer that gave up (its timeout, an abort)
// while this rank read its input may have returned and let its caller write that input: what
// was read cannot be trusted. It marks the failure before it returns, so a peer not marked now
// held its input through the reads.
template <class Read>
void endReadsInPlace(OpContext& ctx, const Expect& e, Read read) {
  for (int p = 0; p < ctx.size; ++p) {
    if (p != ctx.rank && read(p)) throwIfPeerLeft(ctx, p);
  }
  step(ctx, false, e, 0, [](int) { return uint64_t{0}; }, noStaging);
}

void allreduceOneShot(OpContext& ctx, const AllreduceOptions& o, const Expect& e) {
  const size_t nbytes = o.count * elementSize(o.dtype);
  const uint64_t k = step(ctx, true, e, o.count, [&](int) { return o.count; },
                          [&](uint8_t* slot) { std::memcpy(slot, o.input, nbytes); });
  if (o.root >= 0 && o.root != ctx.rank) return;
  std::vector<const void*> srcs(ctx.size);
  for (int p = 0; p < ctx.size; ++p) srcs[p] = ctx.domain->slot(p, k);
  reduce(o.dtype, o.reduction, o.output, srcs.data(), ctx.size, o.count);
}

// Reduce-scatter + all-gather, pipelined: each slot holds an input region (a chunk) and a result
// region (this rank's reduced slice of the previous chunk). Step j stages chunk j, gathers every
// rank's reduced slice of chunk j-1, and reduces this rank's slice of chunk j into the result
// region of its next slot, so a message of C chunks takes C+1 steps.
void allreducePipelined(OpContext& ctx, const AllreduceOptions& o, const Expect& e) {
  shm::Domain& d = *ctx.domain;
  const int W = ctx.size;
  const size_t es = elementSize(o.dtype);
  const size_t unit = kAlignBytes / es * W;  // chunks split into W cache-line aligned slices
  const size_t chunkElems = std::max<size_t>(unit, d.slotBytes() * W / (W + 1) / es / unit * unit);
  const size_t resultOff = chunkElems * es;
  if (resultOff + chunkElems / W * es > d.slotBytes()) {
    throwError(ErrorCode::kNotSupported, "SMDDP_SHM_SLOT_BYTES=%zu is too small for %d ranks", d.slotBytes(), W);
  }
  const size_t chunks = (o.count + chunkElems - 1) / chunkElems;
  const bool gathers = o.root < 0 || o.root == ctx.rank;
  // Streamed, the staged input and the reduced slice stay out of this rank's cache, where readers
  // on another L3 would fetch them slowly (way_policy.h). The slice is then reduced straight
  // into the output, its final place here, and streamed from there to the slot; where only the
  // root has an output, the others reduce into the slot as when staging through the cache.
  const bool stage = stagesStreamed(ctx, o.count * es);
  const bool direct = stage && gathers;
  std::vector<const void*> srcs(W);
  for (size_t j = 0; j <= chunks; ++j) {
    const size_t off = j * chunkElems;
    const size_t ce = j < chunks ? std::min(chunkElems, o.count - off) : 0;
    // This rank's own slice of the chunk is read by nobody else: it stays in the input.
    const Slices sl = slicesOf(ce, W, kAlignBytes / es);
    const size_t b = sl.begin(ctx.rank), n = sl.end(ctx.rank) - b;
    const uint64_t k = step(ctx, j == 0, e, o.count, [&](int) { return o.count; }, [&](uint8_t* slot) {
      if (b > 0) copyParallel(ctx.helpers, slot, bytes(o.input) + off * es, b * es, stage);
      if (b + n < ce) {
        copyParallel(ctx.helpers, slot + (b + n) * es, bytes(o.input) + (off + b + n) * es, (ce - b - n) * es,
                     stage);
      }
    });
    if (j > 0 && gathers) {
      const size_t prevOff = off - chunkElems;
      const Slices prev = slicesOf(std::min(chunkElems, o.count - prevOff), W, kAlignBytes / es);
      for (int p = 0; p < W; ++p) {
        const size_t pb = prev.begin(p), pn = prev.end(p) - pb;
        if (pn > 0 && !(direct && p == ctx.rank)) {
          copyParallel(ctx.helpers, bytes(o.output) + (prevOff + pb) * es, d.slot(p, k) + resultOff, pn * es);
        }
      }
    }
    if (n > 0) {
      for (int p = 0; p < W; ++p) srcs[p] = d.slot(p, k) + b * es;
      srcs[ctx.rank] = bytes(o.input) + (off + b) * es;
      uint8_t* result = d.slot(ctx.rank, k + 1) + resultOff;
      if (direct) {
        // In place the output is the input, whose slice here only this rank reads, just now.
        uint8_t* out = bytes(o.output) + (off + b) * es;
        reduceParallel(ctx.helpers, o.dtype, o.reduction, out, srcs.data(), W, n);
        copyParallel(ctx.helpers, result, out, n * es, true);
      } else {
        reduceParallel(ctx.helpers, o.dtype, o.reduction, result, srcs.data(), W, n);
      }
    }
  }
}

// Single copy (see the header): returns false, with only its first step taken, where the host's
// first rank chose to stage or some rank's buffers may not be read; the caller then stages.
bool allreduceReadsInPlace(OpContext& ctx, const AllreduceOptions& o, Expect e) {
  shm::Domain& d = *ctx.domain;
  const int W = ctx.size;
  const size_t es = elementSize(o.dtype);
  const size_t nbytes = o.count * es;
  if (ctx.rank == 0) e.way = ctx.allreduceReads->take(nbytes * W) ? 1 : 0;
  const bool offer = ctx.buffersReadable && d.readableByPeers(o.input, nbytes) &&
                     (o.output == o.input || d.readableByPeers(o.output, nbytes));
  auto countOf = [&](int) { return uint64_t{o.count}; };
  const uint64_t k = step(ctx, true, e, o.count, countOf, noStaging, offer ? o.input : nullptr);
  if (d.descriptor(0, k).way == 0) return false;
  std::vector<uint64_t> at(W);  // the inputs, then the outputs
  for (int p = 0; p < W; ++p) {
    at[p] = d.descriptor(p, k).address;
    if (at[p] != 0) continue;
    if (ctx.rank == 0) ctx.allreduceReads->way = -1;  // the op cannot go the way asked: its time teaches nothing
    static std::once_flag said;
    std::call_once(said, [&] {
      SMDDP_INFO(kColl, "rank %d: %s #%llu: rank %d's buffers may not be read by other processes (memory a "
                 "driver pinned, or memfd_secret's): staged instead of read in place",
                 d.groupRank(ctx.rank), opKindName(e.kind), static_cast<unsigned long long>(ctx.seq), d.groupRank(p));
    });
    return false;
  }
  // Reduce-scatter: this rank's slice, from its own input and every peer's, read a piece at a
  // time into scratch that stays in cache for the reduction (W - 1 pieces of up to 256 KiB,
  // about 1 MiB in all: 256 KiB pieces beat 64 KiB and 1 MiB ones at 2-16 MiB).
  const Slices sl = slicesOf(o.count, W, kAlignBytes / es);
  const size_t piece = std::clamp<size_t>((1 << 20) / (W - 1), 16 << 10, 256 << 10) / kAlignBytes * kAlignBytes / es;
  std::atomic<int> failure{0};
  std::atomic<int> failedPeer{0};
  forEachPart(ctx.helpers, sl.size(ctx.rank), es, kAlignBytes / es, [&](size_t pb, size_t pn) {
    thread_local std::vector<uint8_t> scratch;  // the progress thread's and each helper's, kept
    if (scratch.size() < (W - 1) * piece * es) scratch.resize((W - 1) * piece * es);
    std::vector<const void*> srcs(W);
    const size_t end = sl.begin(ctx.rank) + pb + pn;
    for (size_t i = sl.begin(ctx.rank) + pb; i < end && failure.load(std::memory_order_relaxed) == 0; i += piece) {
      const size_t m = std::min(piece, end - i);
      for (int j = 1; j < W; ++j) {
        const int p = (ctx.rank + j) % W;  // host-mates start on different peers
        uint8_t* dst = scratch.data() + (j - 1) * piece * es;
        if (const int err = readPiece(ctx, p, dst, at[p] + i * es, m * es); err != 0) {
          failedPeer.store(p);
          failure.store(err);
          return;
        }
        srcs[p] = dst;
      }
      srcs[ctx.rank] = bytes(o.input) + i * es;
      reduce(o.dtype, o.reduction, bytes(o.output) + i * es, srcs.data(), W, m);
    }
  });
  throwIfReadFailed(ctx, failedPeer.load(), failure.load(), sl.size(ctx.rank) * es);
  // Every slice is reduced and no input is read any more: the outputs' slices may be written
  // (in place, a peer's slice of this rank's output is the part of its input that peer read).
  const uint64_t k2 = step(ctx, false, e, 0, countOf, noStaging, o.output);
  for (int p = 0; p < W; ++p) at[p] = d.descriptor(p, k2).address;
  for (int j = 1; j < W; ++j) {
    const int p = (ctx.rank + j) % W;
    const size_t b = sl.begin(p) * es;
    if (sl.size(p) > 0) readFromPeer(ctx, p, at[p] + b, bytes(o.output) + b, sl.size(p) * es);
  }
  endReadsInPlace(ctx, e, [&](int p) { return sl.size(p) > 0 || sl.size(ctx.rank) > 0; });
  return true;
}

}  // namespace

void allreduce(OpContext& ctx, const AllreduceOptions& o) {
  if (o.count == 0) return;
  if (ctx.size == 1) {
    const void* src = o.input;
    reduce(o.dtype, o.reduction, o.output, &src, 1, o.count);  // AVG and PREMUL_SUM still apply
    return;
  }
  const Expect e{o.root >= 0 ? OpKind::kReduce : OpKind::kAllreduce, o.dtype, o.reduction.op, o.root};
  const size_t nbytes = o.count * elementSize(o.dtype);
  if (nbytes <= ctx.oneShotMaxBytes && nbytes <= ctx.domain->slotBytes()) {
    allreduceOneShot(ctx, o, e);
  } else if (o.root < 0 && ctx.allreduceReads != nullptr && nbytes / ctx.size >= kAllreduceSingleCopyMinBytes) {
    Expect reads = e;
    reads.readsInPlace = true;
    if (!allreduceReadsInPlace(ctx, o, reads)) allreducePipelined(ctx, o, reads);
  } else {
    allreducePipelined(ctx, o, e);
  }
}

void broadcast(OpContext& ctx, const BroadcastOptions& o) {
  if (o.count == 0 || ctx.size == 1) return;
  shm::Domain& d = *ctx.domain;
  const size_t total = o.count * elementSize(o.dtype);
  const Expect e{OpKind::kBroadcast, o.dtype, ReduceOp::kSum, o.root};
  const bool isRoot = ctx.rank == o.root;
  const bool stream = shouldStream(total, ctx.size);
  const bool stage = isRoot && stagesStreamed(ctx, total);  // only the root stages
  const size_t stepBytes = ctx.copyStepBytes;
  for (size_t off = 0; off < total; off += stepBytes) {
    const size_t n = std::min(stepBytes, total - off);
    const uint64_t k = step(ctx, off == 0, e, o.count, [&](int) { return o.count; }, [&](uint8_t* slot) {
      if (isRoot) copyParallel(ctx.helpers, slot, bytes(o.buffer) + off, n, stage);
    });
    if (!isRoot) copyParallel(ctx.helpers, bytes(o.buffer) + off, d.slot(o.root, k), n, stream);
  }
}

void allgather(OpContext& ctx, const AllgatherOptions& o) {
  const size_t es = elementSize(o.dtype);
  const size_t mine = o.counts[ctx.rank] * es;
  const bool receives = o.root < 0 || o.root == ctx.rank;
  const bool ownCopy = receives && mine > 0 && o.outputs[ctx.rank] != o.input;
  if (ctx.size == 1) {
    if (ownCopy) std::memmove(o.outputs[0], o.input, mine);
    return;
  }
  shm::Domain& d = *ctx.domain;
  const size_t maxBytes = *std::max_element(o.counts.begin(), o.counts.end()) * es;
  const bool readsInPlace = o.root < 0 && maxBytes >= ctx.singleCopyBytes;
  const Expect e{o.root < 0 ? OpKind::kAllgather : OpKind::kGather, o.dtype, ReduceOp::kSum, o.root, readsInPlace};
  size_t total = 0;
  for (size_t c : o.counts) total += c * es;
  const bool stream = shouldStream(total, ctx.size);
  auto countOf = [&](int p) -> uint64_t { return o.counts[p]; };
  if (readsInPlace) {  // single copy (see the header)
    // Each rank offers its input if the others may read it; where one may not, every rank sees
    // the missing address and the op is staged instead, from its next step.
    const bool offer = d.readableByPeers(o.input, mine);
    const uint64_t k = step(ctx, true, e, o.counts[ctx.rank], countOf, noStaging, offer ? o.input : nullptr);
    int unreadable = -1;
    for (int p = 0; p < ctx.size && unreadable < 0; ++p) {
      if (o.counts[p] > 0 && d.descriptor(p, k).address == 0) unreadable = p;
    }
    if (unreadable < 0) {
      if (ownCopy) copyOwnInPieces(ctx, o.outputs[ctx.rank], o.input, mine, stream);
      for (int i = 1; i < ctx.size; ++i) {
        const int p = (ctx.rank + i) % ctx.size;  // host-mates start on different peers
        if (o.counts[p] > 0) readFromPeer(ctx, p, d.descriptor(p, k).address, o.outputs[p], o.counts[p] * es);
      }
      endReadsInPlace(ctx, e, [&](int p) { return o.counts[p] > 0; });
      return;
    }
    static std::once_flag said;
    std::call_once(said, [&] {
      SMDDP_INFO(kColl, "rank %d: %s #%llu: rank %d's input may not be read by other processes (memory a driver "
                 "pinned, or memfd_secret's): staged instead of read in place",
                 d.groupRank(ctx.rank), opKindName(e.kind), static_cast<unsigned long long>(ctx.seq),
                 d.groupRank(unreadable));
    });
  }
  const bool stage = stagesStreamed(ctx, total);
  const size_t stepBytes = ctx.copyStepBytes;
  for (size_t off = 0; off < maxBytes; off += stepBytes) {
    const size_t myN = off < mine ? std::min(stepBytes, mine - off) : 0;
    const uint64_t k = step(ctx, off == 0, e, o.counts[ctx.rank], countOf, [&](uint8_t* slot) {
      // Our own piece goes to the output right after it is staged, from whichever copy is in
      // cache (the input's when the slot was streamed), rather than in a separate pass over the
      // whole input.
      forEachPart(ctx.helpers, myN, 1, kAlignBytes, [&](size_t b, size_t m) {
        const uint8_t* in = bytes(o.input) + off + b;
        copyOut(slot + b, in, m, stage);
        if (!ownCopy) return;
        copyOut(bytes(o.outputs[ctx.rank]) + off + b, stage ? in : slot + b, m, stream);
      });
    });
    for (int p = 0; receives && p < ctx.size; ++p) {
      const size_t pbytes = o.counts[p] * es;
      if (p == ctx.rank || off >= pbytes) continue;
      copyParallel(ctx.helpers, bytes(o.outputs[p]) + off, d.slot(p, k), std::min(stepBytes, pbytes - off), stream);
    }
  }
}

void reduceScatter(OpContext& ctx, const ReduceScatterOptions& o) {
  const bool uneven = !o.counts.empty();
  auto countOf = [&](int p) -> uint64_t { return uneven ? o.counts[p] : o.count; };
  const size_t mine = countOf(ctx.rank);
  const size_t maxCount = uneven ? *std::max_element(o.counts.begin(), o.counts.end()) : o.count;
  if (maxCount == 0) return;
  if (ctx.size == 1) {
    const void* src = o.inputs[0];
    reduce(o.dtype, o.reduction, o.output, &src, 1, mine);
    return;
  }
  shm::Domain& d = *ctx.domain;
  const size_t es = elementSize(o.dtype);
  size_t piece = d.slotBytes() / (ctx.size * es);
  piece = piece >= kAlignBytes / es ? piece / (kAlignBytes / es) * (kAlignBytes / es) : piece;
  if (piece == 0) {
    throwError(ErrorCode::kNotSupported, "SMDDP_SHM_SLOT_BYTES=%zu is too small for %d ranks", d.slotBytes(),
               ctx.size);
  }
  const Expect e{OpKind::kReduceScatter, o.dtype, o.reduction.op, -1};
  size_t inputCount = 0;
  for (int p = 0; p < ctx.size; ++p) inputCount += countOf(p);
  const bool stage = stagesStreamed(ctx, inputCount * es);
  std::vector<const void*> srcs(ctx.size);
  for (size_t off = 0; off < maxCount; off += piece) {
    // Only the blocks other ranks reduce are staged; this rank reads its own from its input.
    const uint64_t k = step(ctx, off == 0, e, mine, countOf, [&](uint8_t* slot) {
      for (int p = 0; p < ctx.size; ++p) {
        const size_t cp = countOf(p);
        if (p != ctx.rank && off < cp) {
          const size_t n = std::min(piece, cp - off) * es;
          copyParallel(ctx.helpers, slot + p * piece * es, bytes(o.inputs[p]) + off * es, n, stage);
        }
      }
    });
    if (off >= mine) continue;
    for (int q = 0; q < ctx.size; ++q) srcs[q] = d.slot(q, k) + ctx.rank * piece * es;
    srcs[ctx.rank] = bytes(o.inputs[ctx.rank]) + off * es;
    reduceParallel(ctx.helpers, o.dtype, o.reduction, bytes(o.output) + off * es, srcs.data(), ctx.size,
                   std::min(piece, mine - off));
  }
}

namespace {
// Bytes of the per-destination region when a slot is split W ways, on cache-line boundaries.
size_t regionBytes(const shm::Domain& d, int W) {
  const size_t r = d.slotBytes() / W / kAlignBytes * kAlignBytes;
  if (r == 0) {
    throwError(ErrorCode::kNotSupported, "SMDDP_SHM_SLOT_BYTES=%zu is too small for %d ranks", d.slotBytes(), W);
  }
  return r;
}
}  // namespace

void scatter(OpContext& ctx, const ScatterOptions& o) {
  const size_t total = o.count * elementSize(o.dtype);
  const bool isRoot = ctx.rank == o.root;
  if (isRoot && total > 0 && o.output != o.inputs[ctx.rank]) std::memmove(o.output, o.inputs[ctx.rank], total);
  if (total == 0 || ctx.size == 1) return;
  shm::Domain& d = *ctx.domain;
  const size_t region = regionBytes(d, ctx.size);
  const Expect e{OpKind::kScatter, o.dtype, ReduceOp::kSum, o.root};
  const bool stage = isRoot && stagesStreamed(ctx, total * static_cast<size_t>(ctx.size));  // only the root stages
  for (size_t off = 0; off < total; off += region) {
    const size_t n = std::min(region, total - off);
    const uint64_t k = step(ctx, off == 0, e, o.count, [&](int) { return o.count; }, [&](uint8_t* slot) {
      if (!isRoot) return;
      for (int p = 0; p < ctx.size; ++p) {
        if (p != ctx.rank) copyParallel(ctx.helpers, slot + p * region, bytes(o.inputs[p]) + off, n, stage);
      }
    });
    if (!isRoot) copyParallel(ctx.helpers, bytes(o.output) + off, d.slot(o.root, k) + ctx.rank * region, n);
  }
}

void throwSplitMismatch(int sender, uint64_t sends, int receiver, uint64_t expects) {
  throwError(ErrorCode::kInvalidUsage,
             "alltoall: rank %d sends %llu elements to rank %d, which expects %llu from it (the split sizes do not "
             "match across ranks)",
             sender, static_cast<unsigned long long>(sends), receiver, static_cast<unsigned long long>(expects));
}

void checkAlltoallBuffers(const AlltoallOptions& o, int rank) {
  const size_t es = elementSize(o.dtype);
  struct Block {
    uintptr_t begin, end;
    int peer;
  };
  auto blocksOf = [&](const auto& ptrs, const std::vector<size_t>& counts, bool outputs) {
    std::vector<Block> blocks;
    for (size_t p = 0; p < ptrs.size(); ++p) {
      // This rank's own block moved onto itself is never written.
      if (counts[p] == 0 || (outputs && static_cast<int>(p) == rank && o.outputs[p] == o.inputs[p])) continue;
      const auto begin = reinterpret_cast<uintptr_t>(ptrs[p]);
      blocks.push_back({begin, begin + counts[p] * es, static_cast<int>(p)});
    }
    return blocks;
  };
  std::vector<Block> ins = blocksOf(o.inputs, o.inCounts, false);
  const std::vector<Block> outs = blocksOf(o.outputs, o.outCounts, true);
  if (ins.empty() || outs.empty()) return;
  auto span = [](const std::vector<Block>& bs) {
    Block s{UINTPTR_MAX, 0, -1};
    for (const Block& b : bs) s = {std::min(s.begin, b.begin), std::max(s.end, b.end), -1};
    return s;
  };
  const Block inSpan = span(ins), outSpan = span(outs);
  if (inSpan.end <= outSpan.begin || outSpan.end <= inSpan.begin) return;  // the usual case
  // Inputs by start, with the furthest end so far: the inputs that start before an output
  // ends reach into it only if that furthest end passes the output's start.
  std::sort(ins.begin(), ins.end(), [](const Block& a, const Block& b) { return a.begin < b.begin; });
  std::vector<uintptr_t> reach(ins.size());
  for (size_t i = 0; i < ins.size(); ++i) reach[i] = std::max(ins[i].end, i > 0 ? reach[i - 1] : 0);
  for (const Block& out : outs) {
    const size_t before = static_cast<size_t>(
        std::partition_point(ins.begin(), ins.end(), [&](const Block& b) { return b.begin < out.end; }) - ins.begin());
    if (before == 0 || reach[before - 1] <= out.begin) continue;
    for (size_t i = 0; i < before; ++i) {
      // memmove copes with this rank's own block overlapping its own input.
      if (ins[i].end <= out.begin || (out.peer == rank && ins[i].peer == rank)) continue;
      throwError(ErrorCode::kInvalidUsage,
                 "alltoall: the output block from rank %d overlaps the input block for rank %d; outputs must not "
                 "overlap inputs (blocks arrive while others are still being sent): copy the input first",
                 out.peer, ins[i].peer);
    }
  }
}

// Where each of this rank's blocks for its peers is, as W words (0 for a block that is empty, is
// this rank's own, or may not be read by other processes).
void publishBlockAddresses(const OpContext& ctx, const AlltoallOptions& o, uint8_t* words) {
  const size_t es = elementSize(o.dtype);
  for (int p = 0; p < ctx.size; ++p) {
    const size_t n = o.inCounts[p] * es;
    const bool offer = p != ctx.rank && n > 0 && ctx.domain->readableByPeers(o.inputs[p], n);
    const uint64_t at = offer ? reinterpret_cast<uintptr_t>(o.inputs[p]) : 0;
    std::memcpy(words + p * sizeof(uint64_t), &at, sizeof(at));
  }
}

// Single copy (see the header), for an alltoall whose largest block between two ranks every rank
// found to be at least singleCopyBytes: every rank reads its block from each peer's input, and a
// last phase holds the inputs until all reads are done. Where each block is came with the counts
// (`addressAt(q, p)`, when every rank gave them there), or takes a phase of its own. False,
// having read nothing, where some rank's block may not be read by other processes: every rank
// sees the missing address, and all stage instead. `countAt(q, p)`: elements q sends p, as the
// counts' phase published them.
template <class CountAt, class AddressAt>
bool alltoallInPlace(OpContext& ctx, const AlltoallOptions& o, const Expect& e, CountAt countAt,
                     std::optional<AddressAt> addressAt) {
  shm::Domain& d = *ctx.domain;
  const int W = ctx.size;
  const size_t es = elementSize(o.dtype);
  // Copied before any next phase: its slot is the counts' phase's a step later (two slots rotate).
  std::vector<uint64_t> sends(static_cast<size_t>(W) * W);  // sends[q * W + p]: elements q sends p
  std::vector<uint64_t> at(static_cast<size_t>(W) * W);     // at[q * W + p]: where q's block for p is
  for (int q = 0; q < W; ++q) {
    for (int p = 0; p < W; ++p) {
      sends[static_cast<size_t>(q) * W + p] = countAt(q, p);
      if (addressAt) at[static_cast<size_t>(q) * W + p] = (*addressAt)(q, p);
    }
  }
  if (!addressAt) {
    const uint64_t k = step(ctx, false, e, 0, [](int) { return uint64_t{0}; },
                            [&](uint8_t* slot) { publishBlockAddresses(ctx, o, slot); });
    for (int q = 0; q < W; ++q) std::memcpy(&at[static_cast<size_t>(q) * W], d.slot(q, k), W * sizeof(uint64_t));
  }
  for (size_t i = 0; i < at.size(); ++i) {
    const int q = static_cast<int>(i / W), p = static_cast<int>(i % W);
    if (q != p && sends[i] > 0 && at[i] == 0) {
      static std::once_flag said;
      std::call_once(said, [&] {
        SMDDP_INFO(kColl, "rank %d: alltoall #%llu: rank %d's block for rank %d may not be read by other processes "
                   "(memory a driver pinned, or memfd_secret's): staged instead of read in place",
                   d.groupRank(ctx.rank), static_cast<unsigned long long>(ctx.seq), d.groupRank(q), d.groupRank(p));
      });
      return false;
    }
  }
  for (int i = 1; i < W; ++i) {
    const int q = (ctx.rank + W - i) % W;  // host-mates start on different peers
    const size_t n = sends[static_cast<size_t>(q) * W + ctx.rank] * es;
    if (n > 0) readFromPeer(ctx, q, at[static_cast<size_t>(q) * W + ctx.rank], o.outputs[q], n);
  }
  endReadsInPlace(ctx, e, [&](int q) { return sends[static_cast<size_t>(q) * W + ctx.rank] > 0; });
  return true;
}

void alltoall(OpContext& ctx, const AlltoallOptions& o) {
  const size_t es = elementSize(o.dtype);
  const int W = ctx.size;
  auto moveOwnBlock = [&] {
    if (o.inCounts[ctx.rank] > 0 && o.outputs[ctx.rank] != o.inputs[ctx.rank]) {
      std::memmove(o.outputs[ctx.rank], o.inputs[ctx.rank], o.inCounts[ctx.rank] * es);
    }
  };
  if (W == 1) {
    if (o.outCounts[0] != o.inCounts[0]) {
      throwError(ErrorCode::kInvalidUsage, "alltoall: this rank sends itself %zu elements but expects %zu",
                 o.inCounts[0], o.outCounts[0]);
    }
    moveOwnBlock();
    return;
  }
  shm::Domain& d = *ctx.domain;
  // The counts' phase's words: W sends, W receives, the block size from which this rank would
  // read in place, whether it gives where its blocks are, and W addresses.
  const size_t threshold = 2 * static_cast<size_t>(W), givesAddresses = threshold + 1, addresses = threshold + 2;
  if ((addresses + W) * sizeof(uint64_t) > d.slotBytes()) {
    throwError(ErrorCode::kNotSupported, "alltoall: SMDDP_SHM_SLOT_BYTES=%zu is too small for %d ranks",
               d.slotBytes(), W);
  }
  const Expect e{OpKind::kAlltoall, o.dtype, ReduceOp::kSum, -1};
  // Step 1 publishes every rank's send and receive counts. Every rank checks the whole matrix,
  // so a mismatch fails on all ranks alike (not as a hang on some), and all agree on how many
  // data steps the largest block needs. Each rank also gives the block size from which it would
  // read in place, which is not the same on every rank (a rank whose tensors are CUDA's never
  // does: its staging is pinned by the driver), so all agree on the largest. A rank whose own
  // blocks are that large gives their addresses too: where all did, reading in place takes no
  // phase more than staging (the usual even split); otherwise a phase of its own.
  size_t myLargest = 0;
  for (int p = 0; p < W; ++p) {
    if (p != ctx.rank) myLargest = std::max(myLargest, o.inCounts[p] * es);
  }
  const bool gives = myLargest >= ctx.singleCopyBytes;
  const uint64_t k0 = step(ctx, true, e, static_cast<uint64_t>(W), [&](int) { return static_cast<uint64_t>(W); },
                           [&](uint8_t* slot) {
                             auto put = [&](size_t word, uint64_t v) {
                               std::memcpy(slot + word * sizeof(uint64_t), &v, sizeof(v));
                             };
                             for (int p = 0; p < W; ++p) {
                               put(p, o.inCounts[p]);
                               put(W + p, o.outCounts[p]);
                             }
                             put(threshold, ctx.singleCopyBytes);
                             put(givesAddresses, gives ? 1 : 0);
                             if (gives) publishBlockAddresses(ctx, o, slot + addresses * sizeof(uint64_t));
                           });
  auto wordAt = [&](int owner, size_t word) {  // of the counts' phase; words 0..2W-1 are counts
    uint64_t c;
    std::memcpy(&c, d.slot(owner, k0) + word * sizeof(uint64_t), sizeof(c));
    return c;
  };
  size_t maxBytes = 0, maxCrossing = 0;  // the largest block, and of those between two ranks
  uint64_t readsFrom = 0;  // the block size from which every rank would read in place
  bool allGave = true;
  for (int q = 0; q < W; ++q) {
    readsFrom = std::max(readsFrom, wordAt(q, threshold));
    allGave = allGave && wordAt(q, givesAddresses) == 1;
    for (int p = 0; p < W; ++p) {
      const uint64_t n = wordAt(q, p), expects = wordAt(p, W + q);
      maxBytes = std::max<size_t>(maxBytes, n * es);
      if (p != q) maxCrossing = std::max<size_t>(maxCrossing, n * es);
      if (n != expects) throwSplitMismatch(d.groupRank(q), n, d.groupRank(p), expects);
    }
  }
  // After the check of the whole matrix, its own block included: a rank whose own counts differ
  // fails with the others, all naming it, instead of alone before they publish theirs.
  moveOwnBlock();
  auto addressAt = [&](int q, int p) { return wordAt(q, addresses + p); };
  if (maxCrossing >= readsFrom &&
      alltoallInPlace(ctx, o, e, wordAt, allGave ? std::optional(addressAt) : std::nullopt)) {
    return;
  }
  const size_t region = regionBytes(d, W);
  size_t inputBytes = 0;
  for (int p = 0; p < W; ++p) inputBytes += o.inCounts[p] * es;
  const bool stage = stagesStreamed(ctx, inputBytes);
  for (size_t off = 0; off < maxBytes; off += region) {
    const uint64_t k = step(ctx, false, e, 0, [](int) { return uint64_t{0}; }, [&](uint8_t* slot) {
      for (int p = 0; p < W; ++p) {
        const size_t pb = o.inCounts[p] * es;
        if (p != ctx.rank && off < pb) {
          copyParallel(ctx.helpers, slot + p * region, bytes(o.inputs[p]) + off, std::min(region, pb - off), stage);
        }
      }
    });
    for (int q = 0; q < W; ++q) {
      const size_t qb = o.outCounts[q] * es;
      if (q != ctx.rank && off < qb) {
        copyParallel(ctx.helpers, bytes(o.outputs[q]) + off, d.slot(q, k) + ctx.rank * region,
                     std::min(region, qb - off));
      }
    }
  }
}

void barrier(OpContext& ctx) {
  if (ctx.size == 1) return;
  const Expect e{OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1};
  step(ctx, true, e, 0, [](int) { return uint64_t{0}; }, [](uint8_t*) {});
}

}  // namespace smddp::algo
