#include "torch/staged.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>

#include "core/env.h"
#include "core/strided_copy.h"
#include "torch/tensor_checks.h"

namespace smddp::torchext {

namespace {
// A layout change whose innermost side is shorter in either tensor (an image batch with 4
// channels last) reads or writes short runs that torch's copy handles as fast: 16 MiB of
// float32, 4 channels last, took 0.94-1.08x torch's time through copyStrided, 1 MiB 2.3x.
constexpr int64_t kMinTransposeSide = 16;
// Below this, torch's copy was as fast or faster within an op (benchmarks/bench_layouts.py,
// world 2: a 512 x 512 float32 transpose, 1 MiB, 1.4-1.8x the time through copyStrided, though
// copyStrided alone copied it in 0.38 ms against torch's 0.47; 4 MiB 2.6-3.6x faster).
constexpr size_t kMinBytes = size_t{2} << 20;
}  // namespace

bool copyLayout(const at::Tensor& dst, const at::Tensor& src) {
  if (!dst.is_cpu() || !src.is_cpu() || dst.scalar_type() != src.scalar_type() || dst.sizes() != src.sizes() ||
      dst.is_conj() || src.is_conj() || dst.is_neg() || src.is_neg() || dst.nbytes() < kMinBytes) {
    return false;
  }
  // Only where the two orders differ innermost: rows that both hold in order are copied as well
  // by torch, which also spreads them over its threads.
  int64_t dstInner = -1, srcInner = -1;  // each side's innermost dimension, of more than one element
  for (int64_t d = 0; d < dst.dim(); ++d) {
    if (dst.size(d) < 2) continue;
    if (dstInner < 0 || dst.stride(d) < dst.stride(dstInner)) dstInner = d;
    if (srcInner < 0 || src.stride(d) < src.stride(srcInner)) srcInner = d;
  }
  if (dstInner == srcInner || std::min(dst.size(dstInner), dst.size(srcInner)) < kMinTransposeSide) return false;
  // One thread: at::parallel_for runs serially in code built without OpenMP, as this is. False
  // for an element size it does not copy (none here: torch's dtypes are 1-16 bytes).
  return copyStrided(bytePtr(dst), dst.strides().data(), src.data_ptr(), src.strides().data(), dst.sizes().data(),
                     static_cast<int>(dst.dim()), dst.element_size());
}

at::Tensor contiguousCopy(const at::Tensor& t) {
  at::Tensor c = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  if (!copyLayout(c, t)) c.copy_(t);
  return c;
}

void ready(std::vector<Staged>& staged) {
  for (Staged& s : staged) s.ready();
}

namespace {
Staged stageWritten(const at::Tensor& t, const std::string& who, const char* op, std::string* refusal,
                    Staged::Way way) {
  if (t.is_contiguous()) return {t};
  if (refusal == nullptr) {
    checkWritable(t, who, op);
  } else if (!(*refusal = writableRefusal(t, who, op)).empty()) {
    *refusal += ". This rank took its part in the op, so its peers complete it and the group stays usable, but "
                "left the tensor unwritten";
    return {t, way, false};
  }
  return {t, way, true};
}
}  // namespace

Staged stageInOut(const at::Tensor& t, const std::string& who, const char* op, std::string* refusal) {
  return stageWritten(t, who, op, refusal, Staged::Way::kCopyIn);
}

Staged stageOut(const at::Tensor& t, const std::string& who, const char* op, std::string* refusal) {
  return stageWritten(t, who, op, refusal, Staged::Way::kFresh);
}

Staged stageIn(const at::Tensor& t) {
  return {t, t.is_contiguous() ? Staged::Way::kAsIs : Staged::Way::kCopyIn};
}

void writeUser(const at::Tensor& user, const at::Tensor& from) {
  // A leaf that requires grad (a parameter) gets its data written, as gloo writes it, not an
  // autograd-recorded in-place op. A tensor made under torch.inference_mode() takes in-place
  // writes only under it, and the op may run on another thread than the one that issued it
  // (the progress thread, a p2p engine's), where the issuer's mode is not on.
  at::NoGradGuard noGrad;
  std::optional<c10::InferenceMode> inference;
  if (user.is_inference()) inference.emplace();
  if (copyLayout(user, from)) {
    user.unsafeGetTensorImpl()->bump_version();  // as copy_ would: autograd sees the write
    return;
  }
  user.copy_(from);
}

void finishStaged(const Staged& s) {
  if (s.copyBack) writeUser(s.user, s.work);
}

bool overlaps(const Staged& a, const Staged& b) {
  if (!a.inPlace() || !b.inPlace()) return false;
  const uint8_t* a0 = bytePtr(a.user);
  const uint8_t* b0 = bytePtr(b.user);
  return a0 < b0 + b.user.nbytes() && b0 < a0 + a.user.nbytes();
}

std::vector<Staged> stageBlocks(const std::vector<at::Tensor>& blocks, const Staged& out, int rank,
                                const std::string& who, const char* op, bool uneven) {
  std::vector<Staged> srcs;
  for (const at::Tensor& b : blocks) {
    checkMovedTensor(b, who, op);
    checkSameType(out.user, b, who, op);
    const bool own = static_cast<int>(srcs.size()) == rank;
    TORCH_CHECK_VALUE(b.numel() == out.user.numel() || (uneven && !own), who, ": ", op,
                      uneven ? ": this rank's own input block must have the output's " : ": every input must have "
                      "the output's ", out.user.numel(), " elements, got one with ", b.numel());
    Staged c = stageIn(b);
    if (overlaps(c, out)) c.copyAtStart();
    srcs.push_back(std::move(c));
  }
  return srcs;
}

namespace {
// A tensor's bytes, first to last element, and who it belongs to.
struct Span {
  uintptr_t lo, hi;
  size_t index;
};

std::optional<Span> spanOf(const at::Tensor& t, size_t index) {
  if (t.numel() == 0) return std::nullopt;
  int64_t last = 0;  // the last element's offset from the first, in elements (strides are >= 0)
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  return Span{lo, lo + static_cast<uintptr_t>(last + 1) * t.element_size(), index};
}

void sortByStart(std::vector<Span>& spans) {
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
}
}  // namespace

std::vector<bool> sharesWithEarlier(const std::vector<at::Tensor>& tensors) {
  std::vector<Span> spans;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (auto s = spanOf(tensors[i], i)) spans.push_back(*s);
  }
  sortByStart(spans);
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

void stageSharersApart(std::vector<Staged>& staged, const std::vector<at::Tensor>& users, Staged::Way way) {
  const std::vector<bool> later = sharesWithEarlier(users);
  for (size_t i = 0; i < staged.size(); ++i) {
    if (later[i] && staged[i].inPlace()) staged[i] = {users[i], way, true};
  }
}

std::vector<bool> readsOthersOutputs(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
  if (inputs.empty()) return {};
  std::vector<Span> outs;
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (auto s = spanOf(outputs[k], k % inputs.size())) outs.push_back(*s);
  }
  sortByStart(outs);
  // top[k]: among outs[0..k], the largest end of any item's outputs and the largest of any other
  // item's: an input [a, b) overlaps another item's output iff, among the outputs starting
  // before b, the largest end of an item other than its own passes a.
  struct End {
    uintptr_t hi = 0;
    size_t item = SIZE_MAX;
  };
  std::vector<std::array<End, 2>> top(outs.size());
  std::array<End, 2> cur{};
  for (size_t k = 0; k < outs.size(); ++k) {
    const End e{outs[k].hi, outs[k].index};
    if (e.item == cur[0].item) {
      cur[0].hi = std::max(cur[0].hi, e.hi);
    } else if (e.hi > cur[0].hi) {
      cur[1] = cur[0];
      cur[0] = e;
    } else if (e.item == cur[1].item) {
      cur[1].hi = std::max(cur[1].hi, e.hi);
    } else if (e.hi > cur[1].hi) {
      cur[1] = e;
    }
    top[k] = cur;
  }
  std::vector<bool> reads(inputs.size(), false);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::optional<Span> in = spanOf(inputs[i], i);
    if (!in) continue;
    const auto before = std::lower_bound(outs.begin(), outs.end(), in->hi,
                                         [](const Span& s, uintptr_t end) { return s.lo < end; });
    if (before == outs.begin()) continue;
    const std::array<End, 2>& t = top[static_cast<size_t>(before - outs.begin()) - 1];
    const End& other = t[0].item != i ? t[0] : t[1];
    reads[i] = other.item != SIZE_MAX && other.hi > in->lo;
  }
  return reads;
}

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

size_t packBytesSetting() { return static_cast<size_t>(env::coalescePackBytes()); }

void copyToBytes(uint8_t* bytes, const at::Tensor& t) {
  if (t.is_contiguous()) {
    std::memcpy(bytes, t.data_ptr(), t.nbytes());
  } else {
    at::NoGradGuard noGrad;
    const at::Tensor to = at::from_blob(bytes, t.sizes(), t.options());
    if (!copyLayout(to, t)) to.copy_(t);
  }
}

void copyFromBytes(const at::Tensor& t, const uint8_t* bytes) {
  if (t.is_contiguous()) {
    std::memcpy(t.data_ptr(), bytes, t.nbytes());
  } else {
    writeUser(t, at::from_blob(const_cast<uint8_t*>(bytes), t.sizes(), t.options()));
  }
}

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

void unpackCoalesced(const std::vector<Staged>& staged, const CoalescedItem& item, const at::Tensor& flat) {
  const uint8_t* from = bytePtr(flat);
  for (size_t i = item.first; i < item.first + item.count; ++i) {
    copyFromBytes(staged[i].user, from);
    from += staged[i].user.nbytes();
  }
}

}  // namespace smddp::torchext
