// smddp_perf's data check (see perf_check.h).
#include "perf_check.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace smddp::perf {

bool reduces(const std::string& coll) { return coll == "all_reduce" || coll == "reduce_scatter"; }

Shape shapeOf(const std::string& coll, size_t bytes, size_t es, int W) {
  const size_t n = bytes / es;
  if (coll == "all_reduce") return {n, n, n, 2.0 * (W - 1) / W};
  if (coll == "broadcast") return {n, n, n, 1.0};
  if (coll == "all_gather") return {n / W, n / W * W, n / W, double(W - 1) / W};
  if (coll == "all_to_all") return {n / W * W, n / W * W, n / W * W, double(W - 1) / W};
  return {n / W * W, n / W, n / W, double(W - 1) / W};
}

namespace {

// ---- element values: small integers, exact in every type, stored in the type's encoding ----
// A binary float of `mantBits` mantissa bits and exponent bias `bias` (float16: 10, 15;
// float8_e4m3fn: 3, 7; float8_e5m2: 2, 15), finite values only; `signBit` is the top bit.
struct Minifloat {
  int mantBits, bias;
  uint32_t signBit;
};
constexpr Minifloat kHalf{10, 15, 0x8000}, kE4M3{3, 7, 0x80}, kE5M2{2, 15, 0x80};
uint32_t minifloatBits(double v, Minifloat f) {  // exact for the small integers used here
  if (v == 0) return 0;
  double m = std::fabs(v);
  int e = 0;
  while (m >= 2) m /= 2, ++e;
  while (m < 1) m *= 2, --e;
  return (v < 0 ? f.signBit : 0) | static_cast<uint32_t>((e + f.bias) << f.mantBits) |
         static_cast<uint32_t>(std::lround((m - 1) * (1 << f.mantBits)));
}
double minifloatValue(uint32_t b, Minifloat f) {
  const int e = static_cast<int>((b & (f.signBit - 1)) >> f.mantBits);
  const double m = static_cast<double>(b & ((1u << f.mantBits) - 1)) / (1 << f.mantBits);
  const double v = e == 0 ? m * std::ldexp(1.0, 1 - f.bias) : (1 + m) * std::ldexp(1.0, e - f.bias);
  return (b & f.signBit) ? -v : v;
}
}  // namespace

