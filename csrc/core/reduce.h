// Element-wise reductions over several source buffers, with the instruction set chosen at run
// time (AVX-512, AVX2 or baseline x86-64), so one portable binary is fast where the CPU allows.
// Builds for other architectures have the baseline kernels only (kScalar, which the compiler
// vectorises for the target: NEON on aarch64).
#pragma once

#include <cstddef>

#include "core/types.h"

namespace smddp {

enum class Isa { kScalar, kAvx2, kAvx512 };
const char* isaName(Isa isa);
// The instruction set in use: SMDDP_SIMD if set (and supported by this CPU), else the best one.
Isa activeIsa();
bool isaSupported(Isa isa);

// dst[i] = finalize(srcs[0][i] op srcs[1][i] op ... op srcs[n-1][i]) for i < count.
// Sources are combined in the order given, so ranks that reduce the same inputs in the same
// order get bit-identical results. 16- and 8-bit floats accumulate in float32 and round once,
// to nearest even as torch converts (float8_e4m3fn, which has no infinity, saturates at +-448).
// dst may be one of the sources, but must not partially overlap any.
// Preconditions (checked by callers): n >= 1 and unsupportedReason(dtype, r.op) == nullptr.
void reduce(DataType dtype, const Reduction& r, void* dst, const void* const* srcs, int n, size_t count);
void reduceWithIsa(Isa isa, DataType dtype, const Reduction& r, void* dst, const void* const* srcs, int n,
                   size_t count);

namespace kernels {
using ReduceFn = void (*)(void* dst, const void* const* srcs, int n, size_t count, const Reduction& r);
namespace scalar { ReduceFn lookup(DataType dtype, ReduceOp op); }
namespace avx2 { ReduceFn lookup(DataType dtype, ReduceOp op); }
namespace avx512 { ReduceFn lookup(DataType dtype, ReduceOp op); }
}  // namespace kernels

}  // namespace smddp
