// Torch-free check of the reduce and copy kernels: every instruction-set variant this CPU supports, for
// every dtype x reduce op the core accepts, against a plain reference, with block tails and
// several source counts. Prints one line per failure and a closing "N passed, N failed".
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "core/copy.h"
#include "core/reduce.h"
#include "core/strided_copy.h"
#include "core/types.h"

using namespace smddp;

namespace {

int passed = 0, failed = 0;

float bf16ToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A binary float's value from its fields (sign on top, then exponent, then mantissa),
// independently of the kernels' bit tricks. IEEE formats (float16, float8_e5m2) have inf and NaN
// at the top exponent; float8_e4m3fn has no infinity, and S.1111.111 is its NaN.
struct Format {
  int expBits, mantBits;
  bool ieee;
};
constexpr Format kHalfFmt{5, 10, true}, kE4M3Fmt{4, 3, false}, kE5M2Fmt{5, 2, true};
double valueOf(Format f, uint32_t b) {
  const uint32_t magnitude = b & ((1u << (f.expBits + f.mantBits)) - 1);
  const int bias = (1 << (f.expBits - 1)) - 1, eMax = (1 << f.expBits) - 1;
  const int e = static_cast<int>(magnitude >> f.mantBits), m = static_cast<int>(magnitude & ((1u << f.mantBits) - 1));
  const double sign = (b >> (f.expBits + f.mantBits)) & 1 ? -1.0 : 1.0;
  if (!f.ieee && magnitude == (1u << (f.expBits + f.mantBits)) - 1) return NAN;
  if (f.ieee && e == eMax) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, 1 - bias - f.mantBits);
  return sign * std::ldexp((1 << f.mantBits) + m, e - bias - f.mantBits);
}
Format formatOf(DataType dt) {
  return dt == DataType::kFloat16 ? kHalfFmt : dt == DataType::kFloat8E4M3 ? kE4M3Fmt : kE5M2Fmt;
}
// The pattern of a value the format holds exactly (found by search: the test's values are few).
uint32_t patternOf(Format f, double v) {
  for (uint32_t b = 0; b < (2u << (f.expBits + f.mantBits)); ++b) {
    if (valueOf(f, b) == v) return b;
  }
  return 0;
}
double float8Value(DataType dt, uint8_t b) { return valueOf(formatOf(dt), b); }
// patternOf for the small integers -4..4 that fill() uses, found once per format.
uint32_t smallPattern(Format f, int v) {
  static std::map<std::pair<int, int>, uint32_t> found;
  auto [it, fresh] = found.try_emplace({f.expBits * 100 + f.mantBits, v}, 0);
  if (fresh) it->second = patternOf(f, v);
  return it->second;
}

// Reference value of element i as a double (floats) or as wrapped integer bits (ints/bool).
double loadAsDouble(DataType dt, const uint8_t* p, size_t i) {
  switch (dt) {
    case DataType::kFloat8E4M3:
    case DataType::kFloat8E5M2: return float8Value(dt, p[i]);
    case DataType::kFloat32: return reinterpret_cast<const float*>(p)[i];
    case DataType::kFloat64: return reinterpret_cast<const double*>(p)[i];
    case DataType::kFloat16: return valueOf(kHalfFmt, reinterpret_cast<const uint16_t*>(p)[i]);
    case DataType::kBFloat16: return bf16ToFloat(reinterpret_cast<const uint16_t*>(p)[i]);
    default: return 0;
  }
}
int64_t loadAsInt(DataType dt, const uint8_t* p, size_t i) {
  switch (dt) {
    case DataType::kInt8: return reinterpret_cast<const int8_t*>(p)[i];
    case DataType::kUInt8:
    case DataType::kBool: return reinterpret_cast<const uint8_t*>(p)[i];
    case DataType::kInt16: return reinterpret_cast<const int16_t*>(p)[i];
    case DataType::kInt32: return reinterpret_cast<const int32_t*>(p)[i];
    case DataType::kInt64: return reinterpret_cast<const int64_t*>(p)[i];
    case DataType::kUInt16: return reinterpret_cast<const uint16_t*>(p)[i];
    case DataType::kUInt32: return reinterpret_cast<const uint32_t*>(p)[i];
    case DataType::kUInt64: return static_cast<int64_t>(reinterpret_cast<const uint64_t*>(p)[i]);  // the bits
    default: return 0;
  }
}
// Wraps v to the width of dt, as two's complement arithmetic in that type would.
int64_t wrap(DataType dt, int64_t v) {
  switch (dt) {
    case DataType::kInt8: return static_cast<int8_t>(v);
    case DataType::kUInt8: return static_cast<uint8_t>(v);
    case DataType::kInt16: return static_cast<int16_t>(v);
    case DataType::kInt32: return static_cast<int32_t>(v);
    case DataType::kUInt16: return static_cast<uint16_t>(v);
    case DataType::kUInt32: return static_cast<uint32_t>(v);
    default: return v;
  }
}

