#include "torch/sparse_allreduce.h"

#include <ATen/ATen.h>
#include <ATen/native/SparseTensorUtils.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <array>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/types.h"
#include "torch/backend.h"
#include "torch/errors.h"

namespace smddp::torchext {
namespace {

constexpr const char* kOp = "all_reduce of sparse tensors";  // how errors name the op

// What each rank tells the others before the data: its nonzero count and what every rank must
// agree on. Fixed size, so the first all-gather needs no sizes of its own.
constexpr size_t kMaxDims = 27;
struct Record {
  int64_t nnz;
  int64_t dtype;
  int64_t sparseDim;
  int64_t denseDim;
  int64_t ndim;
  std::array<int64_t, kMaxDims> sizes;
};
static_assert(sizeof(Record) == 32 * sizeof(int64_t));

Record recordOf(const at::Tensor& t, int64_t nnz) {
  Record r{nnz, static_cast<int64_t>(t.scalar_type()), t.sparse_dim(), t.dense_dim(), t.dim(), {}};
  for (int64_t d = 0; d < t.dim(); ++d) r.sizes[d] = t.size(d);
  return r;
}

bool sameKind(const Record& a, const Record& b) {
  if (a.dtype != b.dtype || a.sparseDim != b.sparseDim || a.denseDim != b.denseDim || a.ndim != b.ndim) return false;
  for (int64_t d = 0; d < a.ndim; ++d) {
    if (a.sizes[d] != b.sizes[d]) return false;
  }
  return true;
}

// One of the op's all-gathers; an error names the op its caller ran before the step that failed
// ("all_reduce of sparse tensors: allgather #3: rank 1 exited ...", not a bare "allgather #3").
void gatherStep(algo::Communicator& c, const algo::AllgatherOptions& o, std::chrono::milliseconds timeout) {
  try {
    c.allgather(o, timeout);
  } catch (const Error& e) {
    throw Error(e.code(), std::string(kOp) + ": " + e.what());
  }
}

std::string describe(const Record& r) {
  std::ostringstream s;
  s << "size [";
  for (int64_t d = 0; d < r.ndim; ++d) s << (d ? ", " : "") << r.sizes[d];
  s << "] (sparse_dim " << r.sparseDim << ", dense_dim " << r.denseDim << ", "
    << c10::toString(static_cast<at::ScalarType>(r.dtype)) << ")";
  return s.str();
}

const char* redOpName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "an unknown reduce op";
  }
}

// The strides of the row-major linear index over `t`'s sparse dims, which sorts indices as
// coalesce() does. They fit in int64: torch refuses a tensor whose element count does not, but
// for one with a dense dim of size 0.
std::vector<int64_t> sparseStrides(const at::Tensor& t, const std::string& who) {
  std::vector<int64_t> strides(t.sparse_dim());
  int64_t stride = 1;
  for (int64_t d = t.sparse_dim(); d-- > 0;) {
    strides[d] = stride;
    TORCH_CHECK_NOT_IMPLEMENTED(t.size(d) == 0 || stride <= std::numeric_limits<int64_t>::max() / t.size(d),
                                who, ": allreduce of sparse tensors: the sparse dims of a tensor of "
                                "size ", t.sizes(), " hold more than 2^63 elements");
    stride *= t.size(d);
  }
  return strides;
}

// Each gathered nonzero's place in the sorted union of indices: `inverse` (one per nonzero, in
// rank order) and that union as a [sparse_dim, unique] index tensor.
struct Union {
  at::Tensor indices;
  at::Tensor inverse;
};

// `strides`: of the row-major linear index over the sparse dims (sparseStrides()).
Union unionOf(const std::vector<at::Tensor>& parts, at::IntArrayRef sparseSizes, const std::vector<int64_t>& strides) {
  const at::Tensor strideT = at::tensor(strides, at::kLong);
  std::vector<at::Tensor> keys;
  for (const at::Tensor& p : parts) keys.push_back((p * strideT).sum(1));
  auto [unique, inverse, counts] = at::_unique2(at::cat(keys), /*sorted=*/true, /*return_inverse=*/true);
  at::Tensor indices = at::empty({static_cast<int64_t>(sparseSizes.size()), unique.size(0)}, at::kLong);
  for (size_t d = 0; d < sparseSizes.size(); ++d) {
    indices[d].copy_(at::remainder(at::div(unique, strides[d], "floor"), sparseSizes[d]));
  }
  return {indices, inverse};
}

