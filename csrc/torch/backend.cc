#include "torch/backend.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <optional>
#include <span>
#include <sstream>

#include "algo/desync_probe.h"
#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "core/spin.h"
#include "core/types.h"
#include "torch/flight_recorder.h"

namespace smddp::torchext {

namespace {
// "all_reduce" for the profiler's "smddp:all_reduce": how messages name an op.
const char* opName(const char* title) { return std::strncmp(title, "smddp:", 6) == 0 ? title + 6 : title; }
}  // namespace

std::string rankPrefix(int rank) { return "smddp rank " + std::to_string(rank) + ": "; }

std::exception_ptr toTorchError(const Error& e, int rank) {
  // Messages from code that knows the rank already start with rankPrefix().
  const std::string prefix = rankPrefix(rank);
  const std::string what = e.what();
  const std::string msg = what.rfind(prefix, 0) == 0 ? what : prefix + what;
  const c10::SourceLocation loc{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
  switch (e.code()) {
    case ErrorCode::kInvalidUsage: return std::make_exception_ptr(c10::ValueError(loc, msg));
    case ErrorCode::kNotSupported: return std::make_exception_ptr(c10::NotImplementedError(loc, msg));
    case ErrorCode::kTimeout: return std::make_exception_ptr(TimeoutError(loc, msg));
    default: return std::make_exception_ptr(c10::DistBackendError(loc, msg));
  }
}

std::exception_ptr bodyError(algo::Communicator& c, int rank, int size, const char* title) {
  const std::exception_ptr original = std::current_exception();
  try {  // under memory pressure the message itself may fail: the error then goes as it came
    std::string message;
    try {
      throw;
    } catch (const Error& e) {
      // A collective that failed has told its peers (abandon() keeps that first cause); the
      // core's other errors outside one (a CUDA round the device did not stage in time) are told
      // here. Not a usage error every rank raises alike (the group stays usable), nor a shutdown.
      if (size > 1 && e.code() != ErrorCode::kInvalidUsage && e.code() != ErrorCode::kAborted) c.abandon(e.what());
      return toTorchError(e, rank);
    } catch (const std::exception& e) {
      message = messageOf(e);
    } catch (...) {
      message = "an exception of unknown type";
    }
    const std::string prefix = rankPrefix(rank);
    if (message.rfind(prefix, 0) == 0) {  // ours (locally()'s, a check's): names the op, has its type
      if (size > 1) c.abandon(message.substr(prefix.size()));
      return original;
    }
    message = std::string(opName(title)) + ": " + message;
    if (size > 1) c.abandon(message);
    const c10::SourceLocation loc{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
    return std::make_exception_ptr(c10::DistBackendError(loc, prefix + message));
  } catch (...) {
    return original;
  }
}

std::string messageOf(const std::exception& e) {
  if (const auto* c10Error = dynamic_cast<const c10::Error*>(&e)) return c10Error->what_without_backtrace();
  if (dynamic_cast<const std::bad_alloc*>(&e)) return "out of memory (std::bad_alloc)";
  return e.what();
}

std::exception_ptr asTorchError(std::exception_ptr error, int rank) {
  if (!error) return error;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    return toTorchError(e, rank);
  } catch (...) {
    return error;
  }
}

namespace {

// Why a forked process may not use its parent's group or wait for its ops.
std::string forkedWhy(pid_t owner) {
  return "this process (pid " + std::to_string(currentPid()) + ") is a fork of process " + std::to_string(owner) +
         ", which made the process group: the group's threads, connections and shared memory are that "
         "process's, so only it can run the group's ops (a DataLoader worker or other forked child must leave "
         "communication to its parent)";
}

// ---- validation (phase 1, on the caller's thread) -------------------------------------------

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

// What every op needs of a tensor: defined, dense, on the CPU or a CUDA device.
void checkPlacement(const at::Tensor& t, int rank, const char* op) {
  TORCH_CHECK_VALUE(t.defined(), "smddp rank ", rank, ": ", op, ": got an undefined tensor");
  TORCH_CHECK_NOT_IMPLEMENTED(t.device().is_cpu() || t.device().is_cuda(), "smddp rank ", rank, ": ", op,
                              ": tensors on ", t.device(), " are not supported; smddp handles CPU and CUDA tensors");
  TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == at::kStrided && !t.is_quantized(), "smddp rank ", rank, ": ", op,
                              ": only dense (strided, not quantized) tensors are supported, got ",
                              t.is_quantized() ? "a quantized tensor" : "layout " + c10::str(t.layout()));
}

// A tensor that an op reduces: its dtype must be one smddp computes in.
DataType checkTensor(const at::Tensor& t, int rank, const char* op) {
  checkPlacement(t, rank, op);
  auto dt = toDataType(t.scalar_type());
  TORCH_CHECK_NOT_IMPLEMENTED(dt.has_value(), "smddp rank ", rank, ": ", op, ": dtype ", t.scalar_type(),
                              " is not supported for reductions (supported: float32, float64, float16, bfloat16, "
                              "float8_e4m3fn, float8_e5m2, int8, uint8, int16, int32, int64, uint16, uint32, uint64, "
                              "bool); ops that only move data take any dtype of 1, 2, 4 or 8 bytes");
  return *dt;
}

// torch hands all_reduce a complex tensor as pairs of reals (view_as_real), but reduce and the
// reduce-scatters as it is: the same here, for the ops that act on both parts alike (as gloo
// and NCCL reduce them). Empty when no tensor is complex; a call mixing complex tensors with
// others is refused.
std::vector<at::Tensor> complexAsReals(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op, int rank,
                                       const char* name) {
  const auto complex = [](const at::Tensor& t) { return t.defined() && t.is_complex(); };
  if (std::none_of(tensors.begin(), tensors.end(), complex)) return {};
  TORCH_CHECK_TYPE(std::all_of(tensors.begin(), tensors.end(), complex), "smddp rank ", rank, ": ", name,
                   ": complex tensors mixed with others");
  const auto o = op.op_;
  static const char* const kNames[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"};
  TORCH_CHECK_NOT_IMPLEMENTED(o == c10d::ReduceOp::SUM || o == c10d::ReduceOp::AVG || o == c10d::ReduceOp::PREMUL_SUM,
                              "smddp rank ", rank, ": ", name, ": reduce op ",
                              o < std::size(kNames) ? kNames[o] : "(unknown)",
                              " is not supported on complex tensors (SUM, AVG and PREMUL_SUM are, part by part)");
  std::vector<at::Tensor> reals;
  for (const at::Tensor& t : tensors) reals.push_back(at::view_as_real(t));
  return reals;
}

// A tensor that an op only moves (broadcast, the gathers, scatter, all_to_all, send/recv): any
// dtype of 1, 2, 4 or 8 bytes (the other float8 kinds and complex32/64 too), carried bit for bit
// as the integer type of its size, which every step of such an op treats alike.
DataType checkMovedTensor(const at::Tensor& t, int rank, const char* op) {
  checkPlacement(t, rank, op);
  if (auto dt = toDataType(t.scalar_type())) return *dt;
  switch (t.element_size()) {
    case 1: return DataType::kUInt8;
    case 2: return DataType::kInt16;
    case 4: return DataType::kInt32;
    case 8: return DataType::kInt64;
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(false, "smddp rank ", rank, ": ", op, ": dtype ", t.scalar_type(), " (",
                                  t.element_size(), " bytes per element) is not supported; ops that only move data "
                                  "take any dtype of 1, 2, 4 or 8 bytes");
  }
}

void checkSameType(const at::Tensor& a, const at::Tensor& b, int rank, const char* op) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "smddp rank ", rank, ": ", op,
                   ": input and output dtypes differ (", b.scalar_type(), " vs ", a.scalar_type(), ")");
}

std::vector<at::Tensor> concat(std::vector<at::Tensor> a, const std::vector<at::Tensor>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

const at::Tensor& single(const std::vector<at::Tensor>& tensors, int rank, const char* op) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "smddp rank ", rank, ": ", op, " takes exactly one tensor per process, got ",
                    tensors.size());
  return tensors[0];
}

Reduction toReduction(const c10d::ReduceOp& op, DataType dtype, int size, int rank, const char* opName) {
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
      TORCH_CHECK_VALUE(s != nullptr, "smddp rank ", rank, ": ", opName, ": PREMUL_SUM without a factor");
      r.premulFactor = s->double_factor;
      if (const at::Tensor& f = s->tensor_factor; f.defined()) {  // one element (torch checks)
        // A complex factor cannot scale the real pairs a complex tensor is reduced as.
        TORCH_CHECK_NOT_IMPLEMENTED(!f.is_complex(), "smddp rank ", rank, ": ", opName, ": a complex PREMUL_SUM factor (",
                                    f.scalar_type(), ") is not supported");
        r.premulFactor = f.item<double>();
      }
      break;
    }
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(false, "smddp rank ", rank, ": ", opName, ": reduce op ", static_cast<int>(op.op_),
                                  " is not supported");
  }
  r.avgDivisor = size;
  const char* why = unsupportedReason(dtype, r.op);
  TORCH_CHECK_NOT_IMPLEMENTED(why == nullptr, "smddp rank ", rank, ": ", opName, ": reduce op ", reduceOpName(r.op),
                              " is not supported on ", dataTypeName(dtype), " (", why ? why : "", ")");
  return r;
}

// A tensor as the core sees it: `work` is contiguous, the user's tensor itself or a copy (results
// are copied back after the op where `copyBack`). The copy is made by ready(), as the op starts,
// not when it is issued: an op queued behind another that writes the same memory must read what
// that one wrote.
struct Staged {
  enum class Way : uint8_t {
    kAsIs,    // the user's tensor, contiguous
    kCopyIn,  // a contiguous copy of the user's values as the op starts
    kFresh,   // a contiguous tensor of its own, only written
  };
  at::Tensor user;
  Way way = Way::kAsIs;
  bool copyBack = false;
  at::Tensor work;  // once ready()

  void ready() {
    if (way == Way::kCopyIn) {
      work = user.clone(at::MemoryFormat::Contiguous);
    } else if (way == Way::kFresh) {
      work = at::empty(user.sizes(), user.options().memory_format(at::MemoryFormat::Contiguous));
    } else {
      work = user;
    }
  }
  bool inPlace() const { return way == Way::kAsIs; }  // works on the user's memory
  // An input read while an output it overlaps is written: the op reads a copy.
  void copyAtStart() {
    if (way == Way::kAsIs) way = Way::kCopyIn;
  }
};

void ready(std::vector<Staged>& staged) {
  for (Staged& s : staged) s.ready();
}

// A tensor the op writes must not have elements that share memory (an expand()ed view): ranks'
// results for those elements could differ, and torch refuses to write such a tensor too, but only
// after the op has run; refuse it before anything is sent.
void checkWritable(const at::Tensor& t, int rank, const char* op) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, "smddp rank ", rank, ": ", op,
                    ": the output tensor has elements that share memory (a view made by expand() or as_strided()); "
                    "pass a tensor of its own, e.g. .clone()");
}

Staged stageInOut(const at::Tensor& t, int rank, const char* op) {  // read and written (allreduce, reduce's root)
  if (t.is_contiguous()) return {t};
  checkWritable(t, rank, op);
  return {t, Staged::Way::kCopyIn, true};
}
Staged stageOut(const at::Tensor& t, int rank, const char* op) {  // only written
  if (t.is_contiguous()) return {t};
  checkWritable(t, rank, op);
  return {t, Staged::Way::kFresh, true};
}
Staged stageIn(const at::Tensor& t) {  // only read
  return {t, t.is_contiguous() ? Staged::Way::kAsIs : Staged::Way::kCopyIn};
}

void finishStaged(const Staged& s) {
  if (!s.copyBack) return;
  // The user's tensor may be a leaf that requires grad (a parameter): the op writes its data, as
  // gloo does, not an autograd-recorded in-place op.
  at::NoGradGuard noGrad;
  s.user.copy_(s.work);
}