// Comparison of two loadAsInt values: uint64's hold its bits, compared unsigned.
bool lessThan(DataType dt, int64_t a, int64_t b) {
  return dt == DataType::kUInt64 ? static_cast<uint64_t>(a) < static_cast<uint64_t>(b) : a < b;
}

void fill(DataType dt, uint8_t* p, size_t n, std::mt19937& rng, ReduceOp op) {
  // Floats get small integers (sums and products stay exact); PRODUCT gets {-1, 1, 2}.
  std::uniform_int_distribution<int> small(-4, 4), prod(0, 2), any(-128, 127), bit(0, 1);
  for (size_t i = 0; i < n; ++i) {
    int v = op == ReduceOp::kProduct ? (int[]){-1, 1, 2}[prod(rng)] : small(rng);
    switch (dt) {
      case DataType::kFloat32: reinterpret_cast<float*>(p)[i] = v; break;
      case DataType::kFloat64: reinterpret_cast<double*>(p)[i] = v; break;
      case DataType::kFloat16:
        reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(smallPattern(kHalfFmt, v));
        break;
      case DataType::kBFloat16: {
        float f = static_cast<float>(v);
        uint32_t u;
        std::memcpy(&u, &f, 4);
        reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(u >> 16);
        break;
      }
      case DataType::kInt8: reinterpret_cast<int8_t*>(p)[i] = static_cast<int8_t>(any(rng)); break;
      case DataType::kUInt8: reinterpret_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(any(rng)); break;
      case DataType::kInt16: reinterpret_cast<int16_t*>(p)[i] = static_cast<int16_t>(any(rng) * 300); break;
      case DataType::kInt32: reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(any(rng) * int64_t{20000000}); break;
      case DataType::kInt64: reinterpret_cast<int64_t*>(p)[i] = static_cast<int64_t>(any(rng)) << 56; break;
      case DataType::kBool: reinterpret_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(bit(rng)); break;
      // Unsigned: values near the top of the range too (sums wrap, and uint64 has its high bit set).
      case DataType::kUInt16: reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(any(rng) * 300); break;
      case DataType::kUInt32: reinterpret_cast<uint32_t*>(p)[i] = static_cast<uint32_t>(any(rng) * int64_t{20000000}); break;
      case DataType::kUInt64: reinterpret_cast<uint64_t*>(p)[i] = static_cast<uint64_t>(any(rng)) << 56; break;
      // float8: -1, 0, 1 (sums of up to 8 sources stay exact) or the products' -1, 1, 2.
      case DataType::kFloat8E4M3:
      case DataType::kFloat8E5M2: {
        const int w = op == ReduceOp::kProduct ? v : v / 3;  // small's -4..4 to -1..1
        p[i] = static_cast<uint8_t>(smallPattern(formatOf(dt), w));
        break;
      }
    }
  }
}

