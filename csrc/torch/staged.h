// How an op holds the user's tensors: planned and checked at the call (phase 1), made ready as
// the op starts (phase 2): contiguous memory the core can work on, the tensor itself where it
// can be, else a copy made as the op starts and copied back after it; and how a coalesced op
// packs small tensors into one.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace smddp::torchext {

// dst.copy_(src) for CPU tensors of one dtype and shape whose elements lie in different orders
// (a transposed or channels-last tensor and its contiguous copy), cache-blocked (copyStrided),
// without autograd; false, having copied nothing, where torch's copy does as well (both walk
// their innermost dimension in order) or must (conjugate or negative views, other devices).
bool copyLayout(const at::Tensor& dst, const at::Tensor& src);
// A contiguous copy of `t`'s values (by copyLayout where it pays).
at::Tensor contiguousCopy(const at::Tensor& t);

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
  at::Tensor work{};  // once ready()

  void ready() {  // once: an input read as its op starts is not read again by its item
    if (work.defined()) return;
    if (way == Way::kCopyIn) {
      work = contiguousCopy(user);
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

// Makes every tensor of the list ready (Staged::ready).
void ready(std::vector<Staged>& staged);

// The three ways an op uses a tensor: read and written (allreduce, reduce's root), only
// written, only read. One written that is not contiguous is checked (checkWritable) and gets a
// copy, copied back after the op (finishStaged).
// With `refusal`, a written tensor whose elements share memory is not refused at once: it gets
// memory of its own, never copied back, and *refusal the error, which the op raises once it is
// queued. For ops where only some ranks write (a broadcast's receivers, a reduce's or gather's
// root): refused there alone before anything moved, the op would leave the others in it without
// this rank, and the group unusable; this way the rank takes its part, and only it raises.
Staged stageInOut(const at::Tensor& t, const std::string& who, const char* op, std::string* refusal = nullptr);
Staged stageOut(const at::Tensor& t, const std::string& who, const char* op, std::string* refusal = nullptr);
Staged stageIn(const at::Tensor& t);

// Copies a written copy's results back into the user's tensor (writeUser).
void finishStaged(const Staged& s);
// user.copy_(from) as a collective's result: outside autograd, and under inference mode where
// `user` is an inference tensor, whichever thread runs it.
void writeUser(const at::Tensor& user, const at::Tensor& from);

// A tensor's data, as bytes.
inline uint8_t* bytePtr(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// Whether the op will work on memory `a` and `b` share (copies made as it starts share none).
bool overlaps(const Staged& a, const Staged& b);

// A list of per-rank input blocks (reduce_scatter, scatter): each checked against the output
// (dtype, element count: every block's, or with `uneven` only this rank's own), made contiguous,
// and copied if it overlaps the output, which the op writes while the blocks are still being read.
std::vector<Staged> stageBlocks(const std::vector<at::Tensor>& blocks, const Staged& out, int rank,
                                const std::string& who, const char* op, bool uneven = false);

// Which tensors of a list may share memory with an earlier one of it: those whose byte span
// (first to last element) overlaps another's, except the first in list order of each run of
// overlapping spans (a tensor may be marked that only overlaps later ones: it is then copied
// needlessly, never missed). Sorting the spans keeps this O(n log n): a list of a thousand
// tensors compared pair by pair took most of the op's time.
std::vector<bool> sharesWithEarlier(const std::vector<at::Tensor>& tensors);

// Each tensor of `staged` (the list `users`, staged) that may share memory with an earlier one
// (sharesWithEarlier) and works in place goes through memory of its own, `way` (kCopyIn for one
// read and written, kFresh for an output), copied back as the op ends (finishStaged, in list
// order): the list then ends as gloo leaves it, each tensor written in list order. In place, an
// all_reduce_coalesced tensor would reduce an earlier one's results again, and an overlapped
// element of an output list (all_gather's, gather's, all_to_all's) kept whichever block this
// rank received last, which differs from rank to rank.
void stageSharersApart(std::vector<Staged>& staged, const std::vector<at::Tensor>& users, Staged::Way way);

// For a coalesced gather or scatter, whose items run one after another: which inputs (input i is
// item i's) overlap an output of another item (output k is item k % inputs.size()'s: one per item,
// or a list form's rank-major outputs), so that an earlier item could write it before it is read.
// Such inputs are read as the op starts (copyAtStart, then ready()), as gloo reads every input
// before writing any output, whatever the sizes (a packed run of small tensors reads all of its
// inputs first anyway). O(n log n), like sharesWithEarlier; an input overlapping only its own
// item's outputs is left to that item.
std::vector<bool> readsOthersOutputs(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs);

// ---- coalesced ops of CPU tensors (all_reduce_coalesced, the coalesced all-gathers and
// reduce-scatters): runs of small tensors of one dtype move as one flat collective, copied in
// and out, where a collective each would cost more than the copies.

// A coalesced op's plan: tensors [first, first + count) of the list move together, as one flat
// collective where count > 1.
struct CoalescedItem {
  size_t first = 0;
  size_t count = 1;
};

// Consecutive non-empty tensors of one dtype, each of at most `packBytes`, form one item of up
// to 4 MiB; every other tensor is its own. `tensors` are those the collective moves
// whole: all_reduce's, an all-gather's outputs, a reduce-scatter's inputs (a rank's block is
// 1/world of them: packing blocks of 4 KiB at world 2 did not pay).
// Depends only on the tensors' dtypes and sizes and on packBytes, which every rank must share
// (SMDDP_COALESCE_PACK_BYTES set alike: else the ranks' collectives differ and the op fails as
// mismatched).
std::vector<CoalescedItem> planCoalesced(const std::vector<at::Tensor>& tensors, size_t packBytes);

// SMDDP_COALESCE_PACK_BYTES, at least 0.
size_t packBytesSetting();

// A tensor's values to and from `bytes` (its nbytes() of them, in its logical order). Contiguous
// ones are copied with memcpy: torch's copy_() of a small tensor costs more than the collective
// packing saves. A parameter's data is read and written as data, recording nothing.
void copyToBytes(uint8_t* bytes, const at::Tensor& t);
void copyFromBytes(const at::Tensor& t, const uint8_t* bytes);

// The item's tensors' values, one after another in a tensor of their dtype.
at::Tensor packCoalesced(const std::vector<Staged>& staged, const CoalescedItem& item);

// Writes the reduced values back into the item's tensors.
void unpackCoalesced(const std::vector<Staged>& staged, const CoalescedItem& item, const at::Tensor& flat);

}  // namespace smddp::torchext
