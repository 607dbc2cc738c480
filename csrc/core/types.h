// Element types and reduction operators understood by the core, independent of torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace smddp {

enum class DataType : uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt8,
  kUInt8,
  kInt16,
  kInt32,
  kInt64,
  kBool,
  kUInt16,
  kUInt32,
  kUInt64,
  kFloat8E4M3,  // float8_e4m3fn: no infinities, one NaN pattern per sign, largest finite 448
  kFloat8E5M2,  // float8_e5m2: IEEE-like (the top byte of a float16)
};
constexpr int kNumDataTypes = 15;

enum class ReduceOp : uint8_t {
  kSum,
  kAvg,
  kProduct,
  kMin,
  kMax,
  kBand,
  kBor,
  kBxor,
  kPremulSum,
};
constexpr int kNumReduceOps = 9;

size_t elementSize(DataType dtype);
const char* dataTypeName(DataType dtype);
const char* reduceOpName(ReduceOp op);

bool isFloatingPoint(DataType dtype);

// Returns nullptr when `op` is defined on `dtype`, otherwise why it is not (for error messages).
// The contract (see README "Reduction semantics"): bool SUM/MAX = OR, PRODUCT/MIN = AND;
// integer SUM/PRODUCT wrap around; integer AVG truncates toward zero; bitwise ops only on
// integers and bool; AVG and PREMUL_SUM not on bool; PREMUL_SUM only on floating point.
const char* unsupportedReason(DataType dtype, ReduceOp op);

enum class OpKind : uint32_t {
  kAllreduce = 1,
  kReduce,
  kBroadcast,
  kAllgather,
  kReduceScatter,
  kBarrier,
  kGather,
  kScatter,
  kAlltoall,
};
const char* opKindName(OpKind kind);

// The collective a rank runs, as the caller asked for it: every rank must run the same one at
// the same sequence number. Packed into one word, it goes into the shared-memory descriptors
// and every inter-host message header, so ranks running different collectives whose messages
// happen to have the same sizes (all_reduce and reduce, all_gather and gather) fail instead of
// combining each other's data: across hosts these run the same sub-steps, which match.
struct OpSignature {
  OpKind kind = OpKind::kBarrier;
  DataType dtype = DataType::kUInt8;
  ReduceOp redop = ReduceOp::kSum;  // kSum for ops that reduce nothing
  int root = -1;                    // -1 for ops without one (packed in 24 bits)
  // PREMUL_SUM: a 16-bit hash of the factor (factorTag()), so that ranks passing different
  // factors fail instead of each scaling the sum by its own; 0 otherwise.
  uint16_t factor = 0;
  // What every rank's sizes must agree on (shapeOf()), carried apart from packed() in each
  // inter-host message header: the messages of one collective between two hosts may have the
  // same sizes when the collectives do not (a streamed all_reduce of N elements and one of 2N
  // both send pieces of the chunk size), so the sizes alone catch no such mismatch. 0: not
  // compared (all_to_all, whose blocks' own sizes are checked; barrier).
  uint64_t shape = 0;

  uint64_t packed() const;  // never 0 (0: no signature, e.g. point-to-point); without `shape`
  static OpSignature unpack(uint64_t packed);
  // "reduce #7 (float32, max, root 3)"; "allreduce #2 (float16, premul_sum, factor #3f1c)"
  std::string describe(uint64_t seq) const;
  static uint16_t factorTag(double factor);
  // `shape` for an op whose ranks each have counts[p] elements (or, one count: all of them):
  // the count itself when they are equal, else a digest of them with the top bit set.
  static uint64_t shapeOf(const std::vector<size_t>& counts);
  static uint64_t shapeOf(size_t count) { return count; }
  // "65536 elements", "65536 elements per rank", "uneven per-rank sizes (digest #...)"
  std::string describeShape() const;
  // "collectives do not match across ranks: this rank runs allreduce #1 (float32, sum) on 4
  // elements, but rank 1 runs allreduce #2 (float32, sum) on 8 elements. Every rank must ...":
  // this rank's op `ours` and rank `peer`'s `theirs`, sizes included where the kind has them.
  static std::string mismatchText(const OpSignature& ours, uint64_t ourSeq, int peer, const OpSignature& theirs,
                                  uint64_t theirSeq);
};

// A reduction as the kernels see it: the operator plus the scalars its finalisation needs.
struct Reduction {
  ReduceOp op = ReduceOp::kSum;
  double premulFactor = 1.0;  // PREMUL_SUM: result = factor * sum
  int avgDivisor = 1;         // AVG: result = sum / avgDivisor (the group size)
};

}  // namespace smddp