bool checkOne(Isa isa, DataType dt, ReduceOp op, int nsrc, size_t count, std::mt19937& rng) {
  const size_t es = elementSize(dt);
  std::vector<std::vector<uint8_t>> src(nsrc, std::vector<uint8_t>(count * es + 1));
  std::vector<const void*> ptrs;
  for (auto& s : src) {
    fill(dt, s.data(), count, rng, op);
    ptrs.push_back(s.data());
  }
  std::vector<uint8_t> out(count * es + 1, 0xAB);
  Reduction r{op, 0.5, nsrc};
  reduceWithIsa(isa, dt, r, out.data(), ptrs.data(), nsrc, count);
  if (out[count * es] != 0xAB) {
    printf("FAIL %s %s %s n=%d count=%zu: wrote past the end\n", isaName(isa), dataTypeName(dt), reduceOpName(op),
           nsrc, count);
    return false;
  }
  for (size_t i = 0; i < count; ++i) {
    bool ok;
    double got = 0, want = 0;
    if (isFloatingPoint(dt)) {
      double acc = loadAsDouble(dt, src[0].data(), i);
      for (int s = 1; s < nsrc; ++s) {
        double v = loadAsDouble(dt, src[s].data(), i);
        switch (op) {
          case ReduceOp::kProduct: acc *= v; break;
          case ReduceOp::kMin: acc = std::min(acc, v); break;
          case ReduceOp::kMax: acc = std::max(acc, v); break;
          default: acc += v;
        }
      }
      if (op == ReduceOp::kAvg) acc /= nsrc;
      if (op == ReduceOp::kPremulSum) acc *= 0.5;
      want = acc;
      got = loadAsDouble(dt, out.data(), i);
      const double rel = dt == DataType::kFloat8E4M3 || dt == DataType::kFloat8E5M2 ? 0.125
                         : dt == DataType::kFloat16 || dt == DataType::kBFloat16 ? 1e-2 : 1e-6;
      double tol = op == ReduceOp::kAvg ? std::fabs(want) * rel : 0;
      ok = std::fabs(got - want) <= tol;
    } else {
      const bool isBool = dt == DataType::kBool;
      int64_t acc = loadAsInt(dt, src[0].data(), i);
      for (int s = 1; s < nsrc; ++s) {
        int64_t v = loadAsInt(dt, src[s].data(), i);
        switch (op) {
          case ReduceOp::kSum:
          case ReduceOp::kAvg: acc = isBool ? (acc | v) : wrap(dt, static_cast<int64_t>(static_cast<uint64_t>(acc) + static_cast<uint64_t>(v))); break;
          case ReduceOp::kProduct: acc = isBool ? (acc & v) : wrap(dt, static_cast<int64_t>(static_cast<uint64_t>(acc) * static_cast<uint64_t>(v))); break;
          case ReduceOp::kMin: acc = lessThan(dt, v, acc) ? v : acc; break;
          case ReduceOp::kMax: acc = lessThan(dt, acc, v) ? v : acc; break;
          case ReduceOp::kBand: acc &= v; break;
          case ReduceOp::kBor: acc |= v; break;
          case ReduceOp::kBxor: acc = wrap(dt, acc ^ v); break;
          default: break;
        }
      }
      if (op == ReduceOp::kAvg) {  // truncates toward zero; uint64's sum is unsigned
        acc = dt == DataType::kUInt64 ? static_cast<int64_t>(static_cast<uint64_t>(acc) / static_cast<uint64_t>(nsrc))
                                      : acc / nsrc;
      }
      want = static_cast<double>(acc);
      got = static_cast<double>(loadAsInt(dt, out.data(), i));
      ok = loadAsInt(dt, out.data(), i) == acc;
    }
    if (!ok) {
      printf("FAIL %s %s %s n=%d count=%zu: element %zu is %g, want %g\n", isaName(isa), dataTypeName(dt),
             reduceOpName(op), nsrc, count, i, got, want);
      return false;
    }
  }
  return true;
}

void checkNanPropagates(Isa isa) {
  for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
    for (int where = 0; where < 2; ++where) {
      std::vector<float> a(100, 1.0f), b(100, 2.0f);
      (where == 0 ? a : b)[70] = NAN;
      const void* ptrs[2] = {a.data(), b.data()};
      std::vector<float> out(100);
      reduceWithIsa(isa, DataType::kFloat32, Reduction{op}, out.data(), ptrs, 2, 100);
      bool ok = std::isnan(out[70]) && out[3] == (op == ReduceOp::kMin ? 1.0f : 2.0f);
      (ok ? passed : failed)++;
      if (!ok) printf("FAIL %s float32 %s: NaN in source %d did not propagate\n", isaName(isa), reduceOpName(op), where);
    }
  }
}

// bool bytes other than 0 and 1 (a bool tensor viewed from integers) are true, as torch reads
// them, and every result is 0 or 1: bitwise AND of 2 and 1 gave false for PRODUCT/MIN/BAND.
void checkBoolBytesAreTruthValues(Isa isa) {
  const uint8_t bytes[] = {0, 1, 2, 255};
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kBor, ReduceOp::kProduct, ReduceOp::kMin,
                      ReduceOp::kBand, ReduceOp::kBxor}) {
    for (int n = 1; n <= 3; ++n) {
      // Every combination of the four bytes over n sources, each at its own element; 70 copies
      // so that the 64-element blocks and the tail both see them.
      size_t combos = 1;
      for (int s = 0; s < n; ++s) combos *= 4;
      const size_t count = combos * 70;
      std::vector<std::vector<uint8_t>> src(n, std::vector<uint8_t>(count));
      for (size_t i = 0; i < count; ++i) {
        size_t c = i % combos;
        for (int s = 0; s < n; ++s, c /= 4) src[s][i] = bytes[c % 4];
      }
      std::vector<const void*> ptrs;
      for (auto& v : src) ptrs.push_back(v.data());
      std::vector<uint8_t> out(count, 7);
      reduceWithIsa(isa, DataType::kBool, Reduction{op}, out.data(), ptrs.data(), n, count);
      bool ok = true;
      for (size_t i = 0; i < count && ok; ++i) {
        int any = 0, all = 1, parity = 0;
        for (int s = 0; s < n; ++s) {
          const int t = src[s][i] != 0;
          any |= t;
          all &= t;
          parity ^= t;
        }
        const bool isAnd = op == ReduceOp::kProduct || op == ReduceOp::kMin || op == ReduceOp::kBand;
        const int want = op == ReduceOp::kBxor ? parity : isAnd ? all : any;
        ok = out[i] == want;
        if (!ok) {
          printf("FAIL %s bool %s n=%d: element %zu is byte %d, want %d\n", isaName(isa), reduceOpName(op), n, i,
                 out[i], want);
        }
      }
      (ok ? passed : failed)++;
    }
  }
}

