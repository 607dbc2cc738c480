#include "torch/tensor_checks.h"

#include <ATen/MemoryOverlap.h>

#include <algorithm>

namespace smddp::torchext {

std::optional<DataType> toDataType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kByte: return DataType::kUInt8;
    case at::kShort: return DataType::kInt16;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kBool: return DataType::kBool;
    case at::kUInt16: return DataType::kUInt16;
    case at::kUInt32: return DataType::kUInt32;
    case at::kUInt64: return DataType::kUInt64;
    case at::kFloat8_e4m3fn: return DataType::kFloat8E4M3;
    case at::kFloat8_e5m2: return DataType::kFloat8E5M2;
    default: return std::nullopt;
  }
}

void checkPlacement(const at::Tensor& t, const std::string& who, const char* op) {
  TORCH_CHECK_VALUE(t.defined(), who, ": ", op, ": got an undefined tensor");
  TORCH_CHECK_NOT_IMPLEMENTED(t.device().is_cpu() || t.device().is_cuda(), who, ": ", op,
                              ": tensors on ", t.device(), " are not supported; smddp handles CPU and CUDA tensors");
  TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == at::kStrided && !t.is_quantized(), who, ": ", op,
                              ": only dense (strided, not quantized) tensors are supported, got ",
                              t.is_quantized() ? "a quantized tensor" : "layout " + c10::str(t.layout()));
}

DataType checkTensor(const at::Tensor& t, const std::string& who, const char* op) {
  checkPlacement(t, who, op);
  auto dt = toDataType(t.scalar_type());
  TORCH_CHECK_NOT_IMPLEMENTED(dt.has_value(), who, ": ", op, ": dtype ", t.scalar_type(),
                              " is not supported for reductions (supported: float32, float64, float16, bfloat16, "
                              "float8_e4m3fn, float8_e5m2, int8, uint8, int16, int32, int64, uint16, uint32, uint64, "
                              "bool); ops that only move data take any dtype of 1, 2, 4 or 8 bytes");
  return *dt;
}

std::vector<at::Tensor> complexAsReals(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op,
                                       const std::string& who, const char* name) {
  const auto complex = [](const at::Tensor& t) { return t.defined() && t.is_complex(); };
  if (std::none_of(tensors.begin(), tensors.end(), complex)) return {};
  TORCH_CHECK_TYPE(std::all_of(tensors.begin(), tensors.end(), complex), who, ": ", name,
                   ": complex tensors mixed with others");
  const auto o = op.op_;
  static const char* const kNames[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"};
  TORCH_CHECK_NOT_IMPLEMENTED(o == c10d::ReduceOp::SUM || o == c10d::ReduceOp::AVG || o == c10d::ReduceOp::PREMUL_SUM,
                              who, ": ", name, ": reduce op ",
                              o < std::size(kNames) ? kNames[o] : "(unknown)",
                              " is not supported on complex tensors (SUM, AVG and PREMUL_SUM are, part by part)");
  std::vector<at::Tensor> reals;
  for (const at::Tensor& t : tensors) reals.push_back(at::view_as_real(t));
  return reals;
}

std::optional<std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> complexItemsAsReals(
    const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, const c10d::ReduceOp& op,
    const std::string& who, const char* name) {
  const auto complex = [](const at::Tensor& t) { return t.defined() && t.is_complex(); };
  if (std::none_of(outputs.begin(), outputs.end(), complex) && std::none_of(inputs.begin(), inputs.end(), complex)) {
    return std::nullopt;
  }
  TORCH_INTERNAL_ASSERT(inputs.empty() || inputs.size() == outputs.size(), name, ": ", outputs.size(),
                        " outputs for ", inputs.size(), " inputs");
  auto reals = std::make_pair(outputs, inputs);
  for (size_t i = 0; i < outputs.size(); ++i) {
    std::vector<at::Tensor> item{outputs[i]};
    if (!inputs.empty()) item.push_back(inputs[i]);
    std::vector<at::Tensor> r = complexAsReals(item, op, who, name);
    if (r.empty()) continue;
    reals.first[i] = r[0];
    if (!inputs.empty()) reals.second[i] = r[1];
  }
  return reals;
}

DataType checkMovedTensor(const at::Tensor& t, const std::string& who, const char* op) {
  checkPlacement(t, who, op);
  if (auto dt = toDataType(t.scalar_type())) return *dt;
  switch (t.element_size()) {
    case 1: return DataType::kUInt8;
    case 2: return DataType::kInt16;
    case 4: return DataType::kInt32;
    case 8: return DataType::kInt64;
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(false, who, ": ", op, ": dtype ", t.scalar_type(), " (",
                                  t.element_size(), " bytes per element) is not supported; ops that only move data "
                                  "take any dtype of 1, 2, 4 or 8 bytes");
  }
}

void checkSameType(const at::Tensor& a, const at::Tensor& b, const std::string& who, const char* op) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), who, ": ", op,
                   ": input and output dtypes differ (", b.scalar_type(), " vs ", a.scalar_type(), ")");
}