// At least `bytes` of `slot`'s memory (a uint8 tensor grown as needed).
uint8_t* reserve(at::Tensor& slot, int64_t bytes) {
  if (!slot.defined() || slot.numel() < bytes) {
    slot = at::Tensor();  // the old memory goes first: the peak is the new size, not both
    slot = at::empty({bytes}, at::kByte);
  }
  return slot.data_ptr<uint8_t>();
}

void run(const at::Tensor& t, bool average, const std::vector<int64_t>& strides, int rank, const std::string& who,
         int size, SparseScratch& scratch, algo::Communicator& c, std::chrono::milliseconds timeout) {
  at::NoGradGuard noGrad;
  // The op makes the sum `t`'s own data: a tensor made under torch.inference_mode() takes that
  // only under it, which the thread running the op may not be in (writeUser, staged.h).
  std::optional<c10::InferenceMode> inference;
  if (t.is_inference()) inference.emplace();
  const at::Tensor in = locally(who, kOp, "coalescing this rank's tensor", [&] { return t.coalesce(); });
  const int64_t nnz = in._nnz();
  const int64_t sparseDim = in.sparse_dim();
  const at::Tensor values = in._values();
  // A value row's shape (the dense dims), from the tensor's sizes: it holds when nnz is 0 too.
  const std::vector<int64_t> rowShape(in.sizes().begin() + sparseDim, in.sizes().end());
  const int64_t rowBytes = c10::multiply_integers(rowShape) * values.element_size();

  // 1. Every rank's nonzero count and kind.
  const Record mine = recordOf(in, nnz);
  std::vector<Record> records(size);
  {
    algo::AllgatherOptions o{DataType::kInt64, &mine, {}, std::vector<size_t>(size, sizeof(Record) / sizeof(int64_t))};
    for (Record& r : records) o.outputs.push_back(&r);
    gatherStep(c, o, timeout);
  }
  // Every rank sees the same records and raises here alike, so the group stays in step: the
  // core's error type says so (a ValueError to Python), where torch's would break the group.
  for (int p = 0; p < size; ++p) {
    if (sameKind(records[p], records[0])) continue;
    throw Error(ErrorCode::kInvalidUsage,
                c10::str(who, ": allreduce of sparse tensors: every rank must pass a tensor of the "
                         "same size, sparse/dense split and dtype, but rank ", p, " passed one of ",
                         describe(records[p]), " and rank 0 one of ", describe(records[0])));
  }

  // 2. Every rank's indices ([nnz, sparse_dim], row-major) and values, packed in one block.
  const int64_t indexBytes = sparseDim * static_cast<int64_t>(sizeof(int64_t));
  const int64_t entryBytes = indexBytes + rowBytes;
  std::vector<size_t> counts(size);
  std::vector<int64_t> offsets(size + 1, 0);
  for (int p = 0; p < size; ++p) {
    // Padded, so that the next rank's int64 indices stay aligned after 1-byte values.
    counts[p] = static_cast<size_t>((records[p].nnz * entryBytes + 7) / 8 * 8);
    offsets[p + 1] = offsets[p] + static_cast<int64_t>(counts[p]);
  }
  auto indicesAt = [&](uint8_t* at, int64_t n) { return at::from_blob(at, {n, sparseDim}, at::kLong); };
  auto valuesAt = [&](uint8_t* at, int64_t n) {
    std::vector<int64_t> shape{n};
    shape.insert(shape.end(), rowShape.begin(), rowShape.end());
    return at::from_blob(at, shape, values.options());
  };
  uint8_t* packed = nullptr;
  uint8_t* gathered = nullptr;
  locally(who, kOp, "staging every rank's nonzeros (" + std::to_string(offsets[size]) + " bytes)", [&] {
    packed = reserve(scratch.packed, static_cast<int64_t>(counts[rank]));
    gathered = reserve(scratch.gathered, offsets[size]);
    indicesAt(packed, nnz).copy_(in._indices().t());
    valuesAt(packed + nnz * indexBytes, nnz).copy_(values);
  });
  {
    algo::AllgatherOptions o{DataType::kUInt8, packed, {}, counts};
    for (int p = 0; p < size; ++p) o.outputs.push_back(gathered + offsets[p]);
    gatherStep(c, o, timeout);
  }

  // 3. The sum, the same on every rank: rows in rank order, into zeros.
  std::vector<at::Tensor> indexParts, valueParts;
  for (int p = 0; p < size; ++p) {
    const int64_t n = records[p].nnz;
    indexParts.push_back(indicesAt(gathered + offsets[p], n));
    valueParts.push_back(valuesAt(gathered + offsets[p] + n * indexBytes, n));
  }
  const Union u = unionOf(indexParts, in.sizes().slice(0, sparseDim), strides);
  const at::ScalarType dtype = values.scalar_type();
  const bool widen = dtype == at::kHalf || dtype == at::kBFloat16;
  std::vector<int64_t> outShape{u.indices.size(1)};
  outShape.insert(outShape.end(), rowShape.begin(), rowShape.end());
  at::Tensor sum = at::zeros(outShape, values.options().dtype(widen ? at::kFloat : dtype));
  int64_t first = 0;
  for (int p = 0; p < size; ++p) {
    const int64_t n = records[p].nnz;
    if (n == 0) continue;
    sum.index_add_(0, u.inverse.slice(0, first, first + n), widen ? valueParts[p].to(at::kFloat) : valueParts[p]);
    first += n;
  }
  if (average) sum.div_(size);
  // The sum's tensors become `t`'s (t.copy_ would copy them once more, into fresh memory).
  at::sparse::alias_into_sparse(t, u.indices, widen ? sum.to(dtype) : sum);
  t._coalesced_(true);
  t.unsafeGetTensorImpl()->bump_version();
}

}  // namespace