// 16-bit float conversions: every bit pattern (inf, NaN, subnormals included) must round-trip
// through float exactly (NaN as some NaN), identically on every instruction set.
void checkHalfRoundTrip(Isa isa) {
  for (DataType dt : {DataType::kFloat16, DataType::kBFloat16}) {
    std::vector<uint16_t> in(65536), out(65536);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint16_t>(i);
    const void* src = in.data();
    reduceWithIsa(isa, dt, Reduction{ReduceOp::kMax}, out.data(), &src, 1, in.size());
    size_t bad = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      const bool nan = dt == DataType::kFloat16 ? ((i & 0x7c00) == 0x7c00 && (i & 0x3ff))
                                                : ((i & 0x7f80) == 0x7f80 && (i & 0x7f));
      const bool outNan = dt == DataType::kFloat16 ? ((out[i] & 0x7c00) == 0x7c00 && (out[i] & 0x3ff))
                                                   : ((out[i] & 0x7f80) == 0x7f80 && (out[i] & 0x7f));
      if (nan ? !outNan : out[i] != in[i]) {
        if (bad++ < 3) printf("FAIL %s %s round trip of 0x%04zx gave 0x%04x\n", isaName(isa), dataTypeName(dt), i, out[i]);
      }
    }
    (bad == 0 ? passed : failed)++;
  }
}

// float8: every pattern must come back through float unchanged (NaN as some NaN), on every
// instruction set; and rounding must be to nearest even: the AVG of two neighbouring finite
// patterns is their exact midpoint, which must land on the even one.
void checkFloat8(Isa isa) {
  for (DataType dt : {DataType::kFloat8E4M3, DataType::kFloat8E5M2}) {
    std::vector<uint8_t> in(256), out(256);
    for (int i = 0; i < 256; ++i) in[i] = static_cast<uint8_t>(i);
    const void* src = in.data();
    reduceWithIsa(isa, dt, Reduction{ReduceOp::kMax}, out.data(), &src, 1, in.size());
    size_t bad = 0;
    for (int i = 0; i < 256; ++i) {
      const double v = float8Value(dt, static_cast<uint8_t>(i));
      const bool ok = std::isnan(v) ? std::isnan(float8Value(dt, out[i])) : out[i] == in[i];
      if (!ok && bad++ < 3) printf("FAIL %s %s round trip of 0x%02x gave 0x%02x\n", isaName(isa), dataTypeName(dt), i, out[i]);
    }
    std::vector<uint8_t> lo, hi;
    for (int b = 0; b < 0x7f; ++b) {
      if (!std::isfinite(float8Value(dt, static_cast<uint8_t>(b + 1)))) continue;
      for (int sign : {0, 0x80}) {
        lo.push_back(static_cast<uint8_t>(b | sign));
        hi.push_back(static_cast<uint8_t>((b + 1) | sign));
      }
    }
    const void* pair[2] = {lo.data(), hi.data()};
    std::vector<uint8_t> mid(lo.size());
    reduceWithIsa(isa, dt, Reduction{ReduceOp::kAvg, 1.0, 2}, mid.data(), pair, 2, lo.size());
    for (size_t i = 0; i < lo.size(); ++i) {
      const uint8_t even = (lo[i] & 1) ? hi[i] : lo[i];
      if (mid[i] != even && bad++ < 6) {
        printf("FAIL %s %s midpoint of 0x%02x and 0x%02x gave 0x%02x, not 0x%02x\n", isaName(isa), dataTypeName(dt),
               lo[i], hi[i], mid[i], even);
      }
    }
    (bad == 0 ? passed : failed)++;
  }
}

