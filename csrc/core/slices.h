// Cutting a count of elements into cache-line aligned slices (the algorithms' per-rank slices,
// the helper threads' parts), and byte-pointer arithmetic on untyped buffers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/types.h"

namespace smddp {

constexpr size_t kAlignBytes = 64;  // slice boundaries on cache lines: no false sharing, aligned SIMD

// Splits `count` elements into `parts` slices whose boundaries are multiples of `align` elements
// (trailing slices may be short or empty).
struct Slices {
  size_t per;
  size_t count;
  size_t begin(int p) const { return std::min(per * p, count); }
  size_t end(int p) const { return std::min(per * (p + 1), count); }
  size_t size(int p) const { return end(p) - begin(p); }
};
inline Slices slicesOf(size_t count, int parts, size_t align) {
  size_t per = (count + parts - 1) / parts;
  per = (per + align - 1) / align * align;
  return Slices{per, count};
}

// Elements of `dtype` per cache line (at least 1).
inline size_t alignElems(DataType dtype) { return std::max<size_t>(1, kAlignBytes / elementSize(dtype)); }

inline const uint8_t* bytes(const void* p) { return static_cast<const uint8_t*>(p); }
inline uint8_t* bytes(void* p) { return static_cast<uint8_t*>(p); }

}  // namespace smddp
