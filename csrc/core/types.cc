#include "core/types.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/hash.h"

namespace smddp {

size_t elementSize(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat64:
    case DataType::kInt64:
    case DataType::kUInt64:
      return 8;
    case DataType::kFloat32:
    case DataType::kInt32:
    case DataType::kUInt32:
      return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kInt16:
    case DataType::kUInt16:
      return 2;
    case DataType::kInt8:
    case DataType::kUInt8:
    case DataType::kBool:
    case DataType::kFloat8E4M3:
    case DataType::kFloat8E5M2:
      return 1;
  }
  return 0;
}

const char* dataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt16: return "int16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kBool: return "bool";
    case DataType::kUInt16: return "uint16";
    case DataType::kUInt32: return "uint32";
    case DataType::kUInt64: return "uint64";
    case DataType::kFloat8E4M3: return "float8_e4m3fn";
    case DataType::kFloat8E5M2: return "float8_e5m2";
  }
  return "?";
}

const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kProduct: return "prod";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kBand: return "band";
    case ReduceOp::kBor: return "bor";
    case ReduceOp::kBxor: return "bxor";
    case ReduceOp::kPremulSum: return "premul_sum";
  }
  return "?";
}

bool isFloatingPoint(DataType dtype) {
  return dtype == DataType::kFloat32 || dtype == DataType::kFloat64 || dtype == DataType::kFloat16 ||
         dtype == DataType::kBFloat16 || dtype == DataType::kFloat8E4M3 || dtype == DataType::kFloat8E5M2;
}

const char* unsupportedReason(DataType dtype, ReduceOp op) {
  const bool isFloat = isFloatingPoint(dtype);
  const bool isBool = dtype == DataType::kBool;
  switch (op) {
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      return isFloat ? "bitwise reductions are defined only on integer and bool tensors" : nullptr;
    case ReduceOp::kAvg:
      return isBool ? "AVG is not defined on bool tensors" : nullptr;
    case ReduceOp::kPremulSum:
      return isFloat ? nullptr : "PREMUL_SUM is defined only on floating-point tensors";
    default:
      return nullptr;
  }
}

const char* opKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kReduce: return "reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllgather: return "allgather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kAlltoall: return "alltoall";
  }
  return "?";
}

// Bits: kind 0-7, dtype 8-15, reduce op 16-23, factor 24-31 (low byte) and 56-63 (high byte),
// root + 1 32-55.
uint64_t OpSignature::packed() const {
  return static_cast<uint64_t>(kind) | static_cast<uint64_t>(dtype) << 8 | static_cast<uint64_t>(redop) << 16 |
         static_cast<uint64_t>(factor & 0xff) << 24 | (static_cast<uint64_t>(root + 1) & 0xffffff) << 32 |
         static_cast<uint64_t>(factor >> 8) << 56;
}

OpSignature OpSignature::unpack(uint64_t packed) {
  OpSignature s;
  s.kind = static_cast<OpKind>(packed & 0xff);
  s.dtype = static_cast<DataType>((packed >> 8) & 0xff);
  s.redop = static_cast<ReduceOp>((packed >> 16) & 0xff);
  s.factor = static_cast<uint16_t>(((packed >> 24) & 0xff) | ((packed >> 56) << 8));
  s.root = static_cast<int>(static_cast<int64_t>((packed >> 32) & 0xffffff) - 1);  // a header's bits may be anything
  return s;
}

uint16_t OpSignature::factorTag(double factor) {
  uint64_t bits;
  std::memcpy(&bits, &factor, sizeof(bits));
  bits *= 0x9e3779b97f4a7c15ull;  // every bit of the factor reaches the top 16
  return static_cast<uint16_t>(bits >> 48);
}

uint64_t OpSignature::shapeOf(const std::vector<size_t>& counts) {
  if (std::all_of(counts.begin(), counts.end(), [&](size_t c) { return c == counts.front(); })) {
    return counts.empty() ? 0 : counts.front();
  }
  return fnv1a(kFnv1aBasis, counts.data(), counts.size() * sizeof(size_t)) | 1ull << 63;
}

std::string OpSignature::describeShape() const {
  char digest[64];
  if (shape >> 63) {
    std::snprintf(digest, sizeof(digest), "uneven per-rank sizes (digest #%016llx)",
                  static_cast<unsigned long long>(shape));
    return digest;
  }
  const bool perRank = kind == OpKind::kAllgather || kind == OpKind::kGather || kind == OpKind::kScatter ||
                       kind == OpKind::kReduceScatter;
  return std::to_string(shape) + (shape == 1 ? " element" : " elements") + (perRank ? " per rank" : "");
}

std::string OpSignature::mismatchText(const OpSignature& ours, uint64_t ourSeq, int peer, const OpSignature& theirs,
                                      uint64_t theirSeq) {
  const auto described = [](const OpSignature& op, uint64_t seq) {
    const bool sized = op.kind != OpKind::kAlltoall && op.kind != OpKind::kBarrier;  // their `shape` is 0
    return op.describe(seq) + (sized ? " on " + op.describeShape() : "");
  };
  return "collectives do not match across ranks: this rank runs " + described(ours, ourSeq) + ", but rank " +
         std::to_string(peer) + " runs " + described(theirs, theirSeq) +
         ". Every rank must issue the same collectives in the same order with matching sizes and dtypes";
}

std::string OpSignature::describe(uint64_t seq) const {
  const bool reduces = kind == OpKind::kAllreduce || kind == OpKind::kReduce || kind == OpKind::kReduceScatter;
  std::string out = std::string(opKindName(kind)) + " #" + std::to_string(seq) + " (" +
                    (static_cast<int>(dtype) < kNumDataTypes ? dataTypeName(dtype) : "?");
  if (reduces) out += std::string(", ") + (static_cast<int>(redop) < kNumReduceOps ? reduceOpName(redop) : "?");
  if (reduces && redop == ReduceOp::kPremulSum) {
    char tag[24];
    std::snprintf(tag, sizeof(tag), ", factor #%04x", factor);
    out += tag;
  }
  if (root >= 0) out += ", root " + std::to_string(root);
  return out + ")";
}

}  // namespace smddp