// 16-bit float rounding (float16: the generic conversion on the scalar kernels, F16C elsewhere;
// bfloat16: the kernels' own): the AVG of two neighbouring finite values is their exact midpoint,
// a tie, which must land on the even one. Sums of small integers, what the other tests add, never
// tie (a bfloat16 store rounding ties up passed them all: found by mutation testing).
void checkHalfRounding(Isa isa, DataType dt) {
  // float16's largest finite value (0x7bff), whose neighbour is inf; for bfloat16 the values below
  // 2^127, whose sum float32 still holds (the AVG adds, then scales).
  const uint32_t top = dt == DataType::kFloat16 ? 0x7bffu : 0x7f00u;
  std::vector<uint16_t> lo, hi;
  for (uint32_t b = 0; b < top; ++b) {
    for (uint32_t sign : {0u, 0x8000u}) {
      lo.push_back(static_cast<uint16_t>(b | sign));
      hi.push_back(static_cast<uint16_t>((b + 1) | sign));
    }
  }
  lo.push_back(1);  // an odd count: the vector kernels' scalar tail rounds some too
  hi.push_back(2);
  const void* pair[2] = {lo.data(), hi.data()};
  std::vector<uint16_t> mid(lo.size());
  reduceWithIsa(isa, dt, Reduction{ReduceOp::kAvg, 1.0, 2}, mid.data(), pair, 2, lo.size());
  size_t bad = 0;
  for (size_t i = 0; i < lo.size(); ++i) {
    const uint16_t even = (lo[i] & 1) ? hi[i] : lo[i];
    if (mid[i] != even && bad++ < 3) {
      printf("FAIL %s %s midpoint of 0x%04x and 0x%04x gave 0x%04x, not 0x%04x\n", isaName(isa), dataTypeName(dt),
             lo[i], hi[i], mid[i], even);
    }
  }
  (bad == 0 ? passed : failed)++;
}

// The streaming copy: every head/tail alignment of source and destination, sizes around its
// 4 KiB and 128-byte thresholds, and no byte written outside [dst, dst + n).
void checkStreamingCopy() {
  std::vector<uint8_t> src(20000), dst(20100);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  size_t bad = 0;
  for (size_t n : {0, 1, 100, 4095, 4096, 4097, 4223, 8191, 19000}) {
    for (size_t so = 0; so < 40; so += 13) {
      for (size_t d0 = 0; d0 < 40; d0 += 7) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        copyOut(dst.data() + 50 + d0, src.data() + so, n, true);
        bool ok = std::memcmp(dst.data() + 50 + d0, src.data() + so, n) == 0;
        for (size_t i = 0; i < dst.size(); ++i) {
          if ((i < 50 + d0 || i >= 50 + d0 + n) && dst[i] != 0xEE) ok = false;
        }
        if (!ok && bad++ < 3) printf("FAIL streaming copy n=%zu src+%zu dst+%zu\n", n, so, d0);
      }
    }
  }
  (bad == 0 ? passed : failed)++;
}

// copyStrided against an element-by-element reference: random boxes of 1-5 sides (some of size
// 1 or 0, large enough to be cut into pieces), each side's stride in src and in dst from its own
// random order of the sides, some sides strided with gaps, every element size; dst's gaps and
// the bytes around it must stay untouched.
void checkStridedCopy(std::mt19937& rng) {
  size_t bad = 0, cases = 0;
  for (size_t es : {1, 2, 4, 8, 16}) {
    for (int trial = 0; trial < 60; ++trial) {
      const int dims = 1 + static_cast<int>(rng() % 5);
      std::vector<int64_t> sizes(dims);
      for (int64_t& n : sizes) n = rng() % 9 == 0 ? static_cast<int64_t>(rng() % 2) : 1 + static_cast<int64_t>(rng() % 40);
      if (trial % 10 == 0) sizes[rng() % dims] = 300;  // big enough to be halved more than once
      // At most 2^16 elements, for the element-by-element reference's sake.
      for (int64_t total = 1 << 17; total > (1 << 16);) {
        total = 1;
        for (int64_t n : sizes) total *= n;
        if (total > (1 << 16)) *std::max_element(sizes.begin(), sizes.end()) /= 2;
      }
      // Strides: the sides in a random order, each with an optional gap (as a slice t[:, ::2]).
      auto layout = [&](std::vector<int64_t>& strides) {
        std::vector<int> order(dims);
        for (int k = 0; k < dims; ++k) order[k] = k;
        std::shuffle(order.begin(), order.end(), rng);
        int64_t next = 1;
        strides.assign(dims, 0);
        for (int k = dims - 1; k >= 0; --k) {
          strides[order[k]] = next * (rng() % 4 == 0 ? 2 : 1);
          next = strides[order[k]] * std::max<int64_t>(sizes[order[k]], 1);
        }
        return next;  // elements spanned
      };
      std::vector<int64_t> ds, ss;
      const int64_t dstSpan = layout(ds), srcSpan = layout(ss);
      std::vector<uint8_t> src(static_cast<size_t>(srcSpan) * es), dst(static_cast<size_t>(dstSpan) * es + 64, 0xEE),
          want(dst);
      for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
      // Reference: every index in turn.
      int64_t total = 1;
      for (int64_t n : sizes) total *= n;
      std::vector<int64_t> idx(dims, 0);
      for (int64_t e = 0; e < total; ++e) {
        int64_t so = 0, dO = 0, rest = e;
        for (int k = dims - 1; k >= 0; --k) {
          idx[k] = rest % sizes[k];
          rest /= sizes[k];
          so += idx[k] * ss[k];
          dO += idx[k] * ds[k];
        }
        std::memcpy(want.data() + 32 + dO * es, src.data() + so * es, es);
      }
      const bool took = copyStrided(dst.data() + 32, ds.data(), src.data(), ss.data(), sizes.data(), dims, es);
      ++cases;
      if (!took || dst != want) {
        if (bad++ < 3) printf("FAIL strided copy: element size %zu, %d sides, %s\n", es, dims, took ? "wrong bytes" : "refused");
      }
    }
  }
  // Element sizes it does not copy are refused, not copied wrong.
  int64_t one = 1;
  uint8_t a[3] = {1, 2, 3}, b[3] = {0, 0, 0};
  if (copyStrided(b, &one, a, &one, &one, 1, 3) || b[0] != 0) {
    printf("FAIL strided copy: a 3-byte element was not refused\n");
    ++bad;
  }
  (bad == 0 && cases == 300 ? passed : failed)++;
}

}  // namespace