inline uint8_t* bytePtr(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// Whether the op will work on memory `a` and `b` share (copies made as it starts share none).
bool overlaps(const Staged& a, const Staged& b) {
  if (!a.inPlace() || !b.inPlace()) return false;
  const uint8_t* a0 = bytePtr(a.user);
  const uint8_t* b0 = bytePtr(b.user);
  return a0 < b0 + b.user.nbytes() && b0 < a0 + a.user.nbytes();
}

// A list of per-rank input blocks (reduce_scatter, scatter): each checked against the output
// (dtype, element count: every block's, or with `uneven` only this rank's own), made contiguous,
// and copied if it overlaps the output, which the op writes while the blocks are still being read.
std::vector<Staged> stageBlocks(const std::vector<at::Tensor>& blocks, const Staged& out, int rank, const char* op,
                                bool uneven = false) {
  std::vector<Staged> srcs;
  for (const at::Tensor& b : blocks) {
    checkMovedTensor(b, rank, op);
    checkSameType(out.user, b, rank, op);
    const bool own = static_cast<int>(srcs.size()) == rank;
    TORCH_CHECK_VALUE(b.numel() == out.user.numel() || (uneven && !own), "smddp rank ", rank, ": ", op,
                      uneven ? ": this rank's own input block must have the output's " : ": every input must have "
                      "the output's ", out.user.numel(), " elements, got one with ", b.numel());
    Staged c = stageIn(b);
    if (overlaps(c, out)) c.copyAtStart();
    srcs.push_back(std::move(c));
  }
  return srcs;
}

// Which tensors of a list may share memory with an earlier one of it: those whose byte span
// (first to last element) overlaps another's, except the first in list order of each run of
// overlapping spans (a tensor may be marked that only overlaps later ones: it is then copied
// needlessly, never missed). Sorting the spans keeps this O(n log n): a list of a thousand
// tensors compared pair by pair took most of the op's time.
std::vector<bool> sharesWithEarlier(const std::vector<at::Tensor>& tensors) {
  struct Span {
    uintptr_t lo, hi;
    size_t index;
  };
  std::vector<Span> spans;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    int64_t last = 0;  // the last element's offset from the first, in elements (strides are >= 0)
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.push_back({lo, lo + static_cast<uintptr_t>(last + 1) * t.element_size(), i});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
  std::vector<bool> shares(tensors.size(), false);
  for (size_t k = 0; k < spans.size();) {
    size_t end = k + 1;
    uintptr_t hi = spans[k].hi;
    size_t first = spans[k].index;
    for (; end < spans.size() && spans[end].lo < hi; ++end) {
      hi = std::max(hi, spans[end].hi);
      first = std::min(first, spans[end].index);
    }
    for (size_t m = k; end - k > 1 && m < end; ++m) shares[spans[m].index] = spans[m].index != first;
    k = end;
  }
  return shares;
}

// A coalesced op's plan: tensors [first, first + count) of the list move together, as one flat
// collective where count > 1.
struct CoalescedItem {
  size_t first = 0;
  size_t count = 1;
};

// Consecutive non-empty tensors of one dtype, each of at most `packBytes`, form one item of up
// to kMaxPackBytes; every other tensor is its own. `tensors` are those the collective moves
// whole: all_reduce's, an all-gather's outputs, a reduce-scatter's inputs (a rank's block is
// 1/world of them: packing blocks of 4 KiB at world 2 did not pay).
// Depends only on the tensors' dtypes and sizes and on packBytes, which every rank must share
// (SMDDP_COALESCE_PACK_BYTES set alike: else the ranks' collectives differ and the op fails as
// mismatched).
std::vector<CoalescedItem> planCoalesced(const std::vector<at::Tensor>& tensors, size_t packBytes) {
  constexpr size_t kMaxPackBytes = size_t{4} << 20;
  std::vector<CoalescedItem> items;
  size_t runBytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t bytes = tensors[i].nbytes();
    const bool packable = bytes > 0 && bytes <= packBytes;
    if (packable && !items.empty() && runBytes > 0 && runBytes + bytes <= kMaxPackBytes &&
        tensors[i].scalar_type() == tensors[items.back().first].scalar_type()) {
      ++items.back().count;
      runBytes += bytes;
      continue;
    }
    items.push_back({i, 1});
    runBytes = packable ? bytes : 0;
  }
  return items;
}

size_t coalescePackBytes() { return static_cast<size_t>(std::max<int64_t>(0, env::coalescePackBytes())); }

// A tensor's values to and from `bytes` (its nbytes() of them, in its logical order). Contiguous
// ones are copied with memcpy: torch's copy_() of a small tensor costs more than the collective
// packing saves. A parameter's data is read and written as data, recording nothing.
void copyToBytes(uint8_t* bytes, const at::Tensor& t) {
  if (t.is_contiguous()) {
    std::memcpy(bytes, t.data_ptr(), t.nbytes());
  } else {
    at::NoGradGuard noGrad;
    at::from_blob(bytes, t.sizes(), t.options()).copy_(t);
  }
}
void copyFromBytes(const at::Tensor& t, const uint8_t* bytes) {
  if (t.is_contiguous()) {
    std::memcpy(t.data_ptr(), bytes, t.nbytes());
  } else {
    at::NoGradGuard noGrad;
    t.copy_(at::from_blob(const_cast<uint8_t*>(bytes), t.sizes(), t.options()));
  }
}

// The item's tensors' values, one after another in a tensor of their dtype.
at::Tensor packCoalesced(const std::vector<Staged>& staged, const CoalescedItem& item) {
  int64_t numel = 0;
  for (size_t i = item.first; i < item.first + item.count; ++i) numel += staged[i].user.numel();
  at::Tensor flat = at::empty({numel}, staged[item.first].user.options().memory_format(at::MemoryFormat::Contiguous));
  uint8_t* to = bytePtr(flat);
  for (size_t i = item.first; i < item.first + item.count; ++i) {
    copyToBytes(to, staged[i].user);
    to += staged[i].user.nbytes();
  }
  return flat;
}

// Writes the reduced values back into the item's tensors.
void unpackCoalesced(const std::vector<Staged>& staged, const CoalescedItem& item, const at::Tensor& flat) {
  const uint8_t* from = bytePtr(flat);
  for (size_t i = item.first; i < item.first + item.count; ++i) {
    copyFromBytes(staged[i].user, from);
    from += staged[i].user.nbytes();
  }
}

// ---- bootstrap ------------------------------------------------------------------------------

// Failures of the c10d store become smddp errors, so that one during an op (a group's first
// all_to_all reads peers' addresses) fails the op like any other: named, and the group broken.
// Reads wait as long as the group's timeout says, not the store's own (init_process_group's,
// which a later group may exceed: its ranks would give up on a late rank 0 sooner than rank 0
// on them, and blame each other).
class C10dStore : public Store {
 public:
  C10dStore(c10::intrusive_ptr<c10d::Store> store, std::chrono::milliseconds timeout)
      : store_(std::move(store)), timeout_(timeout) {}
  void set(const std::string& key, const std::string& value) override {
    guarded("setting", key, [&] { store_->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
  }
  std::string get(const std::string& key) override {
    std::string value;
    guarded("reading", key, [&] {
      store_->wait({key}, timeout_);
      auto v = store_->get(key);
      value.assign(v.begin(), v.end());
    });
    return value;
  }
  bool check(const std::string& key) override {
    bool found = false;
    guarded("checking", key, [&] { found = store_->check({key}); });
    return found;
  }
  // c10d's TCPStore waits for them all in one request, then reads them in another.
  std::vector<std::string> multiGet(const std::vector<std::string>& keys) override {
    std::vector<std::string> values;
    if (keys.empty()) return values;
    const std::string what = keys.size() == 1 ? keys[0] : keys[0] + " (and " + std::to_string(keys.size() - 1) +
                                                               " more keys)";
    guarded("reading", what, [&] {
      store_->wait(keys, timeout_);
      for (const std::vector<uint8_t>& v : store_->multiGet(keys)) values.emplace_back(v.begin(), v.end());
    });
    return values;
  }

 private:
  template <class Fn>
  static void guarded(const char* what, const std::string& key, Fn&& fn) {
    try {
      fn();
    } catch (const c10::DistStoreError& e) {  // the store's own timeout
      failed(ErrorCode::kTimeout, what, key, e, "");
    } catch (const std::exception& e) {
      // FileStore's timeouts are plain c10::Errors: its get's, and its wait's.
      if (std::strncmp(e.what(), "Timeout waiting for key", 23) == 0 || std::strncmp(e.what(), "Wait timeout", 12) == 0) {
        failed(ErrorCode::kTimeout, what, key, e, "");
      }
      failed(ErrorCode::kRemoteError, what, key, e,
             ": the process that hosts it (rank 0's, for init_method tcp:// or env://) may have exited");
    }
  }
  [[noreturn]] static void failed(ErrorCode code, const char* what, const std::string& key, const std::exception& e,
                                  const char* hint) {
    std::string why = e.what();
    why = why.substr(0, why.find('\n'));  // c10 appends a C++ backtrace
    throwError(code, "the process group's store failed while %s %s (%s)%s", what, key.c_str(), why.c_str(), hint);
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
};

// An op's tensors in a log line: "float32, 2 inputs (2048 elements), 1 output (1024 elements)";
// for a send or recv (which passes its one buffer as both) "int64, 3 elements (24 bytes)".
std::string describeTensors(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs, bool p2p) {
  if (outputs.empty() && inputs.empty()) return "no tensors";
  const at::ScalarType st = (outputs.empty() ? inputs : outputs)[0].scalar_type();
  const std::optional<DataType> dt = toDataType(st);
  std::ostringstream text;
  text << (dt ? dataTypeName(*dt) : c10::toString(st));
  if (p2p) {
    text << ", " << outputs[0].numel() << " elements (" << outputs[0].nbytes() << " bytes)";
    return text.str();
  }
  auto list = [&](const char* what, const std::vector<at::Tensor>& ts) {
    if (ts.empty()) return;
    int64_t n = 0;
    for (const at::Tensor& t : ts) n += t.numel();
    text << ", " << ts.size() << " " << what << (ts.size() == 1 ? "" : "s") << " (" << n << " elements)";
  };
  list("input", inputs);
  list("output", outputs);
  return text.str();
}

}  // namespace

// ---- Work -----------------------------------------------------------------------------------

SmddpWork::SmddpWork(int rank, c10d::OpType opType, const char* profilingTitle, std::vector<at::Tensor> outputs,
                     const std::optional<std::vector<at::Tensor>>& inputs, std::chrono::microseconds spin)
    : c10d::Work(rank, opType, profilingTitle, inputs),
      title_(opName(profilingTitle)),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))),
      spin_(spin) {}

void SmddpWork::setCuda(c10::Stream doneOn) {
  future_ = c10::make_intrusive<c10::ivalue::Future>(future_->elementType(), std::vector<c10::Device>{doneOn.device()});
  c10::StreamGuard onDoneStream(doneOn);  // the future records its event on the current stream
  future_->markCompleted(c10::IValue(outputs_));
  cuda_ = true;
}