std::vector<at::Tensor> concatTensors(std::vector<at::Tensor> a, const std::vector<at::Tensor>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

const at::Tensor& onlyTensor(const std::vector<at::Tensor>& tensors, const std::string& who, const char* op) {
  TORCH_CHECK_VALUE(tensors.size() == 1, who, ": ", op, " takes exactly one tensor per process, got ",
                    tensors.size());
  return tensors[0];
}

void checkRootTensor(int64_t rootTensor, const std::string& who, const char* op) {
  TORCH_CHECK_VALUE(rootTensor == 0, who, ": ", op, ": root tensor ", rootTensor,
                    " is not an index of the list of 1 tensor (ProcessGroup's rootTensor option)");
}

Reduction toReduction(const c10d::ReduceOp& op, DataType dtype, int size, const std::string& who, const char* opName) {
  Reduction r;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: r.op = ReduceOp::kSum; break;
    case c10d::ReduceOp::AVG: r.op = ReduceOp::kAvg; break;
    case c10d::ReduceOp::PRODUCT: r.op = ReduceOp::kProduct; break;
    case c10d::ReduceOp::MIN: r.op = ReduceOp::kMin; break;
    case c10d::ReduceOp::MAX: r.op = ReduceOp::kMax; break;
    case c10d::ReduceOp::BAND: r.op = ReduceOp::kBand; break;
    case c10d::ReduceOp::BOR: r.op = ReduceOp::kBor; break;
    case c10d::ReduceOp::BXOR: r.op = ReduceOp::kBxor; break;
    case c10d::ReduceOp::PREMUL_SUM: {
      r.op = ReduceOp::kPremulSum;
      // NCCLPreMulSumSupplement: the name older torch releases have (2.13 keeps it as an alias).
      auto* s = static_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK_VALUE(s != nullptr, who, ": ", opName, ": PREMUL_SUM without a factor");
      r.premulFactor = s->double_factor;
      if (const at::Tensor& f = s->tensor_factor; f.defined()) {  // one element (torch checks)
        // A complex factor cannot scale the real pairs a complex tensor is reduced as.
        TORCH_CHECK_NOT_IMPLEMENTED(!f.is_complex(), who, ": ", opName, ": a complex PREMUL_SUM factor (",
                                    f.scalar_type(), ") is not supported");
        r.premulFactor = f.item<double>();
      }
      break;
    }
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(false, who, ": ", opName, ": reduce op ", static_cast<int>(op.op_),
                                  " is not supported");
  }
  r.avgDivisor = size;
  const char* why = unsupportedReason(dtype, r.op);
  TORCH_CHECK_NOT_IMPLEMENTED(why == nullptr, who, ": ", opName, ": reduce op ", reduceOpName(r.op),
                              " is not supported on ", dataTypeName(dtype), " (", why ? why : "", ")");
  return r;
}

std::string writableRefusal(const at::Tensor& t, const std::string& who, const char* op) {
  if (at::has_internal_overlap(t) != at::MemOverlap::Yes) return {};
  return who + ": " + op + ": the output tensor has elements that share memory (a view made by expand() or "
         "as_strided()); pass a tensor of its own, e.g. .clone()";
}

void checkWritable(const at::Tensor& t, const std::string& who, const char* op) {
  const std::string why = writableRefusal(t, who, op);
  TORCH_CHECK_VALUE(why.empty(), why);
}


}  // namespace smddp::torchext