// float16 NaNs: every instruction set, and a block's elements and its tail's alike, give the same
// bits (F16C's: the payload's top kept, quieted), so ranks on hosts with different CPUs, or an
// element's place in the message, never change a result's bits.
void checkHalfNanBitsAgree() {
  const size_t n = 65536 + 37;  // every pattern, then a tail of NaNs
  std::vector<uint16_t> in(n), ones(n, 0x3c00);
  for (size_t i = 0; i < n; ++i) in[i] = static_cast<uint16_t>(i < 65536 ? i : 0x7c01 + 97 * (i - 65536));
  std::vector<uint16_t> first;
  Isa firstIsa = Isa::kScalar;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!isaSupported(isa)) continue;
    std::vector<uint16_t> out(2 * n);
    const void* one = in.data();
    const void* two[2] = {in.data(), ones.data()};
    reduceWithIsa(isa, DataType::kFloat16, Reduction{ReduceOp::kMax}, out.data(), &one, 1, n);
    reduceWithIsa(isa, DataType::kFloat16, Reduction{ReduceOp::kSum}, out.data() + n, two, 2, n);
    if (first.empty()) {
      first = out;
      firstIsa = isa;
      continue;
    }
    size_t bad = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i] != first[i] && bad++ < 3) {
        printf("FAIL float16 %s of 0x%04x: %s gives 0x%04x, %s 0x%04x\n", i < n ? "max" : "sum with 1.0",
               in[i % n], isaName(isa), out[i], isaName(firstIsa), first[i]);
      }
    }
    (bad == 0 ? passed : failed)++;
  }
  size_t bad = 0;  // and every NaN keeps its payload's top, quieted
  for (size_t i = 0; i < n; ++i) {
    const uint16_t x = in[i];
    if ((x & 0x7c00) == 0x7c00 && (x & 0x3ff) && first[i] != (x | 0x0200) && bad++ < 3) {
      printf("FAIL float16 max of NaN 0x%04x gave 0x%04x on %s, not 0x%04x\n", x, first[i], isaName(firstIsa),
             x | 0x0200);
    }
  }
  (bad == 0 ? passed : failed)++;
}

// Two NaNs meeting (a NaN on two ranks, of other signs or payloads): the first source's wins, as
// its NaN alone would come out (quieted), on every instruction set and in a block as in its tail.
// x86 returns an add's first operand where both are NaN, and the compiler may swap the operands
// of a + b per loop and instruction set: hosts reducing one segment each for itself (the
// one-shot all_reduce across hosts) gave different bits (float8 SUM: 0x7f on AVX-512, 0xff on
// AVX2, until 2026-12-06).
// A quiet NaN of `dt` with the sign and payload given (the payload's low bits).
uint64_t nanBits(DataType dt, uint64_t sign, uint64_t payload) {
  switch (dt) {
    case DataType::kFloat32: return sign << 31 | 0x7fc00000u | (payload & 0x3fffff);
    case DataType::kFloat64: return sign << 63 | 0x7ff8000000000000ull | (payload & 0x7ffffffffffffull);
    case DataType::kFloat16: return sign << 15 | 0x7e00u | (payload & 0x1ff);
    case DataType::kBFloat16: return sign << 15 | 0x7fc0u | (payload & 0x3f);
    case DataType::kFloat8E5M2: return sign << 7 | 0x7eu | (payload & 1);
    default: return sign << 7 | 0x7fu;  // float8_e4m3fn has one NaN per sign
  }
}