bool SmddpWork::wait(std::chrono::milliseconds timeout) {
  if (currentPid() != ownerPid_ && !isCompleted()) {
    // Its thread is the parent's: it would never complete here, and running it here (the
    // drivers below) would work on the parent's shared memory.
    TORCH_CHECK(false, "smddp rank ", rank_, ": ", title_, ": wait(): ", forkedWhy(ownerPid_));
  }
  if (cuda_ && env::cudaBlockingWait() == 0) {
    // An error already known is raised here; a later one by the next call on the group.
    if (std::exception_ptr error = isCompleted() ? exception() : nullptr) std::rethrow_exception(error);
    synchronize();
    return true;
  }
  // Without a time limit only: the engine's own deadlines end the drive, not the caller's.
  if (p2pDriver_ && timeout == kNoTimeout) p2pDriver_->driveUntil([this] { return isCompleted(); });
  if (runner_ && !isCompleted() &&
      ((timeout == kNoTimeout && env::waitRunsOp() != 0) || runner_->runningHere())) {
    runner_->runQueuedUntil([this] { return isCompleted(); });
  }
  spinUntil(spin_, [this] { return finished_.load(std::memory_order_acquire); });
  try {
    return c10d::Work::wait(timeout);  // then synchronize()
  } catch (const c10::Error&) {
    if (isCompleted()) throw;  // the op's own error
    // The base class says only "Operation timed out!".
    const c10::SourceLocation loc{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
    throw c10::DistBackendError(loc, "smddp rank " + std::to_string(rank_) + ": " + title_ + ": wait(timeout=" +
                                         std::to_string(timeout.count()) +
                                         " ms) ran out before the op completed; the op is still pending (the "
                                         "group's timeout ends it if its peers never come)");
  }
}

void SmddpWork::synchronize() {
  // The future's event: the current stream waits for it, and the caching allocator learns that
  // stream uses the outputs (what NCCL's Work does too).
  if (cuda_) future_->wait();
}

void SmddpWork::blockCurrentStream() {
  if (cuda_) {
    synchronize();
  } else {
    c10d::Work::blockCurrentStream();
  }
}

void SmddpWork::traceStarted() { FlightRecorder::get().started(traceId_); }

void SmddpWork::noteCallbacksAfter() {
  if (runner_) callbacksAfter_.store(runner_->issued(), std::memory_order_release);
}

c10::intrusive_ptr<c10::ivalue::Future> SmddpWork::getFuture() {
  noteCallbacksAfter();
  return future_;
}

void SmddpWork::complete(std::exception_ptr error) {
  // The ops the future's callbacks issue here go after those issued before getFuture().
  std::optional<engine::ProgressThread::IssueOrder> order;
  if (runner_) order.emplace(runner_.get(), callbacksAfter_.load(std::memory_order_acquire));
  // Before the future completes: whoever saw the op done may ask for its duration.
  durationNs_.store(FlightRecorder::get().finished(traceId_, !error), std::memory_order_release);
  c10d::WorkResult result = c10d::WorkResult::SUCCESS;
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const TimeoutError&) {
      result = c10d::WorkResult::TIMEOUT;
    } catch (...) {
      result = c10d::WorkResult::COMM_ERROR;
    }
  }
  result_ = result;  // read only by those who saw completed_, which finish() sets under mutex_
  if (error) {
    FlightRecorder::get().dumpOnError(pgId_, rank_);
    if (!cuda_) future_->setError(error);  // a CUDA op's future completed at launch (setCuda)
    finish(error);
  } else {
    if (!cuda_) future_->markCompleted(c10::IValue(outputs_));
    finish();
  }
  finished_.store(true, std::memory_order_release);
  // No lock per op unless the result was asked for: getFutureResult() sets resultWanted_ under
  // mutex_ before finish() took it, or it saw completed_ and marks the result itself.
  if (!resultWanted_.load(std::memory_order_acquire)) return;
  c10::intrusive_ptr<c10::ivalue::Future> pending;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!resultMarked_) {
      resultMarked_ = true;
      pending = futureResult_;
    }
  }
  if (pending) pending->markCompleted(c10::IValue(static_cast<int64_t>(result)));  // its callbacks run unlocked
}

c10::intrusive_ptr<c10::ivalue::Future> SmddpWork::getFutureResult() {
  noteCallbacksAfter();
  c10::intrusive_ptr<c10::ivalue::Future> f;
  bool markNow = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!futureResult_) {
      futureResult_ = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
      resultWanted_.store(true, std::memory_order_release);
    }
    f = futureResult_;
    markNow = completed_ && !resultMarked_;
    resultMarked_ = resultMarked_ || markNow;
  }
  if (markNow) f->markCompleted(c10::IValue(static_cast<int64_t>(result_)));
  return f;
}

float SmddpWork::getDuration() const {
  const int64_t ns = durationNs_.load(std::memory_order_acquire);
  TORCH_CHECK(ns != kNotDone, "smddp rank ", rank_, ": ", title_, ": _get_duration() before the op completed");
  TORCH_CHECK(FlightRecorder::get().enabled(), "smddp rank ", rank_, ": ", title_,
              ": _get_duration() needs the flight recorder, which times each op (TORCH_FR_BUFFER_SIZE is 0)");
  TORCH_CHECK(ns != FlightRecorder::kOverwritten, "smddp rank ", rank_, ": ", title_,
              ": _get_duration(): later ops took the op's flight recorder entry before it completed (TORCH_FR_BUFFER_SIZE=",
              FlightRecorder::get().capacity(), " entries), so it was not timed");
  TORCH_CHECK(ns >= 0, "smddp rank ", rank_, ": ", title_, ": _get_duration(): the op failed, so it was not timed");
  return static_cast<float>(ns) / 1e6f;
}

// ---- Backend --------------------------------------------------------------------------------

SmddpBackend::SmddpBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout, std::vector<int64_t> globalRanks)
    : c10d::Backend(rank, size), timeoutMs_(timeout.count()), globalRanks_(std::move(globalRanks)) {
  // Every rank refuses it alike, before waiting for any other (0 would be a deadline of now).
  TORCH_CHECK_VALUE(timeout.count() > 0, "smddp rank ", rank, ": the process group's timeout must be positive, got ",
                    timeout.count(), " ms");
  if (globalRanks_.empty()) {
    for (int r = 0; r < size; ++r) globalRanks_.push_back(r);
  }
  pgId_ = FlightRecorder::get().addGroup(globalRanks_);
  const char* torchDebug = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  debugChecks_ = env::debugChecks() != 0 || (torchDebug != nullptr && std::string(torchDebug) == "DETAIL");
  c10dStore_ = store;
  store_ = std::make_unique<C10dStore>(store, timeout);
  try {
    groupStore_ = std::make_unique<PrefixStore>(*store_, freshNamespace(*store_, rank, size, timeout));
    bootstrap_ = std::make_unique<BootstrapStore>(*groupStore_);
    comm_ = settingUp(*groupStore_,
                      [&] { return std::make_unique<algo::Communicator>(*bootstrap_, rank, size, timeout); });
  } catch (const Error& e) {
    std::rethrow_exception(toTorchError(e, rank));
  }
  handOffLinger_ = handOffLinger(comm_->machineShare());
  progress_ = std::make_shared<engine::ProgressThread>("smddp-r" + std::to_string(rank), handOffLinger_);
  // A blocking point-to-point wait runs its engine on the caller's thread: no second thread of
  // this rank is busy meanwhile, so the engines keep the plain linger budget.
  const std::chrono::microseconds p2pLinger = lingerBudget(comm_->machineShare());
  if (comm_->topology().localSize() > 1) {
    p2p_ = std::make_shared<engine::P2pEngine>(comm_->domain(), p2pLinger,
                                               engine::P2pEngine::singleCopyBytesFor(comm_->machineShare()),
                                               "smddp-p2p" + std::to_string(rank));
  }
  if (comm_->multiHost()) {
    try {
      netP2p_ = std::make_shared<engine::NetP2p>(*bootstrap_, comm_->topology(), comm_->netAddresses(),
                                                 comm_->netLanes(), p2pLinger, "smddp-np2p" + std::to_string(rank));
    } catch (const Error& e) {
      bootstrap_->publishFailure(engine::NetP2p::keysOwedBy(rank), rank, e.what());
      std::rethrow_exception(toTorchError(e, rank));
    }
  }
  stallInterval_ = std::chrono::milliseconds(env::desyncCheckMs());
  if (size > 1 && stallInterval_.count() > 0) {
    // The group's store itself (thread-safe), not bootstrap_, whose record of its keys is not.
    engine::StallBoard board;
    board.interval = stallInterval_;
    board.post = [store = groupStore_.get(), rank](const std::string& what) {
      try {
        algo::DesyncProbe::postP2p(*store, rank, what);
      } catch (const Error& e) {  // the wait goes on without it
        SMDDP_INFO(kColl, "rank %d: could not post where point-to-point waits: %s", rank, e.what());
      }
    };
    board.whereIs = [store = groupStore_.get(), interval = stallInterval_](int peer) {
      return algo::DesyncProbe::whereIs(*store, peer, interval);
    };
    if (p2p_) p2p_->setStallBoard(board);
    if (netP2p_) netP2p_->setStallBoard(board);
  }
  SMDDP_INFO(kInit, "rank %d/%d: process group ready", rank, size);
}

SmddpBackend::~SmddpBackend() {
  if (inForkedChild()) {
    abandonInForkedChild();
    return;
  }
  shutdown();
}

void SmddpBackend::abandonInForkedChild() {
  // Joining the progress thread would wait forever for a thread that is not in this process;
  // closing the connections with a farewell would shut them down for the parent too. Left
  // alone, they go with the child: its exit only drops its references to them.
  (void)c10dStore_.release();
  (void)store_.release();
  (void)groupStore_.release();
  (void)bootstrap_.release();
  (void)comm_.release();
  new std::shared_ptr<engine::ProgressThread>(std::move(progress_));
  new std::shared_ptr<engine::P2pEngine>(std::move(p2p_));
  new std::shared_ptr<engine::NetP2p>(std::move(netP2p_));
  new std::shared_ptr<CudaPath>(std::move(cuda_));
}

void SmddpBackend::throwIfForked(const char* op) const {
  if (inForkedChild()) TORCH_CHECK(false, "smddp rank ", rank_, ": ", opName(op), ": ", forkedWhy(ownerPid_));
}

void SmddpBackend::shutdown() {
  if (inForkedChild()) return;  // the parent's group: see the destructor
  std::call_once(shutdownOnce_, [this] {
    {
      std::lock_guard<std::recursive_mutex> lock(cudaMutex_);
      if (cuda_) cuda_->abort();  // no stream stays parked on a host that stopped
    }
    if (comm_) comm_->abort();
    if (p2p_) p2p_->abort();
    if (netP2p_) netP2p_->abort();
    if (progress_) progress_->stop();
    if (comm_) comm_->stopHelpers();
    // Joined and closed now, kept until the group is destroyed (p2p_ before the domain it uses):
    // a send or recv issued after this, on another thread too, fails in their submit().
    if (p2p_) p2p_->shutdown();
    if (netP2p_) netP2p_->shutdown();  // a Work may still hold it: its sockets and thread go now
  });
}

c10::intrusive_ptr<c10d::Backend::Options> SmddpBackend::getBackendOptions() {
  return c10::make_intrusive<Options>(getBackendName(), std::chrono::milliseconds(timeoutMs_.load()));
}

std::map<std::string, std::string> SmddpBackend::topologySummary() const {
  const Topology& t = comm_->topology();
  std::map<std::string, std::string> info = {{"hosts", std::to_string(t.hosts())},
                                              {"host", std::to_string(t.host())},
                                              {"local_rank", std::to_string(t.localRank())},
                                              {"local_size", std::to_string(t.localSize())},
                                              {"transport", comm_->multiHost() ? "shm+tcp" : "shm"},
                                              {"machine_ranks", std::to_string(comm_->machineShare().ranks)},
                                              {"machine_cpus", std::to_string(comm_->machineShare().cpus)},
                                              {"wait_spin_us", std::to_string(comm_->domain()->spin().count())},
                                              {"linger_us", std::to_string(handOffLinger_.count())}};
  const size_t singleCopy = comm_->singleCopyBytes();
  info["allgather_single_copy"] = singleCopy != SIZE_MAX ? "from " + std::to_string(singleCopy) + " bytes"
                                  : comm_->singleCopyBytesSetting() == SIZE_MAX ? "off"
                                  : t.localSize() == 1 ? "off (no host-mates)"
                                                       : "off (a rank may not read its host-mates' memory)";
  if (p2p_) {
    // Whether messages to this rank from its host-mates may be read from their memory, and from what size.
    const bool reads = comm_->domain()->readsPeers(t.localRank());
    info["p2p_single_copy"] = p2p_->singleCopyBytes() == SIZE_MAX ? "off"
                              : reads ? "from " + std::to_string(p2p_->singleCopyBytes()) + " bytes"
                                      : "off (this rank may not read its host-mates' memory)";
  }
  if (comm_->multiHost()) {
    info["net_address"] = net::interfaceAddresses(comm_->netAddresses());  // one per interface
    info["net_interface"] = net::interfaceNames(comm_->netAddresses());
    info["tcp_connections"] = std::to_string(comm_->netConnections());
    info["p2p_connections"] = std::to_string(netP2p_->connections());
  }
  return info;
}