SparseAllreduceBody sparseAllreduce(const at::Tensor& t, const c10d::ReduceOp& op, int rank,
                                    std::shared_ptr<const std::string> who, int size,
                                    std::shared_ptr<SparseScratch> scratch) {
  TORCH_CHECK_NOT_IMPLEMENTED(t.device().is_cpu(), *who,
                              ": allreduce of sparse tensors is supported on CPU tensors only, got one on ",
                              t.device());
  TORCH_CHECK_VALUE(t.dim() <= static_cast<int64_t>(kMaxDims), *who,
                    ": allreduce of sparse tensors supports at most ", kMaxDims, " dimensions, got ", t.dim());
  // The sum is torch's own (coalesce, index_add_), which its CPU kernels do not provide for
  // every dtype (uint16-64, float8): refused here, at the call, rather than failing inside the op
  // (which would leave the group unusable).
  const at::ScalarType dtype = t.scalar_type();
  const bool summable = at::isFloatingType(dtype) ? dtype == at::kFloat || dtype == at::kDouble ||
                                                        dtype == at::kHalf || dtype == at::kBFloat16
                                                  : dtype == at::kBool || dtype == at::kByte || dtype == at::kChar ||
                                                        dtype == at::kShort || dtype == at::kInt || dtype == at::kLong;
  TORCH_CHECK_NOT_IMPLEMENTED(summable, *who, ": allreduce of sparse tensors: dtype ", dtype,
                              " is not supported (torch's sparse CPU kernels do not sum it; supported: float32, "
                              "float64, float16, bfloat16, int8, uint8, int16, int32, int64, bool)");
  const bool average = op.op_ == c10d::ReduceOp::AVG;
  TORCH_CHECK_NOT_IMPLEMENTED(op.op_ == c10d::ReduceOp::SUM || (average && at::isFloatingType(t.scalar_type())),
                              *who, ": allreduce of sparse tensors: ", redOpName(op.op_), " on ",
                              t.scalar_type(), " is not supported (supported: SUM, and AVG on floating-point "
                              "tensors; the implicit zeros make MIN, MAX and PRODUCT ill-defined)");
  return [t, average, strides = sparseStrides(t, *who), rank, who, size, scratch = std::move(scratch)](
             algo::Communicator& c, std::chrono::milliseconds timeout) {
    run(t, average, strides, rank, *who, size, *scratch, c, timeout);
  };
}

}  // namespace smddp::torchext