void checkTwoNansAgree() {
  const size_t n = 64 + 37;  // a block and a tail
  for (DataType dt : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
                      DataType::kFloat8E4M3, DataType::kFloat8E5M2}) {
    const size_t es = elementSize(dt);
    std::vector<uint8_t> a(n * es), b(n * es);  // NaN everywhere in both, of other signs and payloads
    for (size_t i = 0; i < n; ++i) {
      const uint64_t x = nanBits(dt, i & 1, 0x2b5 * i + 7), y = nanBits(dt, ~i & 1, 0x1c3 * i + 2);
      std::memcpy(&a[i * es], &x, es);  // little-endian: the low bytes
      std::memcpy(&b[i * es], &y, es);
    }
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kAvg, ReduceOp::kPremulSum}) {
      std::vector<uint8_t> first;
      Isa firstIsa = Isa::kScalar;
      size_t bad = 0;
      for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
        if (!isaSupported(isa)) continue;
        std::vector<uint8_t> out(n * es), alone(n * es);
        const void* two[2] = {a.data(), b.data()};
        const void* one = a.data();
        reduceWithIsa(isa, dt, Reduction{op, 0.5, 2}, out.data(), two, 2, n);
        reduceWithIsa(isa, dt, Reduction{ReduceOp::kMax}, alone.data(), &one, 1, n);
        for (size_t i = 0; i < n && bad < 3; ++i) {
          if (std::memcmp(&out[i * es], &alone[i * es], es) != 0 ||
              (!first.empty() && std::memcmp(&out[i * es], &first[i * es], es) != 0)) {
            printf("FAIL %s %s %s of two NaNs, element %zu: not the first source's NaN, or not %s's\n", isaName(isa),
                   dataTypeName(dt), reduceOpName(op), i, isaName(firstIsa));
            ++bad;
          }
        }
        if (first.empty()) {
          first = out;
          firstIsa = isa;
        }
      }
      (bad == 0 ? passed : failed)++;
    }
  }
}

// Integer AVG divides by a multiplication (InvariantDivisor): compared with the compiler's
// division for every int8/uint8 value, and for each type's edge values (0, +-1, powers of two and
// their neighbours, min, max) plus random ones, by divisors from 1 up to 2^31 - 1 (AVG's divisor is
// the group size, an int).
void checkIntAvgDivision(Isa isa, std::mt19937_64& rng) {
  std::vector<int> divisors;
  for (int d = 1; d <= 300; ++d) divisors.push_back(d);
  for (int b = 9; b < 31; ++b) {
    for (int d : {(1 << b) - 1, 1 << b, (1 << b) + 1}) divisors.push_back(d);
  }
  divisors.push_back(2147483647);
  for (int k = 0; k < 40; ++k) divisors.push_back(1 + static_cast<int>(rng() % 2147483647u));
  for (DataType dt : {DataType::kInt8, DataType::kUInt8, DataType::kInt16, DataType::kUInt16, DataType::kInt32,
                      DataType::kUInt32, DataType::kInt64, DataType::kUInt64}) {
    const size_t es = elementSize(dt);
    const bool isSigned = dt == DataType::kInt8 || dt == DataType::kInt16 || dt == DataType::kInt32 ||
                          dt == DataType::kInt64;
    std::vector<uint64_t> values;  // bit patterns, truncated to the element's width below
    if (es == 1) {
      for (uint64_t v = 0; v < 256; ++v) values.push_back(v);
    } else {
      for (int b = 0; b < 64; ++b) {
        for (uint64_t v : {uint64_t{1} << b, (uint64_t{1} << b) - 1, (uint64_t{1} << b) + 1}) {
          values.push_back(v);
          values.push_back(0 - v);
        }
      }
      for (int k = 0; k < 500; ++k) values.push_back(rng());
    }
    std::vector<uint8_t> in(values.size() * es), out(values.size() * es);
    for (size_t i = 0; i < values.size(); ++i) std::memcpy(in.data() + i * es, &values[i], es);  // little-endian
    const void* src = in.data();
    size_t bad = 0;
    for (int d : divisors) {
      reduceWithIsa(isa, dt, Reduction{ReduceOp::kAvg, 1.0, d}, out.data(), &src, 1, values.size());
      for (size_t i = 0; i < values.size(); ++i) {
        const int64_t x = loadAsInt(dt, in.data(), i);
        const int64_t want = isSigned || dt != DataType::kUInt64
                                 ? x / d
                                 : static_cast<int64_t>(static_cast<uint64_t>(x) / static_cast<uint64_t>(d));
        const int64_t got = loadAsInt(dt, out.data(), i);
        if (got != want && bad++ < 3) {
          printf("FAIL %s %s avg of %lld by %d gave %lld, want %lld\n", isaName(isa), dataTypeName(dt),
                 static_cast<long long>(x), d, static_cast<long long>(got), static_cast<long long>(want));
        }
      }
    }
    (bad == 0 ? passed : failed)++;
  }
}