c10::intrusive_ptr<c10d::Backend> SmddpBackend::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::vector<int>& ranks,
                                                     const c10::intrusive_ptr<Options>& opts) {
  throwIfForked("split");
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end()) return nullptr;
  // torch splits once per device type, and this backend serves both cpu and cuda: the second
  // call (same store, same ranks) must get the same child, or two children would bootstrap over
  // the same store keys.
  std::lock_guard<std::mutex> lock(splitMutex_);
  if (lastSplitStore_ == store.get() && lastSplitRanks_ == ranks) {
    if (auto child = lastSplit_.lock()) return child;
  }
  const auto timeout = opts ? opts->timeout : std::chrono::milliseconds(timeoutMs_.load());
  std::vector<int64_t> childGlobalRanks;
  for (int r : ranks) childGlobalRanks.push_back(globalRanks_.at(r));
  auto child = c10::make_intrusive<SmddpBackend>(store, static_cast<int>(it - ranks.begin()),
                                                 static_cast<int>(ranks.size()), timeout, childGlobalRanks);
  lastSplitStore_ = store.get();
  lastSplitRanks_ = ranks;
  lastSplit_ = c10::weak_intrusive_ptr<c10d::Backend>(c10::intrusive_ptr<c10d::Backend>(child));
  return child;
}

c10::intrusive_ptr<c10d::Backend> SmddpBackend::shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                                      const c10::intrusive_ptr<Options>& optsOverride) {
  throwIfForked("shrink");
  // torch.distributed.shrink_group checks the same; a direct call on the backend may not have.
  const auto refuse = [&](const std::string& why) {
    TORCH_CHECK_VALUE(false, "smddp rank ", rank_, ": shrink: ", why);
  };
  std::vector<bool> excluded(size_, false);
  for (int64_t r : ranksToExclude) {
    if (r < 0 || r >= size_) refuse(c10::str("rank ", r, " to exclude is not in this group of ", size_, " ranks"));
    if (excluded[r]) refuse(c10::str("rank ", r, " is listed twice"));
    if (r == rank_) refuse("this rank is among the ranks to exclude: only the remaining ranks call shrink");
    excluded[r] = true;
  }
  if (ranksToExclude.empty()) refuse("no rank to exclude");
  if (shrinkFlags & ~1) refuse(c10::str("unknown shrink_flags ", shrinkFlags, " (SHRINK_DEFAULT 0, SHRINK_ABORT 1)"));
  if (shrinkFlags & 1) abort();

  std::vector<int64_t> childGlobalRanks;
  int childRank = 0;
  std::string prefix = "smddp-shrink" + std::to_string(shrinks_++) + "-excluding";
  for (int r = 0; r < size_; ++r) {
    if (excluded[r]) {
      prefix += "-" + std::to_string(r);
      continue;
    }
    if (r < rank_) ++childRank;
    childGlobalRanks.push_back(globalRanks_[r]);
  }
  const auto timeout = optsOverride ? optsOverride->timeout : std::chrono::milliseconds(timeoutMs_.load());
  SMDDP_INFO(kInit, "rank %d/%d: shrinking to %zu ranks (%s), this rank becomes %d", rank_, size_,
             childGlobalRanks.size(), prefix.c_str(), childRank);
  try {
    return c10::make_intrusive<SmddpBackend>(c10::make_intrusive<c10d::PrefixStore>(prefix + "/", c10dStore_),
                                             childRank, static_cast<int>(childGlobalRanks.size()), timeout,
                                             childGlobalRanks);
  } catch (const c10::DistBackendError& e) {
    // The set-up's error names ranks of the new group; the caller knows this group's.
    std::string why = e.what_without_backtrace();
    const std::string named = "smddp rank " + std::to_string(childRank) + ": ";
    if (why.rfind(named, 0) == 0) why.erase(0, named.size());
    std::string remaining;
    constexpr int kNamed = 16;  // a large group's list would bury the cause
    for (int r = 0, k = 0; r < size_; ++r) {
      if (excluded[r]) continue;
      if (k < kNamed) remaining += c10::str(k ? ", " : "", r, " (now ", k, ")");
      if (++k == kNamed + 1) remaining += ", ...";
    }
    C10_THROW_ERROR(DistBackendError,
                    c10::str("smddp rank ", rank_, ": shrink: the group of ranks ", remaining,
                             " did not form: ", why,
                             ". Every remaining rank must call shrink with the same ranks to exclude: ranks "
                             "that exclude others wait for each other in vain"));
  }
}

SmddpBackend::Body SmddpBackend::describedBody(c10d::OpType opType, const char* title, const Tensors& outputs,
                                              const Tensors& inputs, Body body) const {
  if (!debugChecks_) return body;
  // Only what every rank must agree on: list ops may have per-rank sizes (uneven all_gather and
  // all_to_all, gather/scatter lists on the root only), so their shapes stay out.
  bool outShapes = false, inShapes = false;
  switch (opType) {
    case c10d::OpType::ALLGATHER:
    case c10d::OpType::ALLGATHER_COALESCED: outShapes = true; break;
    case c10d::OpType::REDUCE_SCATTER: inShapes = true; break;
    case c10d::OpType::GATHER:
    case c10d::OpType::SCATTER:
    case c10d::OpType::ALLTOALL:
    case c10d::OpType::ALLTOALL_BASE: break;
    default: outShapes = inShapes = true;
  }
  std::ostringstream text;
  text << opName(title) << "(";
  const at::Tensor* first = !outputs.empty() ? &outputs[0] : (!inputs.empty() ? &inputs[0] : nullptr);
  if (first) text << first->scalar_type() << " on " << first->device().type();
  auto shapes = [&](const char* what, const Tensors& ts) {
    text << ", " << what << " " << ts.size() << " x [";
    for (size_t i = 0; i < ts.size(); ++i) text << (i ? " " : "") << ts[i].sizes();
    text << "]";
  };
  if (outShapes) shapes("outputs", outputs);
  if (inShapes) shapes("inputs", inputs);
  text << ")";
  return [text = text.str(), body = std::move(body)](algo::Communicator& c, std::chrono::milliseconds to) {
    c.describeNextOps(text);
    body(c, to);
  };
}

std::chrono::milliseconds SmddpBackend::resolveTimeout(std::chrono::milliseconds requested) const {
  return requested == c10d::kUnsetTimeout ? std::chrono::milliseconds(timeoutMs_.load()) : requested;
}

c10::intrusive_ptr<SmddpWork> SmddpBackend::newWork(c10d::OpType opType, const char* title, Tensors outputs,
                                                     Tensors inputs, std::chrono::milliseconds timeout,
                                                     P2pPeer peer) {
  const bool p2p = opType == c10d::OpType::SEND || opType == c10d::OpType::RECV || opType == c10d::OpType::RECVANYSOURCE;
  const int64_t traceId = FlightRecorder::get().record(pgId_, *this, p2p, title, inputs, outputs, timeout, peer);
  if (log::enabled(log::kInfo, p2p ? log::kP2p : log::kColl)) logIssue(p2p, opType, title, outputs, inputs, peer);
  auto work = c10::make_intrusive<SmddpWork>(rank_, opType, title, std::move(outputs),
                                             std::optional<Tensors>(std::move(inputs)), handOffLinger_);
  work->setTrace(pgId_, traceId);
  return work;
}

