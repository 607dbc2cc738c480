// The per-thread work of the low-block-count kernels, written once for both compilers: nvcc
// builds it into the kernels (kernels.cu), g++ into a host harness that runs every block and
// thread index of small grids (tests/cpp/test_cuda_host.cc), so the index math, the tails, the
// vector alignment rules and the block cap are checked on machines without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define SMDDP_HD __host__ __device__ __forceinline__
#else
#define SMDDP_HD inline
#endif

namespace smddp::cuda::math {

constexpr int kThreadsPerBlock = 512;
constexpr size_t kVecBytes = 16;

struct alignas(16) Vec16 {
  uint32_t w[4];
};

// Blocks for `items` units of work: enough for one unit per thread, at most `maxBlocks` (>= 1).
SMDDP_HD unsigned blocksFor(size_t items, int maxBlocks) {
  const size_t want = (items + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const size_t cap = maxBlocks < 1 ? 1 : static_cast<size_t>(maxBlocks);
  return static_cast<unsigned>(want == 0 ? 1 : (want < cap ? want : cap));
}

SMDDP_HD bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & (kVecBytes - 1)) == 0; }

// ---- element conversions (bit-exact, the same on host and device) ---------------------------

SMDDP_HD float bitsToFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
SMDDP_HD uint32_t floatToBits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

SMDDP_HD float bf16ToFloat(uint16_t b) { return bitsToFloat(static_cast<uint32_t>(b) << 16); }

SMDDP_HD uint16_t floatToBf16(float f) {  // round to nearest even; NaN stays a quiet NaN
  const uint32_t u = floatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

SMDDP_HD float halfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return bitsToFloat(floatToBits(mag) | sign);
  }
  if (exp == 31) return bitsToFloat(sign | 0x7f800000u | (mant << 13));
  return bitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

SMDDP_HD uint16_t floatToHalf(float f) {  // round to nearest even
  uint32_t x = floatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (x < 0x38800000u) {                         // below 2^-14: a subnormal half (or zero)
    const uint32_t mant = (x & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(x >> 23);
    if (shift > 24) return sign;
    uint32_t r = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = (x >> 13) - (112u << 10);
  const uint32_t rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

// ---- element types as the kernels see them --------------------------------------------------

struct F32 {
  using Storage = float;
  SMDDP_HD static float load(Storage v) { return v; }
  SMDDP_HD static Storage store(float v) { return v; }
};
struct F16 {
  using Storage = uint16_t;
  SMDDP_HD static float load(Storage v) { return halfToFloat(v); }
  SMDDP_HD static Storage store(float v) { return floatToHalf(v); }
};
struct BF16 {
  using Storage = uint16_t;
  SMDDP_HD static float load(Storage v) { return bf16ToFloat(v); }
  SMDDP_HD static Storage store(float v) { return floatToBf16(v); }
};

// ---- per-thread work: thread `tid` of `nthreads` in the grid ----------------------------------

// Copies `bytes`: 16-byte vectors, grid-strided, when both ends are 16-byte aligned, then the
// tail bytes; byte by byte otherwise.
SMDDP_HD void copyWork(uint8_t* dst, const uint8_t* src, size_t bytes, size_t tid, size_t nthreads) {
  size_t head = 0;
  if (aligned16(dst) && aligned16(src)) {
    const size_t vecs = bytes / kVecBytes;
    Vec16* d = reinterpret_cast<Vec16*>(dst);
    const Vec16* s = reinterpret_cast<const Vec16*>(src);
    for (size_t i = tid; i < vecs; i += nthreads) d[i] = s[i];
    head = vecs * kVecBytes;
  }
  for (size_t i = head + tid; i < bytes; i += nthreads) dst[i] = src[i];
}

// Units of work copyWork spreads over threads (for the launch shape).
SMDDP_HD size_t copyItems(size_t bytes) { return (bytes + kVecBytes - 1) / kVecBytes; }

// dst[i] = sum of srcs[k][i], accumulated in float. With every pointer 16-byte aligned, each
// thread handles whole 16-byte vectors (4 floats or 8 halves); the tail and unaligned buffers go
// element by element. dst may be one of the sources.
template <class T>
SMDDP_HD void reduceSumWork(typename T::Storage* dst, const typename T::Storage* const* srcs, int nsrc, size_t count,
                            size_t tid, size_t nthreads) {
  using S = typename T::Storage;
  constexpr size_t kPer = kVecBytes / sizeof(S);
  bool vec = aligned16(dst);
  for (int k = 0; k < nsrc; ++k) vec = vec && aligned16(srcs[k]);
  size_t head = 0;
  if (vec) {
    const size_t vecs = count / kPer;
    for (size_t v = tid; v < vecs; v += nthreads) {
      float acc[kPer];
      for (size_t j = 0; j < kPer; ++j) acc[j] = 0.f;
      for (int k = 0; k < nsrc; ++k) {
        Vec16 raw = reinterpret_cast<const Vec16*>(srcs[k])[v];
        S e[kPer];
        memcpy(e, &raw, kVecBytes);
        for (size_t j = 0; j < kPer; ++j) acc[j] += T::load(e[j]);
      }
      S out[kPer];
      for (size_t j = 0; j < kPer; ++j) out[j] = T::store(acc[j]);
      Vec16 packed;
      memcpy(&packed, out, kVecBytes);
      reinterpret_cast<Vec16*>(dst)[v] = packed;
    }
    head = vecs * kPer;
  }
  for (size_t i = head + tid; i < count; i += nthreads) {
    float acc = 0.f;
    for (int k = 0; k < nsrc; ++k) acc += T::load(srcs[k][i]);
    dst[i] = T::store(acc);
  }
}

template <class T>
SMDDP_HD size_t reduceItems(size_t count) {
  constexpr size_t kPer = kVecBytes / sizeof(typename T::Storage);
  return (count + kPer - 1) / kPer;
}

}  // namespace smddp::cuda::math
