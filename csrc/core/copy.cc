#include "core/copy.h"

#include <immintrin.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "core/reduce.h"

namespace smddp {
namespace {

size_t streamThreshold() {
  static const size_t t = [] {
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return l3 > 0 ? static_cast<size_t>(l3) / 2 : size_t{16} << 20;
  }();
  return t;
}

__attribute__((target("avx2"))) void copyStreamAvx2(uint8_t* dst, const uint8_t* src, size_t n) {
  // Align the destination to 32 bytes; the source may stay unaligned (loadu).
  size_t head = (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();  // streaming stores are weakly ordered: complete them before anything follows
}

}  // namespace

bool shouldStream(size_t totalBytes) { return totalBytes >= streamThreshold(); }

void copyOut(void* dst, const void* src, size_t n, bool stream) {
  static const bool avx2 = isaSupported(Isa::kAvx2);
  if (stream && avx2 && n >= 4096) {
    copyStreamAvx2(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
  } else {
    std::memcpy(dst, src, n);
  }
}

}  // namespace smddp