void SmddpBackend::logIssue(bool p2p, c10d::OpType opType, const char* title, const Tensors& outputs,
                            const Tensors& inputs, P2pPeer peer) const {
  std::ostringstream what;
  if (opType == c10d::OpType::SEND) {
    what << "send to rank " << peer.rank << ", tag " << peer.tag;
  } else if (p2p) {
    what << "recv from " << (peer.rank >= 0 ? "rank " + std::to_string(peer.rank) : "any rank") << ", tag "
         << peer.tag;
  } else {
    what << opName(title) << " #" << issued_.load();  // as getSequenceNumberForGroup() counts
  }
  const std::string tensors = describeTensors(inputs, outputs, p2p);
  log::write(log::kInfo, p2p ? log::kP2p : log::kColl, __FILE__, __LINE__, "rank %d/%d, group %s (%s): %s: %s",
             rank_, size_, getGroupUid().c_str(), getGroupDesc().c_str(), what.str().c_str(), tensors.c_str());
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::enqueue(c10d::OpType opType, const char* title,
                                                     std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
                                                     std::chrono::milliseconds timeout, bool async, Body body) {
  throwIfForked(title);
  if (Work staged = divertToCuda(opType, title, timeout, body)) return staged;
  throwIfCudaFailed(title);
  issued_.fetch_add(1);
  body = describedBody(opType, title, outputs, inputs, std::move(body));
  auto work = newWork(opType, title, std::move(outputs), std::move(inputs), timeout);
  algo::Communicator* comm = comm_.get();
  const int rank = rank_;
  auto task = [work, comm, rank, size = size_, title, timeout, body = std::move(body)]() {
    std::exception_ptr error;
    work->traceStarted();
    try {
      body(*comm, timeout);
    } catch (...) {
      error = bodyError(*comm, rank, size, title);
    }
    work->complete(error);
  };
  work->setRunner(progress_);
  // A blocking call (async_op=False) is waited at once: when the group is idle, running it here
  // saves two thread hand-offs, which dominate small-message latency.
  if (!async && progress_->tryRunInline(task)) return work;
  try {
    progress_->enqueue(std::move(task));
  } catch (const std::logic_error& e) {
    C10_THROW_ERROR(DistBackendError,
                    c10::str("smddp rank ", rank_, ": ", opName(title), ": the process group has been shut down"));
  }
  return work;
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = single(tensors, rank_, "allreduce");
  if (Tensors reals = complexAsReals(tensors, opts.reduceOp, rank_, "allreduce"); !reals.empty()) {
    return allreduce(reals, opts);  // a caller of the ProcessGroup itself (torch's all_reduce converts)
  }
  if (t.defined() && t.layout() == at::kSparse) {
    return enqueue(c10d::OpType::ALLREDUCE, "smddp:all_reduce", tensors, tensors, resolveTimeout(opts.timeout),
                   opts.asyncOp, sparseAllreduce(t, opts.reduceOp, rank_, size_, sparseScratch_));
  }
  const DataType dtype = checkTensor(t, rank_, "allreduce");
  const Reduction red = toReduction(opts.reduceOp, dtype, size_, rank_, "allreduce");
  if (isCudaOp(tensors, "allreduce")) {
    return cudaFlat(c10d::OpType::ALLREDUCE, "smddp:all_reduce", tensors, resolveTimeout(opts.timeout),
                    {{t, true, true, [dtype, red](algo::Communicator& c, std::chrono::milliseconds to, void* p, size_t n) {
                        c.allreduce({dtype, red, n, p, p, -1}, to);
                      }}});
  }
  Staged s = stageInOut(t, rank_, "allreduce");
  return enqueue(c10d::OpType::ALLREDUCE, "smddp:all_reduce", tensors, tensors, resolveTimeout(opts.timeout), opts.asyncOp,
                 [s, dtype, red](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   s.ready();
                   void* p = s.work.data_ptr();
                   c.allreduce({dtype, red, static_cast<size_t>(s.work.numel()), p, p, -1}, to);
                   finishStaged(s);
                 });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                 const c10d::AllreduceCoalescedOptions& opts) {
  if (Tensors reals = complexAsReals(tensors, opts.reduceOp, rank_, "allreduce_coalesced"); !reals.empty()) {
    return allreduce_coalesced(reals, opts);
  }
  std::vector<Staged> staged;
  std::vector<std::pair<DataType, Reduction>> kinds;
  for (const at::Tensor& t : tensors) {
    const DataType dtype = checkTensor(t, rank_, "allreduce_coalesced");
    kinds.emplace_back(dtype, toReduction(opts.reduceOp, dtype, size_, rank_, "allreduce_coalesced"));
  }
  if (isCudaOp(tensors, "allreduce_coalesced")) {
    std::vector<FlatPart> parts;
    for (size_t i = 0; i < tensors.size(); ++i) {
      parts.push_back({tensors[i], true, true,
                       [kind = kinds[i]](algo::Communicator& c, std::chrono::milliseconds to, void* p, size_t n) {
                         c.allreduce({kind.first, kind.second, n, p, p, -1}, to);
                       }});
    }
    return cudaFlat(c10d::OpType::ALLREDUCE_COALESCED, "smddp:all_reduce_coalesced", tensors,
                    resolveTimeout(opts.timeout), std::move(parts));
  }
  // Runs of small tensors of one dtype are reduced as one flat tensor: a reduction costs a round
  // of synchronisation, which dwarfs copying a small tensor in and out (gloo flattens every list).
  const std::vector<CoalescedItem> items = planCoalesced(tensors, coalescePackBytes());
  // Reduced in place after an earlier tensor of the list that shares its memory, a tensor would
  // reduce that one's results again: it reduces a copy of its values as they are when the op
  // starts instead, and writes its result back (the same values there), as gloo's flattening does.
  // (Packed tensors are copied as the op starts anyway.)
  const std::vector<bool> shares = sharesWithEarlier(tensors);
  for (size_t i = 0; i < tensors.size(); ++i) {
    Staged s = stageInOut(tensors[i], rank_, "allreduce_coalesced");
    if (!s.copyBack && shares[i]) s = {tensors[i], Staged::Way::kCopyIn, true};
    staged.push_back(std::move(s));
  }
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, "smddp:all_reduce_coalesced", tensors, tensors,
                 resolveTimeout(opts.timeout), opts.asyncOp,
                 [staged, kinds, items, rank = rank_](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   // Every input is read before any result is written (a packed tensor may share
                   // memory with another of the list).
                   std::vector<at::Tensor> flats(items.size());
                   locally(rank, "all_reduce_coalesced", "copying the tensors as the op starts", [&] {
                     for (size_t k = 0; k < items.size(); ++k) {
                       if (items[k].count == 1) {
                         staged[items[k].first].ready();
                       } else {
                         flats[k] = packCoalesced(staged, items[k]);
                       }
                     }
                   });
                   for (size_t k = 0; k < items.size(); ++k) {
                     const CoalescedItem& item = items[k];
                     const auto [dtype, red] = kinds[item.first];
                     at::Tensor& work = item.count == 1 ? staged[item.first].work : flats[k];
                     void* p = work.data_ptr();
                     c.allreduce({dtype, red, static_cast<size_t>(work.numel()), p, p, -1}, to);
                     if (item.count == 1) {
                       finishStaged(staged[item.first]);
                     } else {
                       unpackCoalesced(staged, item, flats[k]);
                     }
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::reduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::ReduceOptions& opts) {
  const at::Tensor& t = single(tensors, rank_, "reduce");
  if (Tensors reals = complexAsReals(tensors, opts.reduceOp, rank_, "reduce"); !reals.empty()) {
    return reduce(reals, opts);
  }
  const DataType dtype = checkTensor(t, rank_, "reduce");
  const Reduction red = toReduction(opts.reduceOp, dtype, size_, rank_, "reduce");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < size_, "smddp rank ", rank_, ": reduce: root ", root,
                    " is not a rank of this group of size ", size_);
  if (isCudaOp(tensors, "reduce")) {  // only the root's tensor changes, as with NCCL
    return cudaFlat(c10d::OpType::REDUCE, "smddp:reduce", tensors, resolveTimeout(opts.timeout),
                    {{t, true, rank_ == root,
                      [dtype, red, root](algo::Communicator& c, std::chrono::milliseconds to, void* p, size_t n) {
                        c.allreduce({dtype, red, n, p, p, root}, to);
                      }}});
  }
  Staged s = rank_ == root ? stageInOut(t, rank_, "reduce") : stageIn(t);
  return enqueue(c10d::OpType::REDUCE, "smddp:reduce", tensors, tensors, resolveTimeout(opts.timeout), opts.asyncOp,
                 [s, dtype, red, root](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   s.ready();
                   void* p = s.work.data_ptr();
                   c.allreduce({dtype, red, static_cast<size_t>(s.work.numel()), p, p, root}, to);
                   finishStaged(s);
                 });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = single(tensors, rank_, "broadcast");
  const DataType dtype = checkMovedTensor(t, rank_, "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < size_, "smddp rank ", rank_, ": broadcast: root ", root,
                    " is not a rank of this group of size ", size_);
  if (isCudaOp(tensors, "broadcast")) {
    return cudaFlat(c10d::OpType::BROADCAST, "smddp:broadcast", tensors, resolveTimeout(opts.timeout),
                    {{t, rank_ == root, rank_ != root,
                      [dtype, root](algo::Communicator& c, std::chrono::milliseconds to, void* p, size_t n) {
                        c.broadcast({dtype, n, p, root}, to);
                      }}});
  }
  Staged s = rank_ == root ? stageIn(t) : stageOut(t, rank_, "broadcast");
  return enqueue(c10d::OpType::BROADCAST, "smddp:broadcast", tensors, tensors, resolveTimeout(opts.timeout), opts.asyncOp,
                 [s, dtype, root](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   s.ready();
                   c.broadcast({dtype, static_cast<size_t>(s.work.numel()), s.work.data_ptr(), root}, to);
                   finishStaged(s);
                 });
}

namespace {
// An all-gather into a list of per-rank outputs (sizes may differ per rank, as gloo allows).
struct ListGather {
  std::vector<Staged> staged;
  std::vector<size_t> counts;
  Staged in;
  DataType dtype;
};

ListGather prepareListGather(const std::vector<at::Tensor>& outs, const at::Tensor& in, int rank, int size,
                             const char* op) {
  const DataType dtype = checkMovedTensor(in, rank, op);
  ListGather g{{}, {}, stageIn(in), dtype};
  TORCH_CHECK_VALUE(static_cast<int>(outs.size()) == size, "smddp rank ", rank, ": ", op, ": the output list has ",
                    outs.size(), " tensors but the group has ", size, " ranks");
  for (const at::Tensor& o : outs) {
    checkMovedTensor(o, rank, op);
    checkSameType(o, in, rank, op);
    g.staged.push_back(stageOut(o, rank, op));
    g.counts.push_back(static_cast<size_t>(o.numel()));
  }
  TORCH_CHECK_VALUE(g.counts[rank] == static_cast<size_t>(in.numel()), "smddp rank ", rank, ": ", op, ": output ",
                    rank, " has ", g.counts[rank], " elements but the input has ", in.numel());
  // Pieces are written while the input is still being staged chunk by chunk: an input that
  // overlaps an output (other than being exactly this rank's own output) goes through a copy.
  for (int p = 0; p < size; ++p) {
    const Staged& o = g.staged[p];
    if (overlaps(g.in, o) && !(p == rank && o.user.data_ptr() == g.in.user.data_ptr())) {
      g.in.copyAtStart();
      break;
    }
  }
  return g;
}

void runListGather(algo::Communicator& c, ListGather& g, std::chrono::milliseconds to) {
  g.in.ready();
  ready(g.staged);
  algo::AllgatherOptions o{g.dtype, g.in.work.data_ptr(), {}, g.counts};
  for (const Staged& s : g.staged) o.outputs.push_back(s.work.data_ptr());
  c.allgather(o, to);
  for (const Staged& s : g.staged) finishStaged(s);
}
}  // namespace

c10::intrusive_ptr<c10d::Work> SmddpBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllgatherOptions& opts) {
  const at::Tensor& in = single(inputs, rank_, "allgather");
  TORCH_CHECK_VALUE(outputs.size() == 1, "smddp rank ", rank_, ": allgather takes one output list, got ",
                    outputs.size());
  checkMovedTensor(in, rank_, "allgather");
  std::vector<at::Tensor>& outs = outputs[0];
  if (isCudaOp(concat({in}, outs), "allgather")) {
    return cudaWhole("allgather", {in}, outs, [&](const Tensors& hostIn, const Tensors& hostOut) {
      std::vector<std::vector<at::Tensor>> o{hostOut};
      Tensors i = hostIn;
      return allgather(o, i, opts);
    });
  }
  ListGather g = prepareListGather(outs, in, rank_, size_, "allgather");
  return enqueue(c10d::OpType::ALLGATHER, "smddp:all_gather", outs, inputs, resolveTimeout(opts.timeout), opts.asyncOp,
                 [g](algo::Communicator& c, std::chrono::milliseconds to) mutable { runListGather(c, g, to); });
}

// all_gather_coalesced: outputLists[r][i] receives rank r's inputs[i]; one list all-gather per
// input, all in one op.
c10::intrusive_ptr<c10d::Work> SmddpBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(static_cast<int>(outputLists.size()) == size_, "smddp rank ", rank_,
                    ": allgather_coalesced: got ", outputLists.size(), " output lists but the group has ", size_,
                    " ranks");
  Tensors outs;  // rank-major: rank r's outputs for every input, then rank r + 1's
  for (const std::vector<at::Tensor>& list : outputLists) {
    TORCH_CHECK_VALUE(list.size() == inputs.size(), "smddp rank ", rank_, ": allgather_coalesced: an output list has ",
                      list.size(), " tensors for ", inputs.size(), " inputs");
    outs.insert(outs.end(), list.begin(), list.end());
  }
  for (const at::Tensor& in : inputs) checkMovedTensor(in, rank_, "allgather_coalesced");
  if (isCudaOp(concat(inputs, outs), "allgather_coalesced")) {
    return cudaWhole("allgather_coalesced", inputs, outs, [&](const Tensors& hostIn, const Tensors& hostOut) {
      std::vector<std::vector<at::Tensor>> lists;
      for (size_t r = 0; r < outputLists.size(); ++r) {
        lists.emplace_back(hostOut.begin() + r * inputs.size(), hostOut.begin() + (r + 1) * inputs.size());
      }
      Tensors i = hostIn;
      return allgather_coalesced(lists, i, opts);
    });
  }
  std::vector<ListGather> gathers;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<at::Tensor> perRank;
    for (const std::vector<at::Tensor>& list : outputLists) perRank.push_back(list[i]);
    gathers.push_back(prepareListGather(perRank, inputs[i], rank_, size_, "allgather_coalesced"));
  }
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, "smddp:all_gather_coalesced", outs, inputs,
                 resolveTimeout(opts.timeout), opts.asyncOp,
                 [gathers](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   for (ListGather& g : gathers) runListGather(c, g, to);
                 });
}

namespace {
// The flat all-gather shared by _allgather_base and the coalesced form. The output may be shaped
// [world * n, ...] or [world, n, ...]: only the element count matters, as with NCCL.
struct FlatGather {
  Staged out;
  Staged in;
  DataType dtype;
};

DataType checkFlatGather(const at::Tensor& output, const at::Tensor& input, int rank, int size, const char* op) {
  const DataType dtype = checkMovedTensor(input, rank, op);
  checkMovedTensor(output, rank, op);
  checkSameType(output, input, rank, op);
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size, "smddp rank ", rank, ": ", op, ": the output has ",
                    output.numel(), " elements but must have world size (", size, ") x input (", input.numel(),
                    ") = ", input.numel() * size);
  return dtype;
}

FlatGather prepareFlatGather(const at::Tensor& output, const at::Tensor& input, int rank, int size, const char* op) {
  FlatGather g{stageOut(output, rank, op), stageIn(input), checkFlatGather(output, input, rank, size, op)};
  // The input may be this rank's own slice of the output (FSDP2); any other overlap would be
  // overwritten while still being read, so go through a copy.
  if (overlaps(g.in, g.out) && bytePtr(g.in.user) != bytePtr(g.out.user) + static_cast<size_t>(rank) * g.in.user.nbytes()) {
    g.in.copyAtStart();
  }
  return g;
}

