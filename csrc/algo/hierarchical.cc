#include "algo/hierarchical.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <utility>

#include "core/slices.h"
#include "core/error.h"
#include "core/reduce.h"

namespace smddp::algo {
namespace {

// A streamed reduction (mesh allreduce, reduce_scatter) cuts what one peer sends into about this
// many pieces, each between these bounds: enough pieces that reducing one overlaps the transfer
// of the next; pieces large enough that per-message costs (a header, a reduce call) stay small.
constexpr size_t kStreamPieces = 8;
constexpr size_t kMinStreamPieceBytes = 32u << 10;
constexpr size_t kMaxStreamPieceBytes = 256u << 10;

// How many of a block's `count` elements fall in the piece that starts at element `at`.
size_t pieceSpan(size_t count, size_t at, size_t piece) { return std::min(piece, count - std::min(at, count)); }

// Elements per piece of one peer's `bytes` in a streamed reduction: a function of what sender
// and receiver both know, so that they cut alike; at most `perPeerBudget` bytes.
size_t streamPieceElems(size_t bytes, size_t perPeerBudget, DataType dt) {
  const size_t es = elementSize(dt), align = alignElems(dt);
  const size_t piece =
      std::min(std::clamp(bytes / kStreamPieces, kMinStreamPieceBytes, kMaxStreamPieceBytes), perPeerBudget);
  return std::max(align, piece / es / align * align);
}

// Where a streamed reduction keeps its peers' contributions: piece k from peer i (0 ... peers-1)
// in slot k % slots. The receive of piece k waits (Recv::ready) until piece k - slots, whose slot
// it takes, has been reduced; once the last peer's piece k is in, the caller reduces it and opens
// whatever waits on reduced(k).
class ContributionSlots {
 public:
  ContributionSlots(size_t pieces, int peers, size_t slotBytes, size_t budgetBytes)
      : peers_(peers),
        slotBytes_(slotBytes),
        slots_(std::clamp<size_t>(budgetBytes / std::max<size_t>(1, peers * slotBytes), 1,
                                  std::max<size_t>(pieces, 1))),
        reduced_(new bool[pieces]()),
        arrived_(pieces, 0) {}
  size_t bytes() const { return slots_ * peers_ * slotBytes_; }
  void place(uint8_t* at) { base_ = at; }
  uint8_t* slot(size_t k, int i) const { return base_ + ((k % slots_) * peers_ + i) * slotBytes_; }
  const bool* slotFree(size_t k) const { return k >= slots_ ? &reduced_[k - slots_] : nullptr; }
  const bool* reduced(size_t k) const { return &reduced_[k]; }
  // Counts one peer's piece k in; true when it was the last one.
  bool arrive(size_t k) { return ++arrived_[k] == peers_; }
  void markReduced(size_t k) { reduced_[k] = true; }