// Flush-to-zero and denormals-are-zero set on the calling thread (torch.set_flush_denormal(True)
// does) must not change a result: a blocking op reduces on the caller's thread, an async one on
// the progress thread, and ranks would disagree. The thread's mode is back as it was afterwards.
void checkFlushToZeroIgnored() {
#if defined(__x86_64__)
  const unsigned original = _mm_getcsr();
  const unsigned flushing = original | 0x8040u;  // FTZ | DAZ
  auto mode = [] { return _mm_getcsr(); };
  auto set = [](unsigned m) { _mm_setcsr(m); };
#elif defined(__aarch64__)
  uint64_t original;
  asm volatile("mrs %0, fpcr" : "=r"(original));
  const uint64_t flushing = original | (1ull << 24);  // FZ
  auto mode = [] {
    uint64_t m;
    asm volatile("mrs %0, fpcr" : "=r"(m));
    return m;
  };
  auto set = [](uint64_t m) { asm volatile("msr fpcr, %0" : : "r"(m)); };
#else
  printf("SKIP flush-to-zero: no mode control on this architecture\n");
  return;
#endif
  const uint32_t tiny = 0x000b1c00u;  // a float32 subnormal, ~1.02e-39
  std::vector<uint32_t> a(100, tiny), b(100, tiny), out(100);
  const void* srcs[2] = {a.data(), b.data()};
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!isaSupported(isa)) continue;
    set(flushing);
    reduceWithIsa(isa, DataType::kFloat32, Reduction{ReduceOp::kSum}, out.data(), srcs, 2, out.size());
    const auto after = mode();
    set(original);
    const bool kept = std::all_of(out.begin(), out.end(), [](uint32_t v) { return v == 2 * 0x000b1c00u; });
    if (!kept) printf("FAIL %s float32 sum of subnormals under flush-to-zero gave 0x%08x\n", isaName(isa), out[0]);
    if (after != flushing) printf("FAIL %s: the caller's floating-point mode was not restored\n", isaName(isa));
    (kept && after == flushing ? passed : failed)++;
  }
}

namespace smddp {
void checkPerfDataCheck(int& passed, int& failed);  // test_perf_check.cc
}

int main() {
  std::mt19937 rng(12345);
  std::mt19937_64 rng64(12345);
  const size_t counts[] = {0, 1, 5, 63, 64, 65, 1000, 4099};
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!isaSupported(isa)) {
      printf("SKIP %s: not supported by this CPU\n", isaName(isa));
      continue;
    }
    for (int d = 0; d < kNumDataTypes; ++d) {
      for (int o = 0; o < kNumReduceOps; ++o) {
        const DataType dt = static_cast<DataType>(d);
        const ReduceOp op = static_cast<ReduceOp>(o);
        if (unsupportedReason(dt, op) != nullptr) continue;
        for (int nsrc : {1, 2, 3, 8}) {
          bool ok = true;
          for (size_t c : counts) ok = ok && checkOne(isa, dt, op, nsrc, c, rng);
          (ok ? passed : failed)++;
        }
      }
    }
    checkNanPropagates(isa);
    checkBoolBytesAreTruthValues(isa);
    checkHalfRoundTrip(isa);
    checkFloat8(isa);
    checkHalfRounding(isa, DataType::kFloat16);
    checkHalfRounding(isa, DataType::kBFloat16);
    checkIntAvgDivision(isa, rng64);
  }
  checkHalfNanBitsAgree();
  checkTwoNansAgree();
  checkFlushToZeroIgnored();
  checkStreamingCopy();
  checkStridedCopy(rng);
  smddp::checkPerfDataCheck(passed, failed);
  printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