void runFlatGather(algo::Communicator& c, FlatGather& g, int size, std::chrono::milliseconds to) {
  g.in.ready();
  g.out.ready();
  const size_t n = static_cast<size_t>(g.in.work.numel());
  algo::AllgatherOptions o{g.dtype, g.in.work.data_ptr(), {}, std::vector<size_t>(size, n)};
  for (int p = 0; p < size; ++p) o.outputs.push_back(bytePtr(g.out.work) + p * g.in.work.nbytes());
  c.allgather(o, to);
  finishStaged(g.out);
}

// One item of a coalesced all-gather's plan: a gather alone, or several small ones of one dtype
// as one all-gather: this rank's inputs, one after another, are its block of a flat buffer of
// every rank's (all inputs are read before any output is written); each output then takes its
// part of every rank's block.
void runGatherItem(algo::Communicator& c, std::vector<FlatGather>& gathers, const CoalescedItem& item, int rank,
                   int size, std::chrono::milliseconds to) {
  if (item.count == 1) return runFlatGather(c, gathers[item.first], size, to);
  const auto run = [&] { return std::span<FlatGather>(gathers).subspan(item.first, item.count); };
  size_t block = 0;
  for (const FlatGather& g : run()) block += g.in.user.nbytes();
  at::Tensor flat = at::empty({static_cast<int64_t>(block) * size}, at::kByte);
  uint8_t* mine = bytePtr(flat) + rank * block;
  for (FlatGather& g : run()) {
    copyToBytes(mine, g.in.user);
    mine += g.in.user.nbytes();
  }
  const size_t count = block / gathers[item.first].in.user.element_size();
  algo::AllgatherOptions o{gathers[item.first].dtype, bytePtr(flat) + rank * block, {}, std::vector<size_t>(size, count)};
  for (int p = 0; p < size; ++p) o.outputs.push_back(bytePtr(flat) + p * block);
  c.allgather(o, to);
  size_t offset = 0;
  for (FlatGather& g : run()) {
    g.out.ready();
    const size_t part = g.in.user.nbytes();
    for (int p = 0; p < size; ++p) std::memcpy(bytePtr(g.out.work) + p * part, bytePtr(flat) + p * block + offset, part);
    finishStaged(g.out);
    offset += part;
  }
}
}  // namespace

c10::intrusive_ptr<c10d::Work> SmddpBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                             const c10d::AllgatherOptions& opts) {
  if (isCudaOp({output, input}, "all_gather_into_tensor")) {
    const DataType dtype = checkFlatGather(output, input, rank_, size_, "all_gather_into_tensor");
    return cudaColumns(c10d::OpType::_ALLGATHER_BASE, "smddp:all_gather_into_tensor", {output}, {input},
                       resolveTimeout(opts.timeout), true, {{input, output, dtype, {}}});
  }
  FlatGather g = prepareFlatGather(output, input, rank_, size_, "all_gather_into_tensor");
  const int size = size_;
  return enqueue(c10d::OpType::_ALLGATHER_BASE, "smddp:all_gather_into_tensor", {output}, {input},
                 resolveTimeout(opts.timeout), opts.asyncOp, [g, size](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   runFlatGather(c, g, size, to);
                 });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                             std::vector<at::Tensor>& inputs,
                                                                             const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "smddp rank ", rank_,
                    ": allgather_into_tensor_coalesced: got ", outputs.size(), " outputs for ", inputs.size(),
                    " inputs");
  if (isCudaOp(concat(outputs, inputs), "allgather_into_tensor_coalesced")) {
    std::vector<ColumnPart> parts;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const DataType dtype = checkFlatGather(outputs[i], inputs[i], rank_, size_, "allgather_into_tensor_coalesced");
      parts.push_back({inputs[i], outputs[i], dtype, {}});
    }
    return cudaColumns(c10d::OpType::COALESCED, "smddp:all_gather_into_tensor_coalesced", outputs, inputs,
                       resolveTimeout(opts.timeout), true, std::move(parts));
  }
  std::vector<FlatGather> gathers;
  for (size_t i = 0; i < inputs.size(); ++i) {
    gathers.push_back(prepareFlatGather(outputs[i], inputs[i], rank_, size_, "allgather_into_tensor_coalesced"));
  }
  // Runs of small tensors of one dtype go as one all-gather, as all_reduce_coalesced's do (one
  // dtype, so that ranks whose dtypes differ still fail as mismatched).
  const std::vector<CoalescedItem> items = planCoalesced(outputs, coalescePackBytes());
  return enqueue(c10d::OpType::COALESCED, "smddp:all_gather_into_tensor_coalesced", outputs, inputs,
                 resolveTimeout(opts.timeout), opts.asyncOp,
                 [gathers, items, rank = rank_, size = size_](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   for (const CoalescedItem& item : items) runGatherItem(c, gathers, item, rank, size, to);
                 });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& out = single(outputs, rank_, "reduce_scatter");
  TORCH_CHECK_VALUE(inputs.size() == 1, "smddp rank ", rank_, ": reduce_scatter takes one input list, got ",
                    inputs.size());
  if (Tensors reals = complexAsReals(concat({out}, inputs[0]), opts.reduceOp, rank_, "reduce_scatter");
      !reals.empty()) {
    Tensors o{reals[0]};
    std::vector<Tensors> i{Tensors(reals.begin() + 1, reals.end())};
    return reduce_scatter(o, i, opts);
  }
  const DataType dtype = checkTensor(out, rank_, "reduce_scatter");
  const Reduction red = toReduction(opts.reduceOp, dtype, size_, rank_, "reduce_scatter");
  const std::vector<at::Tensor>& ins = inputs[0];
  TORCH_CHECK_VALUE(static_cast<int>(ins.size()) == size_, "smddp rank ", rank_, ": reduce_scatter: the input list has ",
                    ins.size(), " tensors but the group has ", size_, " ranks");
  if (isCudaOp(concat({out}, ins), "reduce_scatter")) {
    for (const at::Tensor& b : ins) checkSameType(out, b, rank_, "reduce_scatter");
    return cudaWhole("reduce_scatter", ins, {out}, [&](const Tensors& hostIn, const Tensors& hostOut) {
      Tensors o = hostOut;
      std::vector<std::vector<at::Tensor>> i{hostIn};
      return reduce_scatter(o, i, opts);
    });
  }
  // Blocks may differ in size (block p is rank p's output; reduce_scatter_v), as NCCL allows.
  Staged s = stageOut(out, rank_, "reduce_scatter");
  std::vector<Staged> srcs = stageBlocks(ins, s, rank_, "reduce_scatter", /*uneven=*/true);
  std::vector<size_t> counts;
  for (const at::Tensor& t : ins) counts.push_back(static_cast<size_t>(t.numel()));
  if (std::all_of(counts.begin(), counts.end(), [&](size_t c) { return c == counts[0]; })) counts.clear();
  return enqueue(c10d::OpType::REDUCE_SCATTER, "smddp:reduce_scatter", outputs, ins, resolveTimeout(opts.timeout), opts.asyncOp,
                 [s, srcs, dtype, red, counts](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   s.ready();
                   ready(srcs);
                   algo::ReduceScatterOptions o{dtype, red, {}, s.work.data_ptr(), static_cast<size_t>(s.work.numel()),
                                                counts};
                   for (const Staged& t : srcs) o.inputs.push_back(t.work.data_ptr());
                   c.reduceScatter(o, to);
                   finishStaged(s);
                 });
}

namespace {
struct FlatScatter {
  Staged out;
  Staged in;
  DataType dtype;
  Reduction red;
};

// The checks of a flat reduce-scatter (dtype, sizes, reduce op), on CPU and CUDA alike.
std::pair<DataType, Reduction> checkFlatScatter(const at::Tensor& output, const at::Tensor& input,
                                                const c10d::ReduceOp& op, int rank, int size, const char* name) {
  const DataType dtype = checkTensor(input, rank, name);
  checkTensor(output, rank, name);
  checkSameType(output, input, rank, name);
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size, "smddp rank ", rank, ": ", name, ": the input has ",
                    input.numel(), " elements but must have world size (", size, ") x output (", output.numel(),
                    ") = ", output.numel() * size);
  return {dtype, toReduction(op, dtype, size, rank, name)};
}

FlatScatter prepareFlatScatter(const at::Tensor& output, const at::Tensor& input, const c10d::ReduceOp& op, int rank,
                               int size, const char* name) {
  const auto [dtype, red] = checkFlatScatter(output, input, op, rank, size, name);
  FlatScatter f{stageOut(output, rank, name), stageIn(input), dtype, red};
  // The output may be this rank's own block of the input (DeepSpeed ZeRO-3 passes a view of it):
  // that block is staged before the output is written. Any other overlap goes through a copy, as
  // another rank's block may still be read (a rank alone on its host sends its blocks straight
  // from the input) after the output is written.
  if (overlaps(f.in, f.out) &&
      bytePtr(f.out.user) != bytePtr(f.in.user) + static_cast<size_t>(rank) * f.out.user.nbytes()) {
    f.in.copyAtStart();
  }
  return f;
}

void runFlatScatter(algo::Communicator& c, FlatScatter& f, int size, std::chrono::milliseconds to) {
  f.in.ready();
  f.out.ready();
  const size_t n = static_cast<size_t>(f.out.work.numel());
  algo::ReduceScatterOptions o{f.dtype, f.red, {}, f.out.work.data_ptr(), n, {}};
  for (int p = 0; p < size; ++p) o.inputs.push_back(bytePtr(f.in.work) + p * f.out.work.nbytes());
  c.reduceScatter(o, to);
  finishStaged(f.out);
}

// One item of a coalesced reduce-scatter's plan: a reduce-scatter alone, or several small ones of
// one dtype as one: every input's block for rank p, one after another, make block p of a flat
// buffer (all inputs are read before any output is written), which is reduced into this rank's
// own block; each output then takes its part of it.
void runScatterItem(algo::Communicator& c, std::vector<FlatScatter>& scatters, const CoalescedItem& item, int rank,
                    int size, std::chrono::milliseconds to) {
  if (item.count == 1) return runFlatScatter(c, scatters[item.first], size, to);
  const auto run = [&] { return std::span<FlatScatter>(scatters).subspan(item.first, item.count); };
  size_t block = 0;
  for (const FlatScatter& f : run()) block += f.out.user.nbytes();
  at::Tensor flat = at::empty({static_cast<int64_t>(block) * size}, at::kByte);
  size_t offset = 0;
  for (FlatScatter& f : run()) {
    f.in.ready();  // contiguous (a copy of a strided input): its rank blocks are slices
    const size_t part = f.out.user.nbytes();
    for (int p = 0; p < size; ++p) std::memcpy(bytePtr(flat) + p * block + offset, bytePtr(f.in.work) + p * part, part);
    offset += part;
  }
  const FlatScatter& first = scatters[item.first];
  algo::ReduceScatterOptions o{first.dtype, first.red, {}, bytePtr(flat) + rank * block,
                               block / first.out.user.element_size(), {}};
  for (int p = 0; p < size; ++p) o.inputs.push_back(bytePtr(flat) + p * block);
  c.reduceScatter(o, to);
  offset = 0;
  for (FlatScatter& f : run()) {
    copyFromBytes(f.out.user, bytePtr(flat) + rank * block + offset);
    offset += f.out.user.nbytes();
  }
}
}  // namespace

