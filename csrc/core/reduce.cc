#include "core/reduce.h"

#include <cstdint>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "core/env.h"
#include "core/error.h"
#include "core/log.h"

namespace smddp {
namespace {

Isa pickIsa() {
  const std::string& want = env::simd();
  Isa best = isaSupported(Isa::kAvx512) ? Isa::kAvx512 : isaSupported(Isa::kAvx2) ? Isa::kAvx2 : Isa::kScalar;
  Isa chosen = best;
  if (want == "scalar") chosen = Isa::kScalar;
  else if (want == "avx2") chosen = Isa::kAvx2;
  else if (want == "avx512") chosen = Isa::kAvx512;
  else if (want != "auto") SMDDP_WARN(kEnv, "SMDDP_SIMD=%s is not one of auto, avx512, avx2, scalar; using %s",
                                      want.c_str(), isaName(best));
  if (!isaSupported(chosen)) {
    SMDDP_WARN(kEnv, "SMDDP_SIMD=%s is not supported by this CPU; using %s", want.c_str(), isaName(best));
    chosen = best;
  }
  SMDDP_INFO(kInit, "reduce kernels: %s", isaName(chosen));
  return chosen;
}

kernels::ReduceFn lookup(Isa isa, DataType dtype, ReduceOp op) {
#ifdef SMDDP_X86_KERNELS
  switch (isa) {
    case Isa::kAvx512: return kernels::avx512::lookup(dtype, op);
    case Isa::kAvx2: return kernels::avx2::lookup(dtype, op);
    case Isa::kScalar: break;
  }
#endif
  return kernels::scalar::lookup(dtype, op);
}

}  // namespace

const char* isaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kScalar: return "scalar";
  }
  return "?";
}

bool isaSupported(Isa isa) {
  switch (isa) {
#ifdef SMDDP_X86_KERNELS
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    case Isa::kAvx512:
    case Isa::kAvx2: return false;  // not an x86 build
#endif
    case Isa::kScalar: return true;
  }
  return false;
}

Isa activeIsa() {
  static const Isa isa = pickIsa();
  return isa;
}

// IEEE arithmetic (subnormals kept, round to nearest) while a kernel runs, whatever the calling
// thread's floating-point mode: a blocking op reduces on the caller's thread, which may flush
// subnormals to zero (torch.set_flush_denormal(True) sets it there), and an async one on the
// progress thread, which does not; ranks would get different bits for the same op.
class IeeeArithmetic {
 public:
#if defined(__x86_64__) || defined(__i386__)
  // MXCSR: flush-to-zero (bit 15), denormals-are-zero (bit 6), rounding control (bits 13-14).
  static constexpr unsigned kModeBits = 0x8000u | 0x0040u | 0x6000u;
  IeeeArithmetic() : saved_(_mm_getcsr()) {
    if ((saved_ & kModeBits) != 0) _mm_setcsr(saved_ & ~kModeBits);
  }
  ~IeeeArithmetic() {
    if ((saved_ & kModeBits) != 0) _mm_setcsr(saved_);
  }

 private:
  unsigned saved_;
#elif defined(__aarch64__)
  // FPCR: flush-to-zero (bit 24), half-precision flush-to-zero (bit 19), rounding mode (bits 22-23).
  static constexpr uint64_t kModeBits = (1ull << 24) | (1ull << 19) | (3ull << 22);
  IeeeArithmetic() {
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    if ((saved_ & kModeBits) != 0) asm volatile("msr fpcr, %0" : : "r"(saved_ & ~kModeBits));
  }
  ~IeeeArithmetic() {
    if ((saved_ & kModeBits) != 0) asm volatile("msr fpcr, %0" : : "r"(saved_));
  }

 private:
  uint64_t saved_;
#endif
};

void reduceWithIsa(Isa isa, DataType dtype, const Reduction& r, void* dst, const void* const* srcs, int n,
                   size_t count) {
  kernels::ReduceFn fn = lookup(isa, dtype, r.op);
  if (fn == nullptr) {
    throwError(ErrorCode::kNotSupported, "smddp: reduce op %s is not supported on %s", reduceOpName(r.op),
               dataTypeName(dtype));
  }
  const IeeeArithmetic ieee;
  fn(dst, srcs, n, count, r);
}

void reduce(DataType dtype, const Reduction& r, void* dst, const void* const* srcs, int n, size_t count) {
  reduceWithIsa(activeIsa(), dtype, r, dst, srcs, n, count);
}

}  // namespace smddp