 private:
  int peers_;
  size_t slotBytes_, slots_;
  std::unique_ptr<bool[]> reduced_;
  std::vector<int> arrived_;
  uint8_t* base_ = nullptr;
};

// AVG and PREMUL_SUM finish with a scaling that must happen once, at the last stage; partial
// stages add.
Reduction partialOf(const Reduction& r) {
  if (r.op == ReduceOp::kAvg || r.op == ReduceOp::kPremulSum) return Reduction{ReduceOp::kSum};
  return r;
}

// The reductions of a hierarchical op's two stages: among a host's ranks, then among hosts. AVG
// and PREMUL_SUM scale once, at the last stage, except on the narrow floats (float16, float8),
// where a host's partial sum, rounded to the type before it travels, could lie past its range
// (float16 overflows past 65504, e4m3fn saturates at 448) while the scaled result does not.
// There each host scales its partial by 1/P before rounding it, P the smallest power of two at
// least the largest host's rank count: that keeps it within its inputs' range, and a power of
// two scales without rounding (1/3 would round every partial: a float16 AVG of integers on hosts
// of 1 and 3 ranks came back off their integer mean). The hosts' sum, added in float32, is
// scaled by the op's scale x P. Scaling a partial by the op's own scale (1/W for AVG, FSDP's 1/W
// factor) would round it far below its inputs' magnitude: float16 gradients of 1e-4 summed on a
// host of 8 and scaled by 1/64 are subnormal, with 8 of float16's 11 significant bits. With one
// rank per host no partial is rounded: inputs travel as they are (no copy) and the op scales once.
// The ring (`ringRounds`) rounds each running sum of hosts' partials to the type too, as NCCL's
// ring does: a partial scaled by the op's own scale keeps those sums within the result's range,
// so there hosts scale by it while |scale| x L is at most 1.
struct Stages {
  Reduction local, net;
  bool hostsScale = false;  // the local stage scales (then it must run even where it copies nothing)
};
Stages stagesOf(DataType dt, const Reduction& r, int maxLocalSize, bool ringRounds) {
  if (r.op != ReduceOp::kAvg && r.op != ReduceOp::kPremulSum) return {r, r};
  const bool narrow = dt == DataType::kFloat16 || dt == DataType::kFloat8E4M3 || dt == DataType::kFloat8E5M2;
  if (!narrow) return {Reduction{ReduceOp::kSum}, r};
  const double scale = r.op == ReduceOp::kAvg ? 1.0 / r.avgDivisor : r.premulFactor;
  if (ringRounds && std::abs(scale) * maxLocalSize <= 1.0) return {r, Reduction{ReduceOp::kSum}, true};
  if (maxLocalSize == 1) return {Reduction{ReduceOp::kSum}, r};
  const double P = std::bit_ceil(static_cast<unsigned>(maxLocalSize));
  Reduction local{ReduceOp::kPremulSum}, net{ReduceOp::kPremulSum};
  local.premulFactor = 1.0 / P;
  net.premulFactor = r.op == ReduceOp::kAvg ? P / r.avgDivisor : r.premulFactor * P;
  return {local, net, true};
}

// Segments of an allreduce: S = the largest host's rank count; on a host of `Lh` ranks, local
// rank l owns segments [l*S/Lh, (l+1)*S/Lh).
int firstSegment(int S, int Lh, int l) { return l * S / Lh; }
int segmentOwner(int S, int Lh, int s) {
  int l = 0;
  while (firstSegment(S, Lh, l + 1) <= s) ++l;
  return l;
}

// The rank of host `h` paired with rank g for allgather / reduce_scatter traffic.
int partnerOn(const Topology& t, int g, int h) {
  const auto& m = t.members[h];
  return m[t.localOf[g] % static_cast<int>(m.size())];
}

// In-place allreduce of buf[0, n) among `ranks` (one per host, in host order; this rank is
// ranks[me]) over a ring. Inputs are partial results; `red` finishes them. `segment` keys the
// message tags.
void netAllreduceRing(HierContext& ctx, const std::vector<int>& ranks, int me, int segment, DataType dt,
                      const Reduction& red, void* buf, size_t n) {
  const int H = static_cast<int>(ranks.size());
  const size_t es = elementSize(dt), align = alignElems(dt);
  uint32_t step = static_cast<uint32_t>(segment) << 16;
  auto tag = [&] { return ctx.tag(step++); };
  // A piece needs one part of scratch.
  const size_t piece = std::max(align * H, ctx.bufferBytes / es * H / (align * H) * (align * H));
  const int next = ranks[(me + 1) % H], prev = ranks[(me + H - 1) % H];
  const Reduction partial = partialOf(red);
  for (size_t at = 0; at < n; at += piece) {
    uint8_t* base = bytes(buf) + at * es;
    const Slices parts = slicesOf(std::min(piece, n - at), H, align);
    auto part = [&](int j) { return base + parts.begin(j) * es; };
    uint8_t* tmp = ctx.scratchBytes(parts.per * es);
    for (int t = 0; t < H - 1; ++t) {  // reduce-scatter: after H-1 steps, part me+1 is complete here
      const int sp = (me - t + H) % H, rp = (me - t - 1 + H) % H;
      ctx.mesh->exchange(tag(), {{next, part(sp), parts.size(sp) * es}}, {{prev, tmp, parts.size(rp) * es}},
                         ctx.local.wait, ctx.schedule());
      const void* srcs[2] = {tmp, part(rp)};
      reduce(dt, t == H - 2 ? red : partial, part(rp), srcs, 2, parts.size(rp));
    }
    for (int t = 0; t < H - 1; ++t) {  // all-gather around the ring
      const int sp = (me + 1 - t + H) % H, rp = (me - t + H) % H;
      ctx.mesh->exchange(tag(), {{next, part(sp), parts.size(sp) * es}}, {{prev, part(rp), parts.size(rp) * es}},
                         ctx.local.wait, ctx.schedule());
    }
  }
}

// The same over the mesh: one hop each way, streamed through a single exchange. The message is
// cut into pieces and each piece into H parts (part j is reduced by ranks[j]). To every peer go
// first its part of every piece (reduce-scatter), then this rank's reduced part of every piece
// (all-gather). When the last peer's contribution to piece k arrives, this rank reduces its part
// of piece k and opens that piece's all-gather sends: results flow back while later pieces are
// still coming in, and no piece waits for a lockstep round, each of which would cost a network
// latency. Contributions wait in ContributionSlots (SMDDP_NET_BUFFER_BYTES in all).
void netAllreduceMesh(HierContext& ctx, const std::vector<int>& ranks, int me, int segment, DataType dt,
                      const Reduction& red, void* buf, size_t n) {
  if (n == 0) return;
  const int H = static_cast<int>(ranks.size()), peers = H - 1;
  const size_t es = elementSize(dt), align = alignElems(dt);
  const size_t partElems = streamPieceElems(n * es / H, ctx.bufferBytes / peers, dt), piece = partElems * H;
  const size_t pieces = (n + piece - 1) / piece;
  auto base = [&](size_t k) { return bytes(buf) + k * piece * es; };
  auto partsOf = [&](size_t k) { return slicesOf(std::min(piece, n - k * piece), H, align); };
  ContributionSlots slots(pieces, peers, partsOf(0).per * es, ctx.bufferBytes);  // piece 0 is the largest
  slots.place(ctx.scratchBytes(slots.bytes()));

  // Peer i (1 ... H-1) is ranks[(me + i) % H].
  std::vector<net::Send> sends;
  std::vector<net::Recv> recvs;
  sends.reserve(2 * pieces * peers);
  recvs.reserve(2 * pieces * peers);
  for (int i = 1; i < H; ++i) {
    const int j = (me + i) % H;
    for (size_t k = 0; k < pieces; ++k) {
      const Slices parts = partsOf(k);
      sends.push_back({ranks[j], base(k) + parts.begin(j) * es, parts.size(j) * es});
      recvs.push_back({ranks[j], slots.slot(k, i - 1), parts.size(me) * es, slots.slotFree(k)});
    }
    for (size_t k = 0; k < pieces; ++k) {
      const Slices parts = partsOf(k);
      sends.push_back({ranks[j], base(k) + parts.begin(me) * es, parts.size(me) * es, slots.reduced(k)});
      recvs.push_back({ranks[j], base(k) + parts.begin(j) * es, parts.size(j) * es});
    }
  }
  std::vector<const void*> srcs(H);
  auto received = [&](size_t r) {
    const size_t k = r % (2 * pieces);  // recvs hold, per peer, pieces reduce-scatter then pieces all-gather
    if (k >= pieces || !slots.arrive(k)) return;
    const Slices parts = partsOf(k);
    uint8_t* mine = base(k) + parts.begin(me) * es;
    for (int j = 0; j < H; ++j) srcs[j] = j == me ? mine : slots.slot(k, (j - me + H) % H - 1);  // host order
    reduce(dt, red, mine, srcs.data(), H, parts.size(me));
    slots.markReduced(k);
  };
  ctx.mesh->exchange(ctx.tag(static_cast<uint32_t>(segment)), sends, recvs, ctx.local.wait,
                     ctx.schedule(), received);
}

// A small segment in one hop: every owner sends its whole segment to every other, and each
// reduces all H of them, in host order like the mesh's owners, so every host gets the same bits.
// One network latency instead of two, for (H - 1) x n elements sent instead of 2 (H - 1) / H x n.
void netAllreduceOneShot(HierContext& ctx, const std::vector<int>& ranks, int me, int segment, DataType dt,
                         const Reduction& red, void* buf, size_t n) {
  if (n == 0) return;
  const int H = static_cast<int>(ranks.size());
  const size_t nb = n * elementSize(dt);
  uint8_t* theirs = ctx.scratchBytes((H - 1) * nb);  // peer i (1 ... H-1), ranks[(me + i) % H], at i - 1
  std::vector<net::Send> sends;
  std::vector<net::Recv> recvs;
  for (int i = 1; i < H; ++i) {
    sends.push_back({ranks[(me + i) % H], buf, nb});
    recvs.push_back({ranks[(me + i) % H], theirs + (i - 1) * nb, nb});
  }
  ctx.mesh->exchange(ctx.tag(static_cast<uint32_t>(segment)), sends, recvs, ctx.local.wait,
                     ctx.schedule());
  std::vector<const void*> srcs(H);
  for (int j = 0; j < H; ++j) srcs[j] = j == me ? buf : theirs + ((j - me + H) % H - 1) * nb;
  reduce(dt, red, buf, srcs.data(), H, n);
}

// The counts every rank of the other hosts sends this rank, checked against what it expects.
void exchangeAlltoallCounts(HierContext& ctx, const AlltoallOptions& o, const std::vector<int>& remote) {
  std::vector<uint64_t> told(remote.size()), heard(remote.size());
  std::vector<net::Send> sends;
  std::vector<net::Recv> recvs;
  for (size_t i = 0; i < remote.size(); ++i) {
    told[i] = o.inCounts[remote[i]];
    sends.push_back({remote[i], &told[i], sizeof(uint64_t)});
    recvs.push_back({remote[i], &heard[i], sizeof(uint64_t)});
  }
  ctx.mesh->exchange(ctx.tag(0), sends, recvs, ctx.local.wait, ctx.schedule());
  for (size_t i = 0; i < remote.size(); ++i) {
    const int src = remote[i];
    if (heard[i] != o.outCounts[src]) throwSplitMismatch(src, heard[i], ctx.topo->rank, o.outCounts[src]);
  }
}

void alltoallInHost(HierContext& ctx, const AlltoallOptions& o) {
  AlltoallOptions direct{o.dtype, {}, {}, {}, {}};
  for (int g : ctx.topo->members[ctx.topo->host()]) {
    direct.inputs.push_back(o.inputs[g]);
    direct.inCounts.push_back(o.inCounts[g]);
    direct.outputs.push_back(o.outputs[g]);
    direct.outCounts.push_back(o.outCounts[g]);
  }
  alltoall(ctx.local, direct);
}

}  // namespace

namespace {
constexpr std::pair<NetAlgo, const char*> kNetAlgoNames[] = {
    {NetAlgo::kMesh, "mesh"}, {NetAlgo::kNaive, "naive"}, {NetAlgo::kRing, "ring"}};
}  // namespace

NetAlgo netAlgoFromName(const std::string& name) {
  for (const auto& [algo, n] : kNetAlgoNames) {
    if (name == n) return algo;
  }
  throwError(ErrorCode::kInvalidUsage, "SMDDP_NET_ALGO=%s: expected mesh, naive or ring", name.c_str());
}

const char* netAlgoName(NetAlgo algo) {
  for (const auto& [a, name] : kNetAlgoNames) {
    if (a == algo) return name;
  }
  return "?";
}

uint8_t* HierContext::scratchBytes(size_t n) {
  if (scratch->size() < n) scratch->resize(n);
  return scratch->data();
}

std::vector<int> alltoallPeers(const Topology& t) {
  std::vector<int> remote;
  for (int g = 0; g < t.size; ++g) {
    if (t.hostOf[g] != t.host()) remote.push_back(g);
  }
  return remote;
}

std::vector<int> hierarchicalPeers(const Topology& t) {
  std::set<int> peers;
  const int me = t.rank, H = t.hosts(), S = t.maxLocalSize();
  auto pair = [&](int a, int b) {
    if (a == me && b != me) peers.insert(b);
    if (b == me && a != me) peers.insert(a);
  };
  for (int s = 0; s < S; ++s) {  // allreduce: the owners of a segment, host to host
    for (int h = 0; h < H; ++h) {
      for (int k = h + 1; k < H; ++k) {
        const auto& a = t.members[h];
        const auto& b = t.members[k];
        pair(a[segmentOwner(S, static_cast<int>(a.size()), s)], b[segmentOwner(S, static_cast<int>(b.size()), s)]);
      }
    }
  }
  for (int g = 0; g < t.size; ++g) {
    for (int h = 0; h < H; ++h) {
      if (h == t.hostOf[g]) continue;
      pair(g, partnerOn(t, g, h));    // allgather, reduce_scatter
      pair(g, t.members[h][0]);       // broadcast from any root; barrier
    }
  }
  return {peers.begin(), peers.end()};
}

void hierAllreduce(HierContext& ctx, const AllreduceOptions& o) {
  const Topology& t = *ctx.topo;
  const size_t N = o.count, es = elementSize(o.dtype);
  if (N == 0) return;
  const int S = t.maxLocalSize(), L = t.localSize(), l = t.localRank(), h = t.host();
  std::vector<uint8_t> notMine;  // a reduce's non-root ranks compute into a buffer of their own
  void* out = o.output;
  if (o.root >= 0 && o.root != t.rank) {
    notMine.resize(N * es);
    out = notMine.data();
  }
  const Slices segs = slicesOf(N, S, alignElems(o.dtype));
  auto rangeBegin = [&](int li) { return segs.begin(firstSegment(S, L, li)); };
  auto rangeEnd = [&](int li) { return segs.begin(firstSegment(S, L, li + 1)); };

  const Stages stages = stagesOf(o.dtype, o.reduction, t.maxLocalSize(), ctx.algo == NetAlgo::kRing);
  ReduceScatterOptions rs{o.dtype, stages.local, {}, bytes(out) + rangeBegin(l) * es, 0, {}};
  for (int li = 0; li < L; ++li) {
    rs.inputs.push_back(bytes(o.input) + rangeBegin(li) * es);
    rs.counts.push_back(rangeEnd(li) - rangeBegin(li));
  }
  // Alone on its host and in place, the local stage would copy the message onto itself.
  if (L > 1 || out != o.input || stages.hostsScale) reduceScatter(ctx.local, rs);

  // Small messages cross the network in one hop (the test is on the message, the same on every
  // rank: what a host's ranks send together, not one segment, decides whether it pays).
  const bool oneShot = static_cast<size_t>(t.hosts() - 1) * N * es <= ctx.oneShotBytes;
  for (int s = firstSegment(S, L, l); s < firstSegment(S, L, l + 1); ++s) {
    std::vector<int> owners;
    for (int k = 0; k < t.hosts(); ++k) {
      owners.push_back(t.members[k][segmentOwner(S, static_cast<int>(t.members[k].size()), s)]);
    }
    auto* segment = bytes(out) + segs.begin(s) * es;
    if (ctx.algo == NetAlgo::kRing) {
      netAllreduceRing(ctx, owners, h, s, o.dtype, stages.net, segment, segs.size(s));
    } else if (oneShot) {
      netAllreduceOneShot(ctx, owners, h, s, o.dtype, stages.net, segment, segs.size(s));
    } else {
      netAllreduceMesh(ctx, owners, h, s, o.dtype, stages.net, segment, segs.size(s));
    }
  }

  AllgatherOptions ag{o.dtype, bytes(out) + rangeBegin(l) * es, {}, {}, -1};
  for (int li = 0; li < L; ++li) {
    ag.outputs.push_back(bytes(out) + rangeBegin(li) * es);
    ag.counts.push_back(rangeEnd(li) - rangeBegin(li));
  }
  OpContext staged = ctx.local;  // the allreduce's all-gather was not measured reading in place
  staged.singleCopyBytes = SIZE_MAX;
  allgather(staged, ag);
}

void hierAllgather(HierContext& ctx, const AllgatherOptions& o) {
  const Topology& t = *ctx.topo;
  const size_t es = elementSize(o.dtype);
  const int me = t.rank, h = t.host(), L = t.localSize();
  std::vector<net::Send> sends;
  std::vector<net::Recv> recvs;
  for (int k = 0; k < t.hosts(); ++k) {
    if (k != h) sends.push_back({partnerOn(t, me, k), o.input, o.counts[me] * es});
  }
  for (int g = 0; g < t.size; ++g) {
    if (t.hostOf[g] != h && partnerOn(t, g, h) == me) recvs.push_back({g, o.outputs[g], o.counts[g] * es});
  }
  ctx.mesh->exchange(ctx.tag(0), sends, recvs, ctx.local.wait, ctx.schedule());

  // Then rounds inside the host: in round k each local rank shares its k-th block (its own first,
  // then those it received, by rank).
  std::vector<std::vector<int>> blocks(L);
  for (int li = 0; li < L; ++li) blocks[li].push_back(t.members[h][li]);
  for (int g = 0; g < t.size; ++g) {
    if (t.hostOf[g] != h) blocks[t.localOf[g] % L].push_back(g);
  }
  size_t rounds = 0;
  for (const auto& b : blocks) rounds = std::max(rounds, b.size());
  for (size_t k = 0; k < rounds; ++k) {
    AllgatherOptions ag{o.dtype, nullptr, std::vector<void*>(L, nullptr), std::vector<size_t>(L, 0), -1};
    for (int li = 0; li < L; ++li) {
      if (k >= blocks[li].size()) continue;
      const int g = blocks[li][k];
      ag.outputs[li] = o.outputs[g];
      ag.counts[li] = o.counts[g];
    }
    if (k < blocks[t.localRank()].size()) {
      const int g = blocks[t.localRank()][k];
      ag.input = g == me ? o.input : o.outputs[g];
    }
    allgather(ctx.local, ag);
  }
}

namespace {

// For gather and scatter: the root's host's local ranks, each with the parts it takes part in
// the host's rounds with: its own first, then those of the other hosts' ranks it is the partner
// of (partnerOn), which it receives for the root (gather) or forwards from it (scatter).
std::vector<std::vector<int>> rootHostBlocks(const Topology& t) {
  const int h = t.host();
  std::vector<std::vector<int>> blocks(t.localSize());
  for (int li = 0; li < t.localSize(); ++li) blocks[li].push_back(t.members[h][li]);
  for (int g = 0; g < t.size; ++g) {
    if (t.hostOf[g] != h) blocks[t.localOf[partnerOn(t, g, h)]].push_back(g);
  }
  return blocks;
}

// Gather and scatter move data only between a rank of another host and its partner on the root's
// host, so ranks that run another op might never meet and a rank would return, run ahead, and
// have the mismatch reported at its next op, naming the wrong one. Two checks keep a mismatch
// reported where it happens: the ranks of each host other than the root's pass a barrier (one
// shared-memory step, whose signature host-mates compare) before they touch the network, and
// every message across a hop is answered (acknowledged()).
//
// Takes `recvs`, each from another host, and answers each with an empty message once it has
// arrived whole (its header checked against this op); the sender waits for that answer. Costs
// one latency.
void acknowledged(HierContext& ctx, const std::vector<net::Recv>& recvs) {
  if (recvs.empty()) return;
  std::unique_ptr<bool[]> arrived(new bool[recvs.size()]());
  std::vector<net::Send> acks;
  for (size_t i = 0; i < recvs.size(); ++i) acks.push_back({recvs[i].peer, nullptr, 0, &arrived[i]});
  ctx.mesh->exchange(ctx.tag(0), acks, recvs, ctx.local.wait, ctx.schedule(), [&](size_t i) { arrived[i] = true; });
}

// The other end of acknowledged(): sends `sends`, each to another host, and waits for each answer.
void sendAcknowledged(HierContext& ctx, const std::vector<net::Send>& sends) {
  if (sends.empty()) return;
  std::vector<net::Recv> answers;
  for (const net::Send& m : sends) answers.push_back({m.peer, nullptr, 0});
  ctx.mesh->exchange(ctx.tag(0), sends, answers, ctx.local.wait, ctx.schedule());
}

size_t roundsOf(const std::vector<std::vector<int>>& blocks) {
  size_t rounds = 0;
  for (const auto& b : blocks) rounds = std::max(rounds, b.size());
  return rounds;
}

}  // namespace

// Every part crosses the network once, one hop to the root's host: each rank of another host
// sends its part to its partner there (and waits for its answer, acknowledged()), and that host's
// ranks then gather to the root in rounds (until 2026-12-01 a gather was an all-gather whose
// non-root ranks kept nothing: every part went to every host, 2.5-3.5x gloo's time at 8 MiB on 4
// emulated hosts).
void hierGather(HierContext& ctx, const AllgatherOptions& o) {
  const Topology& t = *ctx.topo;
  const size_t es = elementSize(o.dtype);
  const int me = t.rank, rootHost = t.hostOf[o.root];
  if (t.host() != rootHost) {
    barrier(ctx.local);  // see acknowledged()
    sendAcknowledged(ctx, {{partnerOn(t, me, rootHost), o.input, o.counts[me] * es}});
    return;
  }
  const bool root = me == o.root;
  const std::vector<std::vector<int>> blocks = rootHostBlocks(t);
  const std::vector<int>& mine = blocks[t.localRank()];
  // The parts this rank receives: the root's straight into its outputs, a host-mate's held here.
  std::vector<size_t> at(mine.size(), 0);
  size_t held = 0;
  for (size_t k = 1; k < mine.size(); ++k) at[k] = std::exchange(held, held + o.counts[mine[k]] * es);
  uint8_t* hold = root || held == 0 ? nullptr : ctx.scratchBytes(held);
  auto part = [&](size_t k) -> void* { return root ? o.outputs[mine[k]] : hold + at[k]; };
  std::vector<net::Recv> recvs;
  for (size_t k = 1; k < mine.size(); ++k) recvs.push_back({mine[k], part(k), o.counts[mine[k]] * es});
  acknowledged(ctx, recvs);
  const int L = t.localSize();
  for (size_t k = 0; k < roundsOf(blocks); ++k) {
    AllgatherOptions round{o.dtype, nullptr, std::vector<void*>(L, nullptr), std::vector<size_t>(L, 0),
                           t.localOf[o.root]};
    for (int li = 0; li < L; ++li) {
      if (k >= blocks[li].size()) continue;
      round.counts[li] = o.counts[blocks[li][k]];
      if (root) round.outputs[li] = o.outputs[blocks[li][k]];
    }
    if (k < mine.size()) round.input = k == 0 ? o.input : part(k);
    allgather(ctx.local, round);
  }
}

// The reverse of hierGather: the root's host scatters in rounds, each local rank taking its own
// block and those it forwards, one hop, to its partners on the other hosts (until 2026-12-01 a
// scatter was one broadcast per block: every block went to every host).
void hierScatter(HierContext& ctx, const ScatterOptions& o) {
  const Topology& t = *ctx.topo;
  const size_t each = o.count * elementSize(o.dtype);
  const int me = t.rank, rootHost = t.hostOf[o.root];
  if (t.host() != rootHost) {
    barrier(ctx.local);  // see acknowledged()
    acknowledged(ctx, {{partnerOn(t, me, rootHost), o.output, each}});
    return;
  }
  const bool root = me == o.root;
  const std::vector<std::vector<int>> blocks = rootHostBlocks(t);
  const std::vector<int>& mine = blocks[t.localRank()];
  const size_t rounds = roundsOf(blocks);
  // The blocks this rank forwards (the root's from its inputs), and where a rank without a block
  // in a round puts the one it is given (a scatter gives every rank one).
  uint8_t* hold = root || each == 0 ? nullptr : ctx.scratchBytes(each * rounds);
  auto part = [&](size_t k) -> void* {
    if (root) return const_cast<void*>(o.inputs[k < mine.size() ? mine[k] : o.root]);  // never written
    return hold + each * (k - 1);
  };
  const int L = t.localSize();
  for (size_t k = 0; k < rounds; ++k) {
    ScatterOptions round{o.dtype, std::vector<const void*>(L, nullptr), k == 0 ? o.output : part(k), o.count,
                         t.localOf[o.root]};
    for (int li = 0; root && li < L; ++li) round.inputs[li] = o.inputs[k < blocks[li].size() ? blocks[li][k] : o.root];
    scatter(ctx.local, round);
  }
  std::vector<net::Send> sends;
  for (size_t k = 1; k < mine.size(); ++k) sends.push_back({mine[k], part(k), each});
  sendAcknowledged(ctx, sends);
}

void hierReduceScatter(HierContext& ctx, const ReduceScatterOptions& o) {
  const Topology& t = *ctx.topo;
  const size_t es = elementSize(o.dtype);
  const int me = t.rank, h = t.host(), L = t.localSize(), H = t.hosts();
  auto cnt = [&](int g) { return o.counts.empty() ? o.count : o.counts[g]; };
  // Block g is reduced on this host at local rank (g's local index mod L).
  std::vector<std::vector<int>> blocks(L);
  for (int g = 0; g < t.size; ++g) blocks[t.localOf[g] % L].push_back(g);
  const std::vector<int>& mine = blocks[t.localRank()];
  std::vector<size_t> partialAt(mine.size());
  size_t total = 0;
  for (size_t k = 0; k < mine.size(); ++k) {
    partialAt[k] = total;
    total += cnt(mine[k]) * es;
  }
  // A rank alone on its host sends its input blocks as they are: there is nothing to reduce
  // locally, unless the hosts scale their partials (stagesOf; the owners add all hosts' at once).
  const Stages stages = stagesOf(o.dtype, o.reduction, t.maxLocalSize(), false);
  const bool asTheyAre = L == 1 && !stages.hostsScale;
  const size_t recvAt = asTheyAre ? 0 : total;
  // The network stage is one streamed exchange: every partial goes to its owner in pieces, and
  // the owner reduces piece k of its block as soon as the last host's piece k is in, while later
  // pieces are still arriving. Pieces are cut from the block's size alone, alike on both ends.
  const int peers = H - 1;
  auto pieceOf = [&](int g) { return streamPieceElems(cnt(g) * es, ctx.bufferBytes / peers, o.dtype); };
  const size_t piece = pieceOf(me), pieces = (cnt(me) + piece - 1) / piece;
  ContributionSlots slots(pieces, peers, std::min(piece, cnt(me)) * es, ctx.bufferBytes);
  uint8_t* tmp = ctx.scratchBytes(recvAt + slots.bytes());
  slots.place(tmp + recvAt);
  auto partial = [&](size_t k) -> const void* { return asTheyAre ? o.inputs[mine[k]] : tmp + partialAt[k]; };

  size_t rounds = 0;
  for (const auto& b : blocks) rounds = std::max(rounds, b.size());
  for (size_t k = 0; k < mine.size() && L == 1 && !asTheyAre; ++k) {
    const void* in = o.inputs[mine[k]];
    reduce(o.dtype, stages.local, tmp + partialAt[k], &in, 1, cnt(mine[k]));
  }
  for (size_t k = 0; k < rounds && L > 1; ++k) {
    ReduceScatterOptions rs{o.dtype, stages.local, std::vector<const void*>(L, o.inputs[0]),
                            k < mine.size() ? tmp + partialAt[k] : nullptr, 0, std::vector<size_t>(L, 0)};
    for (int li = 0; li < L; ++li) {
      if (k >= blocks[li].size()) continue;
      rs.inputs[li] = o.inputs[blocks[li][k]];
      rs.counts[li] = cnt(blocks[li][k]);
    }
    reduceScatter(ctx.local, rs);
  }

  // Outgoing partials go to their rank on another host, in pieces; this rank's own stays for the
  // reduction; the other hosts' partials of block `me` come from this rank's partner on each.
  std::vector<net::Send> sends;
  const uint8_t* own = nullptr;
  for (size_t k = 0; k < mine.size(); ++k) {
    const int g = mine[k];
    if (g == me) {
      own = bytes(partial(k));
      continue;
    }
    if (t.hostOf[g] == h) continue;
    const uint8_t* data = bytes(partial(k));
    const size_t gPiece = pieceOf(g);
    for (size_t at = 0; at < cnt(g); at += gPiece) {
      sends.push_back({g, data + at * es, pieceSpan(cnt(g), at, gPiece) * es});
    }
  }
  std::vector<net::Recv> recvs;
  for (int k = 0, i = 0; k < H; ++k) {
    if (k == h) continue;
    const int source = partnerOn(t, me, k);
    for (size_t p = 0; p < pieces; ++p) {
      recvs.push_back({source, slots.slot(p, i), pieceSpan(cnt(me), p * piece, piece) * es, slots.slotFree(p)});
    }
    ++i;
  }
  std::vector<const void*> srcs(H);
  auto received = [&](size_t r) {
    const size_t p = r % pieces;  // recvs hold, per source, the pieces in order
    if (!slots.arrive(p)) return;
    const size_t at = p * piece;
    for (int k = 0, i = 0; k < H; ++k) srcs[k] = k == h ? own + at * es : slots.slot(p, i++);  // host order
    reduce(o.dtype, stages.net, bytes(o.output) + at * es, srcs.data(), H, pieceSpan(cnt(me), at, piece));
    slots.markReduced(p);
  };
  ctx.mesh->exchange(ctx.tag(0), sends, recvs, ctx.local.wait, ctx.schedule(), received);
}

namespace {

// Broadcast among hosts, relayed: the message is cut into one segment per other host; the root
// sends segment i to host i's first rank, which forwards it, piece by piece as the pieces
// arrive, to the other hosts' first ranks. The root's link carries the message once instead of
// once per host, every other link about as much, for one more network latency.
// `relays`: the first rank of every host but the root's; relay i carries segment i.
void netBroadcastRelayed(HierContext& ctx, const BroadcastOptions& o, const std::vector<int>& relays, net::Tag tag) {
  const Topology& t = *ctx.topo;
  const size_t es = elementSize(o.dtype);
  const int R = static_cast<int>(relays.size());
  const Slices segs = slicesOf(o.count, R, alignElems(o.dtype));
  const size_t piece = streamPieceElems(segs.per * es, ctx.bufferBytes, o.dtype);
  // Segment i as messages of at most `piece` elements, in order.
  auto pieces = [&](int i, auto&& each) {
    for (size_t at = segs.begin(i); at < segs.end(i); at += piece) {
      each(bytes(o.buffer) + at * es, std::min(piece, segs.end(i) - at) * es);
    }
  };
  std::vector<net::Send> sends;
  std::vector<net::Recv> recvs;
  if (t.rank == o.root) {
    for (int i = 0; i < R; ++i) pieces(i, [&](uint8_t* at, size_t n) { sends.push_back({relays[i], at, n}); });
    ctx.mesh->exchange(tag, sends, recvs, ctx.local.wait, ctx.schedule());
    return;
  }
  const int me = static_cast<int>(std::find(relays.begin(), relays.end(), t.rank) - relays.begin());
  if (me == R) return;  // not a relay: the host broadcast brings the message
  pieces(me, [&](uint8_t* at, size_t n) { recvs.push_back({o.root, at, n}); });
  const size_t own = recvs.size();
  std::unique_ptr<bool[]> arrived(new bool[std::max<size_t>(own, 1)]());  // piece j of my segment is in
  for (int i = 0; i < R; ++i) {
    if (i == me) continue;
    size_t j = 0;
    pieces(me, [&](uint8_t* at, size_t n) { sends.push_back({relays[i], at, n, &arrived[j++]}); });
    pieces(i, [&](uint8_t* at, size_t n) { recvs.push_back({relays[i], at, n}); });
  }
  ctx.mesh->exchange(tag, sends, recvs, ctx.local.wait, ctx.schedule(), [&](size_t k) {
    if (k < own) arrived[k] = true;
  });
}

}  // namespace

void hierBroadcast(HierContext& ctx, const BroadcastOptions& o) {
  const Topology& t = *ctx.topo;
  const size_t bytesTotal = o.count * elementSize(o.dtype);
  const int h = t.host(), rootHost = t.hostOf[o.root];
  const net::Tag tag = ctx.tag(0);
  std::vector<int> firsts;  // the first rank of every other host than the root's
  for (int k = 0; k < t.hosts(); ++k) {
    if (k != rootHost) firsts.push_back(t.members[k][0]);
  }
  // Relaying pays once the root would send the message more than once (3 hosts or more), except
  // for small messages, whose extra latency costs more than the bytes saved (as with allreduce's
  // one-shot, and with the same threshold).
  if (firsts.size() >= 2 && firsts.size() * bytesTotal > ctx.oneShotBytes) {
    netBroadcastRelayed(ctx, o, firsts, tag);
  } else if (t.rank == o.root) {
    std::vector<net::Send> sends;
    for (int g : firsts) sends.push_back({g, o.buffer, bytesTotal});
    ctx.mesh->exchange(tag, sends, {}, ctx.local.wait, ctx.schedule());
  } else if (h != rootHost && t.localRank() == 0) {
    ctx.mesh->exchange(tag, {}, {{o.root, o.buffer, bytesTotal}}, ctx.local.wait, ctx.schedule());
  }
  BroadcastOptions local = o;
  local.root = h == rootHost ? t.localOf[o.root] : 0;
  broadcast(ctx.local, local);
}

void hierAlltoall(HierContext& ctx, const AlltoallOptions& o, const std::vector<int>& remote) {
  const size_t es = elementSize(o.dtype);
  if (o.countsFirst) {
    // Every rank checks its counts before any data moves; the shared-memory step then holds back
    // this host's ranks if one of them found a mismatch, and the network step every remote rank
    // (each waits for a message from every rank, empty or not): the op fails on every rank.
    exchangeAlltoallCounts(ctx, o, remote);
    alltoallInHost(ctx, o);
  }
  // Every block for a rank of another host goes straight to it, one hop, in one rate-controlled
  // exchange with all of them; each header carries the block's size, which the receiver checks.
  std::vector<net::Send> sends;
  std::vector<net::Recv> recvs;
  for (int g : remote) {
    sends.push_back({g, o.inputs[g], o.inCounts[g] * es});
    recvs.push_back({g, o.outputs[g], o.outCounts[g] * es});
  }
  try {
    ctx.mesh->exchange(ctx.tag(1), sends, recvs, ctx.local.wait, ctx.schedule());
  } catch (const net::wire::HeaderMismatch& m) {
    // Same op and step but another size: the sender's split for this rank is not what it expects.
    if (m.sent().tag != m.expected().tag || m.sent().op != m.expected().op || m.sent().shape != m.expected().shape ||
        m.sent().bytes % es != 0) {
      throw;
    }
    throwSplitMismatch(m.peer(), m.sent().bytes / es, ctx.topo->rank, m.expected().bytes / es);
  }
  // Blocks between ranks of this host last: a rank that found a wrong size above holds its
  // host-mates back here, so they fail too.
  if (!o.countsFirst) alltoallInHost(ctx, o);
}

void hierBarrier(HierContext& ctx) {
  const Topology& t = *ctx.topo;
  barrier(ctx.local);
  if (t.localRank() == 0) {
    std::vector<net::Send> sends;
    std::vector<net::Recv> recvs;
    for (int k = 0; k < t.hosts(); ++k) {
      if (k == t.host()) continue;
      sends.push_back({t.members[k][0], nullptr, 0});
      recvs.push_back({t.members[k][0], nullptr, 0});
    }
    ctx.mesh->exchange(ctx.tag(0), sends, recvs, ctx.local.wait, ctx.schedule());
  }
  barrier(ctx.local);
}

}  // namespace smddp::algo