c10::intrusive_ptr<c10d::Work> SmddpBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::ReduceScatterOptions& opts) {
  if (Tensors reals = complexAsReals({output, input}, opts.reduceOp, rank_, "reduce_scatter_tensor");
      !reals.empty()) {
    return _reduce_scatter_base(reals[0], reals[1], opts);
  }
  if (isCudaOp({output, input}, "reduce_scatter_tensor")) {
    const auto [dtype, red] = checkFlatScatter(output, input, opts.reduceOp, rank_, size_, "reduce_scatter_tensor");
    return cudaColumns(c10d::OpType::_REDUCE_SCATTER_BASE, "smddp:reduce_scatter_tensor", {output}, {input},
                       resolveTimeout(opts.timeout), false, {{output, input, dtype, red}});
  }
  FlatScatter f = prepareFlatScatter(output, input, opts.reduceOp, rank_, size_, "reduce_scatter_tensor");
  const int size = size_;
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "smddp:reduce_scatter_tensor", {output}, {input},
                 resolveTimeout(opts.timeout), opts.asyncOp, [f, size](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   runFlatScatter(c, f, size, to);
                 });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                             std::vector<at::Tensor>& inputs,
                                                                             const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "smddp rank ", rank_,
                    ": reduce_scatter_tensor_coalesced: got ", outputs.size(), " outputs for ", inputs.size(),
                    " inputs");
  if (Tensors reals = complexAsReals(concat(outputs, inputs), opts.reduceOp, rank_, "reduce_scatter_tensor_coalesced");
      !reals.empty()) {
    Tensors o(reals.begin(), reals.begin() + static_cast<ptrdiff_t>(outputs.size()));
    Tensors i(reals.begin() + static_cast<ptrdiff_t>(outputs.size()), reals.end());
    return reduce_scatter_tensor_coalesced(o, i, opts);
  }
  if (isCudaOp(concat(outputs, inputs), "reduce_scatter_tensor_coalesced")) {
    std::vector<ColumnPart> parts;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto [dtype, red] = checkFlatScatter(outputs[i], inputs[i], opts.reduceOp, rank_, size_,
                                                 "reduce_scatter_tensor_coalesced");
      parts.push_back({outputs[i], inputs[i], dtype, red});
    }
    return cudaColumns(c10d::OpType::COALESCED, "smddp:reduce_scatter_tensor_coalesced", outputs, inputs,
                       resolveTimeout(opts.timeout), false, std::move(parts));
  }
  std::vector<FlatScatter> scatters;
  for (size_t i = 0; i < inputs.size(); ++i) {
    scatters.push_back(
        prepareFlatScatter(outputs[i], inputs[i], opts.reduceOp, rank_, size_, "reduce_scatter_tensor_coalesced"));
  }
  // Runs of small tensors of one dtype go as one reduce-scatter, as all_reduce_coalesced's do.
  const std::vector<CoalescedItem> items = planCoalesced(inputs, coalescePackBytes());
  return enqueue(c10d::OpType::COALESCED, "smddp:reduce_scatter_tensor_coalesced", outputs, inputs,
                 resolveTimeout(opts.timeout), opts.asyncOp,
                 [scatters, items, rank = rank_, size = size_](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   for (const CoalescedItem& item : items) runScatterItem(c, scatters, item, rank, size, to);
                 });
}

namespace {
int checkRoot(int64_t root, int rank, int size, const char* op) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "smddp rank ", rank, ": ", op, ": root ", root,
                    " is not a rank of this group of size ", size);
  return static_cast<int>(root);
}
}  // namespace

c10::intrusive_ptr<c10d::Work> SmddpBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  const at::Tensor& in = single(inputs, rank_, "gather");
  const DataType dtype = checkMovedTensor(in, rank_, "gather");
  const int root = checkRoot(opts.rootRank, rank_, size_, "gather");
  const Tensors rootOuts = rank_ == root && outputs.size() == 1 ? outputs[0] : Tensors{};
  if (isCudaOp(concat({in}, rootOuts), "gather")) {
    return cudaWhole("gather", {in}, rootOuts, [&](const Tensors& hostIn, const Tensors& hostOut) {
      std::vector<std::vector<at::Tensor>> o;
      if (rank_ == root) o.push_back(hostOut);
      Tensors i = hostIn;
      return gather(o, i, opts);
    });
  }
  std::vector<Staged> staged;
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_, "smddp rank ", rank_,
                      ": gather: the root needs one output list of ", size_, " tensors");
    outs = outputs[0];
    for (const at::Tensor& o : outs) {
      checkMovedTensor(o, rank_, "gather");
      checkSameType(o, in, rank_, "gather");
      TORCH_CHECK_VALUE(o.numel() == in.numel(), "smddp rank ", rank_, ": gather: every output must have the input's ",
                        in.numel(), " elements, got one with ", o.numel());
      staged.push_back(stageOut(o, rank_, "gather"));
    }
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || outputs[0].empty(), "smddp rank ", rank_,
                      ": gather: only the root (rank ", root, ") takes an output list");
  }
  Staged src = stageIn(in);
  for (const Staged& s : staged) {
    if (overlaps(src, s)) {
      src.copyAtStart();
      break;
    }
  }
  const int size = size_;
  return enqueue(c10d::OpType::GATHER, "smddp:gather", outs, inputs, resolveTimeout(opts.timeout), opts.asyncOp,
                 [staged, src, dtype, root, size](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   src.ready();
                   ready(staged);
                   const size_t n = static_cast<size_t>(src.work.numel());
                   algo::AllgatherOptions o{dtype, src.work.data_ptr(), {}, std::vector<size_t>(size, n), root};
                   for (const Staged& s : staged) o.outputs.push_back(s.work.data_ptr());
                   c.allgather(o, to);
                   for (const Staged& s : staged) finishStaged(s);
                 });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::scatter(std::vector<at::Tensor>& outputs,
                                                     std::vector<std::vector<at::Tensor>>& inputs,
                                                     const c10d::ScatterOptions& opts) {
  const at::Tensor& out = single(outputs, rank_, "scatter");
  const DataType dtype = checkMovedTensor(out, rank_, "scatter");
  const int root = checkRoot(opts.rootRank, rank_, size_, "scatter");
  const Tensors rootIns = rank_ == root && inputs.size() == 1 ? inputs[0] : Tensors{};
  if (isCudaOp(concat({out}, rootIns), "scatter")) {
    return cudaWhole("scatter", rootIns, {out}, [&](const Tensors& hostIn, const Tensors& hostOut) {
      Tensors o = hostOut;
      std::vector<std::vector<at::Tensor>> i;
      if (rank_ == root) i.push_back(hostIn);
      return scatter(o, i, opts);
    });
  }
  Staged s = stageOut(out, rank_, "scatter");
  std::vector<Staged> srcs;
  Tensors ins;
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_, "smddp rank ", rank_,
                      ": scatter: the root needs one input list of ", size_, " tensors");
    srcs = stageBlocks(inputs[0], s, rank_, "scatter");
    ins = inputs[0];
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || inputs[0].empty(), "smddp rank ", rank_,
                      ": scatter: only the root (rank ", root, ") takes an input list");
  }
  return enqueue(c10d::OpType::SCATTER, "smddp:scatter", outputs, ins, resolveTimeout(opts.timeout), opts.asyncOp,
                 [s, srcs, dtype, root](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   s.ready();
                   ready(srcs);
                   algo::ScatterOptions o{dtype, {}, s.work.data_ptr(), static_cast<size_t>(s.work.numel()), root};
                   for (const Staged& t : srcs) o.inputs.push_back(t.work.data_ptr());
                   c.scatter(o, to);
                   finishStaged(s);
                 });
}

namespace {
// Element counts of the dim-0 blocks of `t`: `splits` rows each, or an even split when empty.
std::vector<size_t> blockCounts(const at::Tensor& t, const std::vector<int64_t>& splits, int rank, int size,
                                const char* what) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const int64_t rowElems = rows == 0 ? 0 : t.numel() / rows;
  std::vector<size_t> counts(size);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(rows % size == 0, "smddp rank ", rank, ": all_to_all_single: the ", what, "'s first dimension (",
                      rows, ") is not divisible by the group size (", size, ") and no split sizes were given");
    for (int p = 0; p < size; ++p) counts[p] = static_cast<size_t>(rows / size * rowElems);
    return counts;
  }
  TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == size, "smddp rank ", rank, ": all_to_all_single: ", what,
                    " split sizes have ", splits.size(), " entries for a group of ", size);
  int64_t sum = 0;
  for (int p = 0; p < size; ++p) {
    TORCH_CHECK_VALUE(splits[p] >= 0, "smddp rank ", rank, ": all_to_all_single: negative ", what, " split size");
    sum += splits[p];
    counts[p] = static_cast<size_t>(splits[p] * rowElems);
  }
  TORCH_CHECK_VALUE(sum == rows, "smddp rank ", rank, ": all_to_all_single: ", what, " split sizes add up to ", sum,
                    " but the ", what, " has ", rows, " rows");
  return counts;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> SmddpBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                           std::vector<int64_t>& outputSplitSizes,
                                                           std::vector<int64_t>& inputSplitSizes,
                                                           const c10d::AllToAllOptions& opts) {
  if (isCudaOp({output, input}, "all_to_all_single")) {
    return cudaWhole("all_to_all_single", {input}, {output}, [&](const Tensors& hostIn, const Tensors& hostOut) {
      at::Tensor o = hostOut[0], i = hostIn[0];
      return alltoall_base(o, i, outputSplitSizes, inputSplitSizes, opts);
    });
  }
  const DataType dtype = checkMovedTensor(input, rank_, "all_to_all_single");
  checkMovedTensor(output, rank_, "all_to_all_single");
  checkSameType(output, input, rank_, "all_to_all_single");
  const std::vector<size_t> inCounts = blockCounts(input, inputSplitSizes, rank_, size_, "input");
  const std::vector<size_t> outCounts = blockCounts(output, outputSplitSizes, rank_, size_, "output");
  Staged out = stageOut(output, rank_, "all_to_all_single");
  Staged in = stageIn(input);
  if (overlaps(in, out)) in.copyAtStart();
  const size_t es = input.element_size();
  return enqueue(c10d::OpType::ALLTOALL_BASE, "smddp:all_to_all_single", {output}, {input},
                 resolveTimeout(opts.timeout), opts.asyncOp,
                 [out, in, inCounts, outCounts, dtype, es, countsFirst = debugChecks_](
                     algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   out.ready();
                   in.ready();
                   algo::AlltoallOptions o{dtype, {}, inCounts, {}, outCounts, countsFirst};
                   size_t inOff = 0, outOff = 0;
                   for (size_t p = 0; p < inCounts.size(); ++p) {
                     o.inputs.push_back(bytePtr(in.work) + inOff * es);
                     o.outputs.push_back(bytePtr(out.work) + outOff * es);
                     inOff += inCounts[p];
                     outOff += outCounts[p];
                   }
                   c.alltoall(o, to);
                   finishStaged(out);
                 });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllToAllOptions& opts) {
  TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == size_ && static_cast<int>(inputs.size()) == size_,
                    "smddp rank ", rank_, ": all_to_all takes ", size_, " inputs and ", size_, " outputs, got ",
                    inputs.size(), " and ", outputs.size());
  if (isCudaOp(concat(outputs, inputs), "all_to_all")) {
    return cudaWhole("all_to_all", inputs, outputs, [&](const Tensors& hostIn, const Tensors& hostOut) {
      Tensors o = hostOut, i = hostIn;
      return alltoall(o, i, opts);
    });
  }
  const DataType dtype = checkMovedTensor(inputs[0], rank_, "all_to_all");
  std::vector<Staged> outs, ins;
  std::vector<size_t> inCounts, outCounts;
  for (int p = 0; p < size_; ++p) {
    checkMovedTensor(inputs[p], rank_, "all_to_all");
    checkMovedTensor(outputs[p], rank_, "all_to_all");
    checkSameType(outputs[p], inputs[0], rank_, "all_to_all");
    checkSameType(inputs[p], inputs[0], rank_, "all_to_all");
    outs.push_back(stageOut(outputs[p], rank_, "all_to_all"));
    ins.push_back(stageIn(inputs[p]));
    inCounts.push_back(static_cast<size_t>(inputs[p].numel()));
    outCounts.push_back(static_cast<size_t>(outputs[p].numel()));
  }
  for (Staged& i : ins) {
    for (const Staged& o : outs) {
      if (overlaps(i, o)) {
        i.copyAtStart();
        break;
      }
    }
  }
  return enqueue(c10d::OpType::ALLTOALL, "smddp:all_to_all", outputs, inputs, resolveTimeout(opts.timeout),
                 opts.asyncOp,
                 [outs, ins, inCounts, outCounts, dtype, countsFirst = debugChecks_](
                     algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   ready(outs);
                   ready(ins);
                   algo::AlltoallOptions o{dtype, {}, inCounts, {}, outCounts, countsFirst};
                   for (const Staged& t : ins) o.inputs.push_back(t.work.data_ptr());
                   for (const Staged& s : outs) o.outputs.push_back(s.work.data_ptr());
                   c.alltoall(o, to);
                   for (const Staged& s : outs) finishStaged(s);
                 });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(c10d::OpType::BARRIER, "smddp:barrier", {}, {}, resolveTimeout(opts.timeout), opts.asyncOp,
                 [](algo::Communicator& c, std::chrono::milliseconds to) { c.barrier(to); });
}

