// FNV-1a: a small, stable 64-bit hash for digests ranks compare (an op's description, a layout of
// per-rank counts). Not for adversarial input.
#pragma once

#include <cstddef>
#include <cstdint>

namespace smddp {

constexpr uint64_t kFnv1aBasis = 1469598103934665603ull;

// Folds `bytes` at `data` into the running hash `h` (start from kFnv1aBasis).
inline uint64_t fnv1a(uint64_t h, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace smddp