void storeValue(DataType dt, void* base, size_t i, double v) {
  switch (dt) {
    case DataType::kFloat32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case DataType::kFloat64: static_cast<double*>(base)[i] = v; break;
    case DataType::kFloat16: static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(minifloatBits(v, kHalf)); break;
    case DataType::kFloat8E4M3: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(minifloatBits(v, kE4M3)); break;
    case DataType::kFloat8E5M2: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(minifloatBits(v, kE5M2)); break;
    case DataType::kBFloat16: {
      const float f = static_cast<float>(v);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(u >> 16);
      break;
    }
    case DataType::kInt32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); break;
    case DataType::kInt8: static_cast<int8_t*>(base)[i] = static_cast<int8_t>(v); break;
    case DataType::kUInt8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); break;
    case DataType::kInt64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); break;
    case DataType::kUInt32: static_cast<uint32_t*>(base)[i] = static_cast<uint32_t>(v); break;
    case DataType::kUInt64: static_cast<uint64_t*>(base)[i] = static_cast<uint64_t>(v); break;
    default: break;
  }
}
double load(DataType dt, const void* base, size_t i) {
  switch (dt) {
    case DataType::kFloat32: return static_cast<const float*>(base)[i];
    case DataType::kFloat64: return static_cast<const double*>(base)[i];
    case DataType::kFloat16: return minifloatValue(static_cast<const uint16_t*>(base)[i], kHalf);
    case DataType::kFloat8E4M3: return minifloatValue(static_cast<const uint8_t*>(base)[i], kE4M3);
    case DataType::kFloat8E5M2: return minifloatValue(static_cast<const uint8_t*>(base)[i], kE5M2);
    case DataType::kBFloat16: {
      const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    case DataType::kInt32: return static_cast<const int32_t*>(base)[i];
    case DataType::kInt8: return static_cast<const int8_t*>(base)[i];
    case DataType::kUInt8: return static_cast<const uint8_t*>(base)[i];
    case DataType::kInt64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DataType::kUInt32: return static_cast<const uint32_t*>(base)[i];
    case DataType::kUInt64: return static_cast<double>(static_cast<const uint64_t*>(base)[i]);
    default: return NAN;
  }
}
namespace {

bool isFloat8(DataType dt) { return dt == DataType::kFloat8E4M3 || dt == DataType::kFloat8E5M2; }
// Element i's values follow spread(i), not i, and each rank's its own bits of it: patterns in i
// and r themselves (1 + (r + 3i) % 4) repeated every 4 elements, and summed, multiplied or took
// the maximum to the same value at every element from 4 ranks on, so that data which landed at
// another element's place (rotated, halves swapped, every rank handed chunk 0 or block 0)
// matched what was expected (until 2026-12-04).
size_t spread(size_t i) {  // splitmix64's finaliser: neighbouring i give unrelated values
  uint64_t z = i + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<size_t>(z ^ (z >> 31));
}
// Rank r's element i: 1..4, or 1..2 for prod. Sums take them from at most 8 ranks (the carriers,
// a different 8 for each i), the other ranks giving 0, so that any partial sum, in any order, is
// an integer every type holds exactly, int8 included (at most 8 x 4), whatever the world size;
// a product has at most 4 factors of 2 (at most 16; with every rank contributing, 16 ranks
// multiplied eight 2s and wrapped int8 and uint8 around), their count following i. MIN and MAX
// take 1..4 from 2 carriers, the other ranks giving the value that never wins (4 for MIN, 1 for
// MAX): with every rank's 1..4, 16 ranks' maximum was 4 at almost every element, and data at
// another element's place went unseen. float8 holds fewer integers exactly (e5m2 up to 8, e4m3
// up to 16) and rounds every partial sum, so there a sum's carriers give 1 or 2, and e5m2 has 4.
double valueOf(ReduceOp op, DataType dt, int W, int r, size_t i) {
  const size_t h = spread(i);
  const size_t place = (static_cast<size_t>(r) + h) % static_cast<size_t>(W);  // r's among i's ranks
  // Hashed apart from `place`: bits of h itself repeat the place's at a world of 2^k ranks (at
  // 16, rank 1 carried a MIN's 1..4 only as 4 or in a tie, so leaving it out counted 0 wrong) and
  // every 32 ranks (until 2026-12-06).
  const unsigned bits = static_cast<unsigned>(spread(h ^ spread(static_cast<size_t>(r)))) & 3;
  if (op == ReduceOp::kProduct) return place < (h >> 60) % 5 ? 2 : 1;
  if (op == ReduceOp::kMin || op == ReduceOp::kMax) return place < 2 ? 1 + bits : op == ReduceOp::kMin ? 4 : 1;
  const size_t carriers = dt == DataType::kFloat8E5M2 ? 4 : 8;
  if (place >= carriers) return 0;
  return 1 + (isFloat8(dt) ? bits & 1 : bits);
}
// Data that only moves (broadcast, all_gather, all_to_all): element i shows base-4 digit i % 4
// of the rank, shifted by spread(i), so any two of 256 ranks differ within every 4 consecutive
// elements (valueOf's pattern repeats every 32 ranks: a broadcast that never reached a rank 32
// away from its root, which starts with its own data, would pass the check). 1..4: exact in
// every type.
double movedValueOf(int r, size_t i) { return 1 + static_cast<double>(((r >> (2 * (i % 4))) + spread(i)) % 4); }
}  // namespace

// Rank r's input element i for the collective `coll` reduces or moves.
double inputValueOf(const std::string& coll, ReduceOp op, DataType dt, int W, int r, size_t i) {
  return reduces(coll) ? valueOf(op, dt, W, r, i) : movedValueOf(r, i);
}
namespace {

// `v` rounded to the nearest value of format `f`, ties to even (within its finite range).
double roundToMinifloat(double v, Minifloat f) {
  if (v == 0) return v;
  const int e = std::max(std::ilogb(v), 1 - f.bias);  // subnormals share the smallest normal's step
  const double step = std::ldexp(1.0, e - f.mantBits);
  return std::nearbyint(v / step) * step;
}
// Whether an AVG of `dt` across hosts rounds before its end (hierarchical.cc's stagesOf): float8
// always scales and rounds each host's partial sum before the hosts add, float16 only under the
// ring schedule (elsewhere its partials are integers, scaled by a power of two).
bool roundsOnTheWay(ReduceOp op, DataType dt, const Topology& topo, bool ringRounds) {
  if (op != ReduceOp::kAvg || topo.hosts() == 1) return false;
  return isFloat8(dt) ? ringRounds || topo.maxLocalSize() > 1 : dt == DataType::kFloat16 && ringRounds;
}
// What an op leaves in element i, before the final rounding to its type (close()). Where an AVG
// rounds on the way (roundsOnTheWay), hosts scale by 1/P (P the smallest power of two at least the
// largest host's rank count L) and the sum of their partials by P / W, in float as the kernels
// do. Under the ring schedule an allreduce's hosts scale by 1/W, and each running sum of their
// partials rounds too, in host order from the host `ringStart` (each part of the message starts
// its way round the ring at another host).
double reduced(ReduceOp op, DataType dt, int W, size_t i, const Topology& topo, bool ringRounds, int ringStart) {
  if (roundsOnTheWay(op, dt, topo, ringRounds)) {
    const unsigned P = std::bit_ceil(static_cast<unsigned>(topo.maxLocalSize()));
    const Minifloat f = dt == DataType::kFloat8E4M3 ? kE4M3 : dt == DataType::kFloat8E5M2 ? kE5M2 : kHalf;
    const int H = topo.hosts();
    float acc = 0;
    for (int k = 0; k < H; ++k) {
      float partial = 0;
      const int host = ringRounds ? (ringStart + k) % H : k;
      for (int r : topo.members[host]) partial += static_cast<float>(valueOf(op, dt, W, r, i));
      const float scaled = ringRounds ? partial / static_cast<float>(W) : partial * static_cast<float>(1.0 / P);
      acc += static_cast<float>(roundToMinifloat(scaled, f));
      if (ringRounds) acc = static_cast<float>(roundToMinifloat(acc, f));
    }
    return ringRounds ? acc : acc * static_cast<float>(static_cast<double>(P) / W);
  }
  double acc = valueOf(op, dt, W, 0, i);
  for (int r = 1; r < W; ++r) {
    const double v = valueOf(op, dt, W, r, i);
    if (op == ReduceOp::kProduct) acc *= v;
    else if (op == ReduceOp::kMin) acc = std::min(acc, v);
    else if (op == ReduceOp::kMax) acc = std::max(acc, v);
    else acc += v;
  }
  if (op == ReduceOp::kAvg) acc = isFloatingPoint(dt) ? acc / W : std::trunc(acc / W);
  return acc;
}
// float8 is checked exactly (an AVG rounds once, at its division, and across hosts also each
// host's scaled partial, and under the ring each running sum: reduced()). Elsewhere sums past the
// types' exact integers round, at most once per reduction step, by half a unit in the last place.
bool close(DataType dt, double got, double want) {
  if (dt == DataType::kFloat8E4M3) return got == roundToMinifloat(want, kE4M3);
  if (dt == DataType::kFloat8E5M2) return got == roundToMinifloat(want, kE5M2);
  const double tol = dt == DataType::kBFloat16 ? 8e-3 : dt == DataType::kFloat16 ? 1e-3 : 1e-6;
  return std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
}

}  // namespace

size_t countWrong(const Check& c, const void* out, const Shape& s, int rank, const Topology& topo) {
  const int W = topo.size;
  size_t wrong = 0;
  for (size_t i = 0; i < s.outElems; ++i) {
    double want;
    if (c.coll == "all_reduce" && c.ringRounds && roundsOnTheWay(c.op, c.dt, topo, true)) {
      // Which host starts element i's way round the ring follows the ring's cut of the message
      // into pieces and parts: any start is accepted (its sums still need every host's partial).
      const double got = load(c.dt, out, i);
      bool any = false;
      for (int h = 0; h < topo.hosts() && !any; ++h) {
        any = close(c.dt, got, reduced(c.op, c.dt, W, i, topo, true, h));
      }
      wrong += !any;
      continue;
    }
    if (c.coll == "all_reduce") want = reduced(c.op, c.dt, W, i, topo, c.ringRounds, 0);
    else if (c.coll == "broadcast") want = movedValueOf(c.root, i);
    else if (c.coll == "all_gather") want = movedValueOf(static_cast<int>(i / s.inElems), i % s.inElems);
    else if (c.coll == "all_to_all") want = movedValueOf(static_cast<int>(i / (s.outElems / W)),
                                                         rank * (s.outElems / W) + i % (s.outElems / W));
    else want = reduced(c.op, c.dt, W, rank * s.outElems + i, topo, false, 0);
    wrong += !close(c.dt, load(c.dt, out, i), want);
  }
  return wrong;
}

}  // namespace smddp::perf