namespace {
// monitored_barrier's messages use tags no other op may: from INT_MIN on, one per call (its
// count, modulo 2^30), so a rank late for one call can never answer a later one. So they need no
// deadline either (P2pOp::background): one that nothing meets (a rank that never came) waits for
// its peer or the group's end, where an expired receive would break the pair for later messages.
constexpr int kMonitoredBarrierTags = std::numeric_limits<int>::min();
constexpr uint32_t kMonitoredBarrierTagSpan = 1u << 30;
// How much longer than rank 0 the other ranks wait: rank 0 answers once its own timeout has run
// out on a missing rank.
constexpr auto kMonitoredBarrierAnswerGrace = std::chrono::seconds(5);

// Waits up to `ms` for `work`: "" when it succeeded, the op's error when it failed, nullopt when
// the time ran out first.
std::optional<std::string> waitWithin(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds ms) {
  try {
    work->wait(std::max(ms, std::chrono::milliseconds(1)));  // 0 would mean no limit
    return std::string();
  } catch (const c10::Error& e) {
    if (!work->isCompleted()) return std::nullopt;
    return std::string(e.what_without_backtrace());
  }
}
}  // namespace

void SmddpBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  throwIfForked("monitored_barrier");
  using Clock = std::chrono::steady_clock;
  const std::chrono::milliseconds timeout = resolveTimeout(opts.timeout);
  const int tag = kMonitoredBarrierTags + static_cast<int>(monitoredBarriers_++ % kMonitoredBarrierTagSpan);
  if (size_ == 1) return;
  const auto start = Clock::now();
  auto left = [&](Clock::time_point deadline) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  };
  const std::string who = "smddp rank " + std::to_string(rank_) + ": monitored_barrier: ";
  const std::string within = "within " + std::to_string(timeout.count()) + " ms";
  const c10::SourceLocation loc{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
  // Rank 0's answer: one byte per rank, 1 for each rank that reached the barrier in time.
  const auto bytes = [](int64_t n) { return at::zeros({n}, at::TensorOptions().dtype(at::kByte)); };
  if (rank_ != 0) {
    std::vector<at::Tensor> token{bytes(1)}, answer{bytes(size_)};
    Work sent = p2p(true, token, 0, tag, true);
    Work answered = p2p(false, answer, 0, tag, true);
    for (const Work& w : {sent, answered}) {
      const std::optional<std::string> error = waitWithin(w, left(start + timeout + kMonitoredBarrierAnswerGrace));
      if (!error) {
        throw c10::DistBackendError(loc, who + "this rank reached it, but rank 0 did not answer " + within +
                                             " (and " + std::to_string(kMonitoredBarrierAnswerGrace.count()) +
                                             " s more); rank 0's own error names the ranks it missed");
      }
      if (!error->empty()) {
        throw c10::DistBackendError(loc, who + "this rank reached it, but its exchange with rank 0 failed: " + *error);
      }
    }
    const uint8_t* came = answer[0].data_ptr<uint8_t>();
    std::vector<int> missing;
    for (int r = 0; r < size_; ++r) {
      if (!came[r]) missing.push_back(r);
    }
    if (!missing.empty()) {
      throw c10::DistBackendError(loc, who + "rank 0 reports that rank(s) " + joinRanks(missing) +
                                           " did not reach it " + within);
    }
    return;
  }
  std::vector<std::vector<at::Tensor>> tokens(size_);
  std::vector<Work> arrivals(size_);
  for (int r = 1; r < size_; ++r) {
    tokens[r] = {bytes(1)};
    arrivals[r] = p2p(false, tokens[r], r, tag, true);
  }
  at::Tensor came = bytes(size_);
  uint8_t* cameBytes = came.data_ptr<uint8_t>();
  cameBytes[0] = 1;
  std::vector<int> missing;
  std::string causes;
  for (int r = 1; r < size_; ++r) {
    const std::optional<std::string> error = waitWithin(arrivals[r], left(start + timeout));
    if (error && error->empty()) {
      cameBytes[r] = 1;
      continue;
    }
    missing.push_back(r);
    if (error) {
      causes += "\n  rank " + std::to_string(r) + ": " + *error;
    } else {
      // A rank that stalls in an op of the group posts where it waits (stallInterval_).
      const std::string where =
          stallInterval_.count() > 0 ? algo::DesyncProbe::whereIs(*groupStore_, r, stallInterval_) : "";
      causes += "\n  rank " + std::to_string(r) + ": not heard from" + where;
    }
    if (!waitAllRanks) break;
  }
  if (!waitAllRanks && !missing.empty()) {
    // The ranks not waited for that have come all the same hear the outcome too.
    for (int r = missing.back() + 1; r < size_; ++r) {
      cameBytes[r] = arrivals[r]->isCompleted() && !arrivals[r]->exception();
    }
  }
  // Every rank that came gets the answer; on success rank 0 returns once they all have it.
  std::vector<Work> answers;
  for (int r = 1; r < size_; ++r) {
    if (!cameBytes[r]) continue;
    std::vector<at::Tensor> answer{came};
    answers.push_back(p2p(true, answer, r, tag, true));
  }
  if (!missing.empty()) {
    throw c10::DistBackendError(
        loc, who + "rank(s) " + joinRanks(missing) + " did not reach it " + within +
                 (waitAllRanks ? "" : " (the first one missed; wait_all_ranks=True waits for every rank)") + causes);
  }
  for (const Work& w : answers) w->wait();
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::p2p(bool isSend, std::vector<at::Tensor>& tensors, int peer, int tag,
                                                 bool background) {
  const char* op = isSend ? "send" : "recv";
  throwIfForked(op);
  const at::Tensor& t = single(tensors, rank_, op);
  checkMovedTensor(t, rank_, op);
  TORCH_CHECK_VALUE((peer == -1 && !isSend) || (peer >= 0 && peer < size_ && peer != rank_), "smddp rank ", rank_,
                    ": ", op,
                    ": peer ", peer, " is not another rank of this group of size ", size_);
  TORCH_CHECK_VALUE(size_ > 1, "smddp rank ", rank_, ": ", op, ": a group of one rank has no peer");
  if (isCudaOp(tensors, op)) return isSend ? cudaSend(t, peer, tag) : cudaRecv(t, peer, tag);
  // Posted at once (a send's data is read from here on): staged now.
  Staged s = isSend ? stageIn(t) : stageOut(t, rank_, op);
  s.ready();
  auto work = newWork(isSend ? c10d::OpType::SEND : c10d::OpType::RECV, isSend ? "smddp:send" : "smddp:recv", tensors,
                      tensors, std::chrono::milliseconds(timeoutMs_.load()), {peer, tag});
  work->traceStarted();  // posted: from here on it moves as soon as its peer is there
  engine::P2pOp o = p2pOp(isSend, peer, tag, s.work, background);
  const int rank = rank_;
  o.done = [work, s, rank, peer](std::exception_ptr error, int source) {
    error = asTorchError(error, rank);
    if (!error) {
      try {
        finishStaged(s);
      } catch (...) {
        error = std::current_exception();
      }
    }
    work->setSourceRank(peer >= 0 ? peer : source);
    work->complete(error);
  };
  if (isSend && sendsQueued_.load() > 0) {
    // A CUDA send issued earlier is still on its way to the engine (it waits for the device to
    // stage its data), or a send queued behind one: this one goes behind them, counted until it
    // reaches its engine, so that a send issued meanwhile does not overtake it either.
    auto submit = [this, o, queued = std::make_shared<QueuedSend>(sendsQueued_)]() mutable {
      try {
        submitP2p(o);
      } catch (...) {
        o.done(std::current_exception(), -1);
      }
    };
    try {
      progress_->enqueue(std::move(submit));
    } catch (const std::logic_error&) {
      C10_THROW_ERROR(DistBackendError,
                      c10::str("smddp rank ", rank_, ": send to rank ", peer, ": the process group has been shut down"));
    }
  } else {
    submitP2p(o, work.get());
  }
  return work;
}

engine::P2pOp SmddpBackend::p2pOp(bool isSend, int peer, int tag, const at::Tensor& buffer, bool background) const {
  engine::P2pOp o;
  o.isSend = isSend;
  o.peer = peer;
  o.tag = tag;
  o.buffer = static_cast<uint8_t*>(buffer.data_ptr());
  o.bytes = buffer.nbytes();
  o.posted = std::chrono::steady_clock::now();
  o.deadline = background ? std::chrono::steady_clock::time_point::max()
                          : o.posted + std::chrono::milliseconds(timeoutMs_.load());
  o.background = background;
  return o;
}

void SmddpBackend::submitP2p(engine::P2pOp o, SmddpWork* driven) {
  const Topology& topo = comm_->topology();
  const bool multiHost = comm_->multiHost();
  const int peer = o.peer;
  const bool remote = multiHost && peer >= 0 && topo.hostOf[peer] != topo.host();
  // The shared-memory engine numbers the ranks of its host.
  if (multiHost && peer >= 0 && !remote) o.peer = topo.localOf[peer];
  try {
    if (multiHost && peer < 0) {
      // Any rank may send it: both engines look, the first match takes it (P2pOp::claim).
      o.sharedAnySource = std::make_shared<std::atomic<bool>>(false);
      if (p2p_) {  // host-mates (the shared-memory engine exists only where there are some)
        engine::P2pOp local = o;
        const std::vector<int> hostMates = topo.members[topo.host()];
        local.done = [done = o.done, hostMates](std::exception_ptr error, int source) {
          done(std::move(error), source >= 0 ? hostMates[source] : source);
        };
        p2p_->submit(std::move(local));
      } else if (driven) {
        // Only the sockets can answer it. With host-mates too, the waiter could drive only one
        // engine, and would not hear the other complete the op: it waits as usual then.
        driven->setP2pDriver(netP2p_);
      }
      netP2p_->submit(std::move(o));
    } else if (remote) {
      if (driven) driven->setP2pDriver(netP2p_);
      netP2p_->submit(std::move(o));
    } else {
      if (driven) driven->setP2pDriver(p2p_);
      p2p_->submit(std::move(o));
    }
  } catch (const Error& e) {  // e.g. /dev/shm too small for the mailboxes
    std::rethrow_exception(toTorchError(e, rank_));
  }
}

void SmddpBackend::checkUserTag(int tag, const char* op) const {
  TORCH_CHECK_VALUE(tag >= kMonitoredBarrierTags + static_cast<int>(kMonitoredBarrierTagSpan), "smddp rank ", rank_,
                    ": ", op, ": tag ", tag, " is reserved (tags below ",
                    kMonitoredBarrierTags + static_cast<int>(kMonitoredBarrierTagSpan), " are monitored_barrier's)");
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  checkUserTag(tag, "send");
  return p2p(true, tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  checkUserTag(tag, "recv");
  return p2p(false, tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  checkUserTag(tag, "recv");
  return p2p(false, tensors, -1, tag);
}

c10::intrusive_ptr<c10d::Backend> createBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                std::chrono::milliseconds timeout, std::vector<int64_t> globalRanks) {
  return c10::make_intrusive<SmddpBackend>(store, rank, size, timeout, std::move(globalRanks));
}

}  // namespace smddp::torchext
