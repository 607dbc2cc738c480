#include "core/copy.h"

#include <unistd.h>
#ifdef SMDDP_X86_KERNELS
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "core/env.h"
#include "core/reduce.h"

namespace smddp {
namespace {

// The last-level cache this CPU shares, from sysfs: glibc's sysconf(_SC_LEVEL3_CACHE_SIZE) reports
// the whole socket's L3 on some VMs and AMD parts (384 MiB where a core sees 32 MiB), which
// would keep streaming stores off exactly where they help.
size_t lastLevelCacheBytes() {
  for (const char* index : {"index3", "index2"}) {
    std::string path = std::string("/sys/devices/system/cpu/cpu0/cache/") + index + "/size";
    std::ifstream f(path);
    size_t kib = 0;
    char unit = 0;
    if (f >> kib >> unit && kib > 0 && (unit == 'K' || unit == 'k')) return kib << 10;
  }
  long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? static_cast<size_t>(l3) : size_t{32} << 20;
}

size_t thresholdOr(int64_t v) { return v >= 0 ? static_cast<size_t>(v) : lastLevelCacheBytes(); }

size_t streamThreshold() {
  static const size_t t = thresholdOr(env::streamMinBytes());
  return t;
}

size_t stageStreamThreshold() {
  static const size_t t = thresholdOr(env::stageStreamMinBytes());
  return t;
}

#ifdef SMDDP_X86_KERNELS
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
#endif

}  // namespace

bool shouldStream(size_t outputBytes, int ranksOnHost) {
  return outputBytes * static_cast<size_t>(ranksOnHost) >= streamThreshold();
}

bool isLargeStaging(size_t bytesPerRank, int ranksOnHost) {
  return bytesPerRank * static_cast<size_t>(ranksOnHost) >= stageStreamThreshold();
}

void copyOut(void* dst, const void* src, size_t n, bool stream) {
#ifdef SMDDP_X86_KERNELS
  static const bool avx2 = isaSupported(Isa::kAvx2);
  if (stream && avx2 && n >= 4096) {
    copyStreamAvx2(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
    return;
  }
#endif
  std::memcpy(dst, src, n);  // elsewhere: the C library's copy (no streaming-store variant here)
}

}  // namespace smddp
