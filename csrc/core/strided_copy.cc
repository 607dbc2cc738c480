#include "core/strided_copy.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace smddp {
namespace {

// A piece this small (in elements) fits in the first-level cache on both sides: at most 4096
// elements of up to 16 bytes, read and written once each. Measured on the 2048 x 2048 float32
// transpose: 256 elements 15 ms, 1024 12 ms, 4096 11 ms, 16384 11 ms.
constexpr int64_t kLeafElements = 4096;

struct Dim {
  int64_t size, dst, src;  // strides in elements
};

template <size_t N>
struct Element {
  unsigned char bytes[N];
};

template <class E>
void leaf(E* d, const E* s, const Dim* dims, int n) {
  const Dim& x = dims[0];
  if (n == 1) {
    if (x.dst == 1 && x.src == 1) {
      std::memcpy(d, s, static_cast<size_t>(x.size) * sizeof(E));
    } else {
      for (int64_t i = 0; i < x.size; ++i) d[i * x.dst] = s[i * x.src];
    }
    return;
  }
  for (int64_t i = 0; i < x.size; ++i) leaf(d + i * x.dst, s + i * x.src, dims + 1, n - 1);
}

template <class E>
void split(E* d, const E* s, Dim* dims, int n, int64_t elements) {
  if (elements <= kLeafElements) {
    leaf(d, s, dims, n);
    return;
  }
  // Halve the side that spans most memory in either tensor.
  int widest = 0;
  int64_t span = -1;
  for (int k = 0; k < n; ++k) {
    const int64_t v = dims[k].size > 1 ? dims[k].size * std::max(dims[k].dst, dims[k].src) : -1;
    if (v > span) {
      span = v;
      widest = k;
    }
  }
  Dim& w = dims[widest];
  const int64_t whole = w.size, half = whole / 2;
  w.size = half;
  split(d, s, dims, n, elements / whole * half);
  w.size = whole - half;
  split(d + half * w.dst, s + half * w.src, dims, n, elements / whole * (whole - half));
  w.size = whole;
}

template <class E>
void copyAs(void* dst, const void* src, std::vector<Dim>& dims, int64_t elements) {
  split(static_cast<E*>(dst), static_cast<const E*>(src), dims.data(), static_cast<int>(dims.size()), elements);
}

}  // namespace

bool copyStrided(void* dst, const int64_t* dstStrides, const void* src, const int64_t* srcStrides,
                 const int64_t* sizes, int dims, size_t elementSize) {
  if (elementSize != 1 && elementSize != 2 && elementSize != 4 && elementSize != 8 && elementSize != 16) return false;
  std::vector<Dim> ds;
  int64_t elements = 1;
  for (int k = 0; k < dims; ++k) {
    if (sizes[k] == 0) return true;
    elements *= sizes[k];
    if (sizes[k] > 1) ds.push_back({sizes[k], dstStrides[k], srcStrides[k]});
  }
  // In dst's order (its smallest stride innermost, so pieces are written in order), and sides
  // that follow each other in both tensors merged into one (longer inner runs, memcpy where both
  // are contiguous).
  std::stable_sort(ds.begin(), ds.end(), [](const Dim& a, const Dim& b) { return a.dst > b.dst; });
  std::vector<Dim> merged;
  for (const Dim& x : ds) {
    if (!merged.empty() && merged.back().dst == x.dst * x.size && merged.back().src == x.src * x.size) {
      merged.back() = {merged.back().size * x.size, x.dst, x.src};
    } else {
      merged.push_back(x);
    }
  }
  if (merged.empty()) merged.push_back({1, 1, 1});  // one element
  switch (elementSize) {
    case 1: copyAs<Element<1>>(dst, src, merged, elements); return true;
    case 2: copyAs<Element<2>>(dst, src, merged, elements); return true;
    case 4: copyAs<Element<4>>(dst, src, merged, elements); return true;
    case 8: copyAs<Element<8>>(dst, src, merged, elements); return true;
    case 16: copyAs<Element<16>>(dst, src, merged, elements); return true;
  }
  return false;
}

}  // namespace smddp
