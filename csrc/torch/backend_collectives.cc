// SmddpBackend's collectives: each validates and stages its tensors on the caller's thread and
// enqueues a body that runs the torch-free Communicator's collective (CUDA tensors divert to
// backend_cuda.cc's staging).
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <span>

#include "core/error.h"
#include "core/types.h"
#include "torch/backend.h"
#include "torch/staged.h"
#include "torch/tensor_checks.h"

namespace smddp::torchext {

c10::intrusive_ptr<c10d::Work> SmddpBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = onlyTensor(tensors, who(), "allreduce");
  if (Tensors reals = complexAsReals(tensors, opts.reduceOp, who(), "allreduce"); !reals.empty()) {
    return allreduce(reals, opts);  // a caller of the ProcessGroup itself (torch's all_reduce converts)
  }
  if (t.defined() && t.layout() == at::kSparse) {
    return enqueue(c10d::OpType::ALLREDUCE, "smddp:all_reduce", tensors, tensors, resolveTimeout(opts.timeout),
                   opts.asyncOp, sparseAllreduce(t, opts.reduceOp, rank_, whoShared(), size_, sparseScratch_));
  }
  const DataType dtype = checkTensor(t, who(), "allreduce");
  const Reduction red = toReduction(opts.reduceOp, dtype, size_, who(), "allreduce");
  if (isCudaOp(tensors, "allreduce")) {
    return cudaFlat(c10d::OpType::ALLREDUCE, "smddp:all_reduce", tensors, resolveTimeout(opts.timeout),
                    {{t, true, true, [dtype, red](algo::Communicator& c, std::chrono::milliseconds to, void* p, size_t n) {
                        c.allreduce({dtype, red, n, p, p, -1}, to);
                      }}});
  }
  Staged s = stageInOut(t, who(), "allreduce");
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
  if (auto reals = complexItemsAsReals(tensors, {}, opts.reduceOp, who(), "allreduce_coalesced")) {
    return allreduce_coalesced(reals->first, opts);
  }
  std::vector<Staged> staged;
  std::vector<std::pair<DataType, Reduction>> kinds;
  for (const at::Tensor& t : tensors) {
    const DataType dtype = checkTensor(t, who(), "allreduce_coalesced");
    kinds.emplace_back(dtype, toReduction(opts.reduceOp, dtype, size_, who(), "allreduce_coalesced"));
  }
  if (isCudaOp(tensors, "allreduce_coalesced")) {
    // A tensor that shares memory with an earlier one reduces a copy of its values as they are at
    // the call (as the CPU path's stageSharersApart): the earlier one's results may be back first.
    const std::vector<bool> shares = sharesWithEarlier(tensors);
    std::vector<FlatPart> parts;
    for (size_t i = 0; i < tensors.size(); ++i) {
      parts.push_back({tensors[i], true, true,
                       [kind = kinds[i]](algo::Communicator& c, std::chrono::milliseconds to, void* p, size_t n) {
                         c.allreduce({kind.first, kind.second, n, p, p, -1}, to);
                       },
                       shares[i] ? tensors[i].clone() : at::Tensor()});
    }
    return cudaFlat(c10d::OpType::ALLREDUCE_COALESCED, "smddp:all_reduce_coalesced", tensors,
                    resolveTimeout(opts.timeout), std::move(parts));
  }
  // Runs of small tensors of one dtype are reduced as one flat tensor: a reduction costs a round
  // of synchronisation, which dwarfs copying a small tensor in and out (gloo flattens every list).
  const std::vector<CoalescedItem> items = planCoalesced(tensors, packBytesSetting());
  // Reduced in place after an earlier tensor of the list that shares its memory, a tensor would
  // reduce that one's results again: it reduces a copy of its values as they are when the op
  // starts instead, and writes its result back (the same values there), as gloo's flattening does.
  // (Packed tensors are copied as the op starts anyway.)
  for (const at::Tensor& t : tensors) staged.push_back(stageInOut(t, who(), "allreduce_coalesced"));
  stageSharersApart(staged, tensors, Staged::Way::kCopyIn);
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, "smddp:all_reduce_coalesced", tensors, tensors,
                 resolveTimeout(opts.timeout), opts.asyncOp,
                 [staged, kinds, items, who = whoShared()](algo::Communicator& c,
                                                          std::chrono::milliseconds to) mutable {
                   // Every input is read before any result is written (a packed tensor may share
                   // memory with another of the list).
                   std::vector<at::Tensor> flats(items.size());
                   locally(*who, "all_reduce_coalesced", "copying the tensors as the op starts", [&] {
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
  const at::Tensor& t = onlyTensor(tensors, who(), "reduce");
  if (Tensors reals = complexAsReals(tensors, opts.reduceOp, who(), "reduce"); !reals.empty()) {
    return reduce(reals, opts);
  }
  const DataType dtype = checkTensor(t, who(), "reduce");
  const Reduction red = toReduction(opts.reduceOp, dtype, size_, who(), "reduce");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < size_, who(), ": reduce: root ", root,
                    " is not a rank of this group of size ", size_);
  checkRootTensor(opts.rootTensor, who(), "reduce");
  if (isCudaOp(tensors, "reduce")) {  // only the root's tensor changes, as with NCCL
    return cudaFlat(c10d::OpType::REDUCE, "smddp:reduce", tensors, resolveTimeout(opts.timeout),
                    {{t, true, rank_ == root,
                      [dtype, red, root](algo::Communicator& c, std::chrono::milliseconds to, void* p, size_t n) {
                        c.allreduce({dtype, red, n, p, p, root}, to);
                      }}});
  }
  std::string refusal;  // only the root writes: it takes its part before refusing (stageOut)
  Staged s = rank_ == root ? stageInOut(t, who(), "reduce", &refusal) : stageIn(t);
  auto work = enqueue(c10d::OpType::REDUCE, "smddp:reduce", tensors, tensors, resolveTimeout(opts.timeout),
                      opts.asyncOp, [s, dtype, red, root](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                        s.ready();
                        void* p = s.work.data_ptr();
                        c.allreduce({dtype, red, static_cast<size_t>(s.work.numel()), p, p, root}, to);
                        finishStaged(s);
                      });
  TORCH_CHECK_VALUE(refusal.empty(), refusal);
  return work;
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = onlyTensor(tensors, who(), "broadcast");
  const DataType dtype = checkMovedTensor(t, who(), "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < size_, who(), ": broadcast: root ", root,
                    " is not a rank of this group of size ", size_);
  checkRootTensor(opts.rootTensor, who(), "broadcast");
  if (isCudaOp(tensors, "broadcast")) {
    return cudaFlat(c10d::OpType::BROADCAST, "smddp:broadcast", tensors, resolveTimeout(opts.timeout),
                    {{t, rank_ == root, rank_ != root,
                      [dtype, root](algo::Communicator& c, std::chrono::milliseconds to, void* p, size_t n) {
                        c.broadcast({dtype, n, p, root}, to);
                      }}});
  }
  std::string refusal;  // only the receivers write: they take their part before refusing (stageOut)
  Staged s = rank_ == root ? stageIn(t) : stageOut(t, who(), "broadcast", &refusal);
  auto work = enqueue(c10d::OpType::BROADCAST, "smddp:broadcast", tensors, tensors, resolveTimeout(opts.timeout),
                      opts.asyncOp, [s, dtype, root](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                        s.ready();
                        c.broadcast({dtype, static_cast<size_t>(s.work.numel()), s.work.data_ptr(), root}, to);
                        finishStaged(s);
                      });
  TORCH_CHECK_VALUE(refusal.empty(), refusal);
  return work;
}

namespace {
// An all-gather into a list of per-rank outputs (sizes may differ per rank, as gloo allows).
struct ListGather {
  std::vector<Staged> staged;
  std::vector<size_t> counts;
  Staged in;
  DataType dtype;
};

ListGather prepareListGather(const std::vector<at::Tensor>& outs, const at::Tensor& in, int rank,
                             const std::string& who, int size, const char* op) {
  const DataType dtype = checkMovedTensor(in, who, op);
  ListGather g{{}, {}, stageIn(in), dtype};
  TORCH_CHECK_VALUE(static_cast<int>(outs.size()) == size, who, ": ", op, ": the output list has ",
                    outs.size(), " tensors but the group has ", size, " ranks");
  for (const at::Tensor& o : outs) {
    checkMovedTensor(o, who, op);
    checkSameType(o, in, who, op);
    g.staged.push_back(stageOut(o, who, op));
    g.counts.push_back(static_cast<size_t>(o.numel()));
  }
  TORCH_CHECK_VALUE(g.counts[rank] == static_cast<size_t>(in.numel()), who, ": ", op, ": output ",
                    rank, " has ", g.counts[rank], " elements but the input has ", in.numel());
  stageSharersApart(g.staged, outs, Staged::Way::kFresh);  // written in list order
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

// A coalesced gather's or scatter's items run one after another: an input that another item's
// output overlaps is copied as the op starts (readsOthersOutputs), before any item writes.
template <class Item>
std::vector<bool> planEarlyReads(std::vector<Item>& items, const std::vector<at::Tensor>& inputs,
                                 const std::vector<at::Tensor>& outputs) {
  std::vector<bool> early = readsOthersOutputs(inputs, outputs);
  for (size_t i = 0; i < items.size(); ++i) {
    if (early[i]) items[i].in.copyAtStart();
  }
  return early;
}

template <class Item>
void readEarly(std::vector<Item>& items, const std::vector<bool>& early) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (early[i]) items[i].in.ready();
  }
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
  const at::Tensor& in = onlyTensor(inputs, who(), "allgather");
  TORCH_CHECK_VALUE(outputs.size() == 1, who(), ": allgather takes one output list, got ",
                    outputs.size());
  checkMovedTensor(in, who(), "allgather");
  std::vector<at::Tensor>& outs = outputs[0];
  if (isCudaOp(concatTensors({in}, outs), "allgather")) {
    return cudaWhole("allgather", {in}, outs, [&](const Tensors& hostIn, const Tensors& hostOut) {
      std::vector<std::vector<at::Tensor>> o{hostOut};
      Tensors i = hostIn;
      return allgather(o, i, opts);
    });
  }
  ListGather g = prepareListGather(outs, in, rank_, who(), size_, "allgather");
  return enqueue(c10d::OpType::ALLGATHER, "smddp:all_gather", outs, inputs, resolveTimeout(opts.timeout), opts.asyncOp,
                 [g](algo::Communicator& c, std::chrono::milliseconds to) mutable { runListGather(c, g, to); });
}

// all_gather_coalesced: outputLists[r][i] receives rank r's inputs[i]; one list all-gather per
// input, all in one op.
c10::intrusive_ptr<c10d::Work> SmddpBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(static_cast<int>(outputLists.size()) == size_, who(),
                    ": allgather_coalesced: got ", outputLists.size(), " output lists but the group has ", size_,
                    " ranks");
  Tensors outs;  // rank-major: rank r's outputs for every input, then rank r + 1's
  for (const std::vector<at::Tensor>& list : outputLists) {
    TORCH_CHECK_VALUE(list.size() == inputs.size(), who(), ": allgather_coalesced: an output list has ",
                      list.size(), " tensors for ", inputs.size(), " inputs");
    outs.insert(outs.end(), list.begin(), list.end());
  }
  for (const at::Tensor& in : inputs) checkMovedTensor(in, who(), "allgather_coalesced");
  if (isCudaOp(concatTensors(inputs, outs), "allgather_coalesced")) {
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
    gathers.push_back(prepareListGather(perRank, inputs[i], rank_, who(), size_, "allgather_coalesced"));
  }
  const std::vector<bool> early = planEarlyReads(gathers, inputs, outs);
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, "smddp:all_gather_coalesced", outs, inputs,
                 resolveTimeout(opts.timeout), opts.asyncOp,
                 [gathers, early](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   readEarly(gathers, early);
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

DataType checkFlatGather(const at::Tensor& output, const at::Tensor& input, const std::string& who, int size,
                         const char* op) {
  const DataType dtype = checkMovedTensor(input, who, op);
  checkMovedTensor(output, who, op);
  checkSameType(output, input, who, op);
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size, who, ": ", op, ": the output has ",
                    output.numel(), " elements but must have world size (", size, ") x input (", input.numel(),
                    ") = ", input.numel() * size);
  return dtype;
}

FlatGather prepareFlatGather(const at::Tensor& output, const at::Tensor& input, int rank, const std::string& who,
                             int size, const char* op) {
  FlatGather g{stageOut(output, who, op), stageIn(input), checkFlatGather(output, input, who, size, op)};
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
    copyToBytes(mine, g.in.work.defined() ? g.in.work : g.in.user);  // its copy if read at the start
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
    const DataType dtype = checkFlatGather(output, input, who(), size_, "all_gather_into_tensor");
    return cudaColumns(c10d::OpType::_ALLGATHER_BASE, "smddp:all_gather_into_tensor", {output}, {input},
                       resolveTimeout(opts.timeout), true, {{input, output, dtype, {}}});
  }
  FlatGather g = prepareFlatGather(output, input, rank_, who(), size_, "all_gather_into_tensor");
  const int size = size_;
  return enqueue(c10d::OpType::_ALLGATHER_BASE, "smddp:all_gather_into_tensor", {output}, {input},
                 resolveTimeout(opts.timeout), opts.asyncOp, [g, size](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   runFlatGather(c, g, size, to);
                 });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                             std::vector<at::Tensor>& inputs,
                                                                             const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), who(),
                    ": allgather_into_tensor_coalesced: got ", outputs.size(), " outputs for ", inputs.size(),
                    " inputs");
  if (isCudaOp(concatTensors(outputs, inputs), "allgather_into_tensor_coalesced")) {
    std::vector<ColumnPart> parts;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const DataType dtype = checkFlatGather(outputs[i], inputs[i], who(), size_, "allgather_into_tensor_coalesced");
      parts.push_back({inputs[i], outputs[i], dtype, {}});
    }
    return cudaColumns(c10d::OpType::COALESCED, "smddp:all_gather_into_tensor_coalesced", outputs, inputs,
                       resolveTimeout(opts.timeout), true, std::move(parts));
  }
  std::vector<FlatGather> gathers;
  for (size_t i = 0; i < inputs.size(); ++i) {
    gathers.push_back(prepareFlatGather(outputs[i], inputs[i], rank_, who(), size_, "allgather_into_tensor_coalesced"));
  }
  // Runs of small tensors of one dtype go as one all-gather, as all_reduce_coalesced's do (one
  // dtype, so that ranks whose dtypes differ still fail as mismatched).
  const std::vector<CoalescedItem> items = planCoalesced(outputs, packBytesSetting());
  const std::vector<bool> early = planEarlyReads(gathers, inputs, outputs);
  return enqueue(c10d::OpType::COALESCED, "smddp:all_gather_into_tensor_coalesced", outputs, inputs,
                 resolveTimeout(opts.timeout), opts.asyncOp,
                 [gathers, items, early, rank = rank_, size = size_](algo::Communicator& c,
                                                                     std::chrono::milliseconds to) mutable {
                   readEarly(gathers, early);
                   for (const CoalescedItem& item : items) runGatherItem(c, gathers, item, rank, size, to);
                 });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& out = onlyTensor(outputs, who(), "reduce_scatter");
  TORCH_CHECK_VALUE(inputs.size() == 1, who(), ": reduce_scatter takes one input list, got ",
                    inputs.size());
  if (Tensors reals = complexAsReals(concatTensors({out}, inputs[0]), opts.reduceOp, who(), "reduce_scatter");
      !reals.empty()) {
    Tensors o{reals[0]};
    std::vector<Tensors> i{Tensors(reals.begin() + 1, reals.end())};
    return reduce_scatter(o, i, opts);
  }
  const DataType dtype = checkTensor(out, who(), "reduce_scatter");
  const Reduction red = toReduction(opts.reduceOp, dtype, size_, who(), "reduce_scatter");
  const std::vector<at::Tensor>& ins = inputs[0];
  TORCH_CHECK_VALUE(static_cast<int>(ins.size()) == size_, who(), ": reduce_scatter: the input list has ",
                    ins.size(), " tensors but the group has ", size_, " ranks");
  if (isCudaOp(concatTensors({out}, ins), "reduce_scatter")) {
    for (const at::Tensor& b : ins) checkSameType(out, b, who(), "reduce_scatter");
    return cudaWhole("reduce_scatter", ins, {out}, [&](const Tensors& hostIn, const Tensors& hostOut) {
      Tensors o = hostOut;
      std::vector<std::vector<at::Tensor>> i{hostIn};
      return reduce_scatter(o, i, opts);
    });
  }
  // Blocks may differ in size (block p is rank p's output; reduce_scatter_v), as NCCL allows.
  Staged s = stageOut(out, who(), "reduce_scatter");
  std::vector<Staged> srcs = stageBlocks(ins, s, rank_, who(), "reduce_scatter", /*uneven=*/true);
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
                                                const c10d::ReduceOp& op, const std::string& who, int size,
                                                const char* name) {
  const DataType dtype = checkTensor(input, who, name);
  checkTensor(output, who, name);
  checkSameType(output, input, who, name);
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size, who, ": ", name, ": the input has ",
                    input.numel(), " elements but must have world size (", size, ") x output (", output.numel(),
                    ") = ", output.numel() * size);
  return {dtype, toReduction(op, dtype, size, who, name)};
}

FlatScatter prepareFlatScatter(const at::Tensor& output, const at::Tensor& input, const c10d::ReduceOp& op, int rank,
                               const std::string& who, int size, const char* name) {
  const auto [dtype, red] = checkFlatScatter(output, input, op, who, size, name);
  FlatScatter f{stageOut(output, who, name), stageIn(input), dtype, red};
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
  if (Tensors reals = complexAsReals({output, input}, opts.reduceOp, who(), "reduce_scatter_tensor");
      !reals.empty()) {
    return _reduce_scatter_base(reals[0], reals[1], opts);
  }
  if (isCudaOp({output, input}, "reduce_scatter_tensor")) {
    const auto [dtype, red] = checkFlatScatter(output, input, opts.reduceOp, who(), size_, "reduce_scatter_tensor");
    return cudaColumns(c10d::OpType::_REDUCE_SCATTER_BASE, "smddp:reduce_scatter_tensor", {output}, {input},
                       resolveTimeout(opts.timeout), false, {{output, input, dtype, red}});
  }
  FlatScatter f = prepareFlatScatter(output, input, opts.reduceOp, rank_, who(), size_, "reduce_scatter_tensor");
  const int size = size_;
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "smddp:reduce_scatter_tensor", {output}, {input},
                 resolveTimeout(opts.timeout), opts.asyncOp, [f, size](algo::Communicator& c, std::chrono::milliseconds to) mutable {
                   runFlatScatter(c, f, size, to);
                 });
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                             std::vector<at::Tensor>& inputs,
                                                                             const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), who(),
                    ": reduce_scatter_tensor_coalesced: got ", outputs.size(), " outputs for ", inputs.size(),
                    " inputs");
  if (auto reals = complexItemsAsReals(outputs, inputs, opts.reduceOp, who(), "reduce_scatter_tensor_coalesced")) {
    return reduce_scatter_tensor_coalesced(reals->first, reals->second, opts);
  }
  if (isCudaOp(concatTensors(outputs, inputs), "reduce_scatter_tensor_coalesced")) {
    std::vector<ColumnPart> parts;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto [dtype, red] = checkFlatScatter(outputs[i], inputs[i], opts.reduceOp, who(), size_,
                                                 "reduce_scatter_tensor_coalesced");
      parts.push_back({outputs[i], inputs[i], dtype, red});
    }
    return cudaColumns(c10d::OpType::COALESCED, "smddp:reduce_scatter_tensor_coalesced", outputs, inputs,
                       resolveTimeout(opts.timeout), false, std::move(parts));
  }
  std::vector<FlatScatter> scatters;
  for (size_t i = 0; i < inputs.size(); ++i) {
    scatters.push_back(
        prepareFlatScatter(outputs[i], inputs[i], opts.reduceOp, rank_, who(), size_,
                           "reduce_scatter_tensor_coalesced"));
  }
  // Runs of small tensors of one dtype go as one reduce-scatter, as all_reduce_coalesced's do.
  const std::vector<CoalescedItem> items = planCoalesced(inputs, packBytesSetting());
  const std::vector<bool> early = planEarlyReads(scatters, inputs, outputs);
  return enqueue(c10d::OpType::COALESCED, "smddp:reduce_scatter_tensor_coalesced", outputs, inputs,
                 resolveTimeout(opts.timeout), opts.asyncOp,
                 [scatters, items, early, rank = rank_, size = size_](algo::Communicator& c,
                                                                      std::chrono::milliseconds to) mutable {
                   readEarly(scatters, early);
                   for (const CoalescedItem& item : items) runScatterItem(c, scatters, item, rank, size, to);
                 });
}

namespace {
int checkRoot(int64_t root, const std::string& who, int size, const char* op) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, who, ": ", op, ": root ", root,
                    " is not a rank of this group of size ", size);
  return static_cast<int>(root);
}

// What a root passed instead of one list of a tensor per rank, for its error.
std::string listsGiven(const std::vector<std::vector<at::Tensor>>& lists) {
  if (lists.size() != 1) return std::to_string(lists.size()) + " lists";
  return "a list of " + std::to_string(lists[0].size());
}
}  // namespace

c10::intrusive_ptr<c10d::Work> SmddpBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  const at::Tensor& in = onlyTensor(inputs, who(), "gather");
  const DataType dtype = checkMovedTensor(in, who(), "gather");
  const int root = checkRoot(opts.rootRank, who(), size_, "gather");
  const Tensors rootOuts = rank_ == root && outputs.size() == 1 ? outputs[0] : Tensors{};
  // Only the root writes: where its outputs cannot take the result, it takes its part into memory
  // of its own before raising, so the other ranks complete the op and the group stays usable.
  std::exception_ptr rootError;  // an output list that does not fit the op
  if (rank_ == root) {
    try {
      TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_, who(),
                        ": gather: the root needs one output list of ", size_, " tensors, got ", listsGiven(outputs));
      for (const at::Tensor& o : outputs[0]) {
        checkMovedTensor(o, who(), "gather");
        checkSameType(o, in, who(), "gather");
        TORCH_CHECK_VALUE(o.numel() == in.numel(), who(), ": gather: every output must have the input's ",
                          in.numel(), " elements, got one with ", o.numel());
      }
    } catch (const c10::Error&) {
      rootError = std::current_exception();
    }
  }
  if (isCudaOp(concatTensors({in}, rootOuts), "gather")) {
    // A root whose list does not fit stages no copy back into it: its CPU twin gets no list and
    // takes its part into memory of its own (raising its own refusal, this one's stands).
    try {
      Work work = cudaWhole("gather", {in}, rootError ? Tensors{} : rootOuts,
                            [&](const Tensors& hostIn, const Tensors& hostOut) {
                              std::vector<std::vector<at::Tensor>> o;
                              if (rank_ == root) o.push_back(hostOut);
                              Tensors i = hostIn;
                              return gather(o, i, opts);
                            });
      if (!rootError) return work;
    } catch (const c10::Error&) {
      if (!rootError) throw;
    }
    std::rethrow_exception(rootError);
  }
  std::vector<Staged> staged;
  std::vector<at::Tensor> outs;
  std::string refusal;  // an output that cannot be written in place (stageOut)
  if (rank_ == root) {
    if (rootError) {
      for (int r = 0; r < size_; ++r) outs.push_back(at::empty({in.numel()}, in.options()));
    } else {
      outs = outputs[0];
    }
    for (const at::Tensor& o : outs) {
      std::string why;
      staged.push_back(stageOut(o, who(), "gather", &why));
      if (refusal.empty()) refusal = why;
    }
    stageSharersApart(staged, outs, Staged::Way::kFresh);  // written in list order
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || outputs[0].empty(), who(),
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
  auto work = enqueue(
      c10d::OpType::GATHER, "smddp:gather", outs, inputs, resolveTimeout(opts.timeout), opts.asyncOp,
      [staged, src, dtype, root, size](algo::Communicator& c, std::chrono::milliseconds to) mutable {
        src.ready();
        ready(staged);
        const size_t n = static_cast<size_t>(src.work.numel());
        algo::AllgatherOptions o{dtype, src.work.data_ptr(), {}, std::vector<size_t>(size, n), root};
        for (const Staged& s : staged) o.outputs.push_back(s.work.data_ptr());
        c.allgather(o, to);
        for (const Staged& s : staged) finishStaged(s);
      });
  if (rootError) std::rethrow_exception(rootError);
  TORCH_CHECK_VALUE(refusal.empty(), refusal);
  return work;
}

c10::intrusive_ptr<c10d::Work> SmddpBackend::scatter(std::vector<at::Tensor>& outputs,
                                                     std::vector<std::vector<at::Tensor>>& inputs,
                                                     const c10d::ScatterOptions& opts) {
  const at::Tensor& out = onlyTensor(outputs, who(), "scatter");
  const DataType dtype = checkMovedTensor(out, who(), "scatter");
  const int root = checkRoot(opts.rootRank, who(), size_, "scatter");
  const Tensors rootIns = rank_ == root && inputs.size() == 1 ? inputs[0] : Tensors{};
  if (isCudaOp(concatTensors({out}, rootIns), "scatter")) {
    return cudaWhole("scatter", rootIns, {out}, [&](const Tensors& hostIn, const Tensors& hostOut) {
      Tensors o = hostOut;
      std::vector<std::vector<at::Tensor>> i;
      if (rank_ == root) i.push_back(hostIn);
      return scatter(o, i, opts);
    });
  }
  Staged s;
  std::vector<Staged> srcs;
  Tensors ins;
  if (rank_ == root) {
    try {
      s = stageOut(out, who(), "scatter");
      TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_, who(),
                        ": scatter: the root needs one input list of ", size_, " tensors, got ", listsGiven(inputs));
      srcs = stageBlocks(inputs[0], s, rank_, who(), "scatter");
    } catch (const c10::Error&) {
      // The other ranks cannot be given blocks the root does not have (or could not keep its own
      // in its output: one with elements that share memory): the op fails in its turn,
      // and its peers are told the root's reason at once (the group is unusable after it, as after
      // any failed collective), instead of waiting for the root's next op or their timeout.
      const std::exception_ptr error = std::current_exception();
      enqueue(c10d::OpType::SCATTER, "smddp:scatter", outputs, {}, resolveTimeout(opts.timeout), /*async=*/false,
              [error](algo::Communicator&, std::chrono::milliseconds) { std::rethrow_exception(error); });
      throw;
    }
    ins = inputs[0];
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || inputs[0].empty(), who(),
                      ": scatter: only the root (rank ", root, ") takes an input list");
    s = stageOut(out, who(), "scatter");
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
std::vector<size_t> blockCounts(const at::Tensor& t, const std::vector<int64_t>& splits, const std::string& who,
                                int size, const char* what) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const int64_t rowElems = rows == 0 ? 0 : t.numel() / rows;
  std::vector<size_t> counts(size);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(rows % size == 0, who, ": all_to_all_single: the ", what, "'s first dimension (",
                      rows, ") is not divisible by the group size (", size, ") and no split sizes were given");
    for (int p = 0; p < size; ++p) counts[p] = static_cast<size_t>(rows / size * rowElems);
    return counts;
  }
  TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == size, who, ": all_to_all_single: ", what,
                    " split sizes have ", splits.size(), " entries for a group of ", size);
  int64_t sum = 0;
  for (int p = 0; p < size; ++p) {
    TORCH_CHECK_VALUE(splits[p] >= 0, who, ": all_to_all_single: negative ", what, " split size");
    sum += splits[p];
    counts[p] = static_cast<size_t>(splits[p] * rowElems);
  }
  TORCH_CHECK_VALUE(sum == rows, who, ": all_to_all_single: ", what, " split sizes add up to ", sum,
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
  const DataType dtype = checkMovedTensor(input, who(), "all_to_all_single");
  checkMovedTensor(output, who(), "all_to_all_single");
  checkSameType(output, input, who(), "all_to_all_single");
  const std::vector<size_t> inCounts = blockCounts(input, inputSplitSizes, who(), size_, "input");
  const std::vector<size_t> outCounts = blockCounts(output, outputSplitSizes, who(), size_, "output");
  Staged out = stageOut(output, who(), "all_to_all_single");
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
                    who(), ": all_to_all takes ", size_, " inputs and ", size_, " outputs, got ",
                    inputs.size(), " and ", outputs.size());
  if (isCudaOp(concatTensors(outputs, inputs), "all_to_all")) {
    return cudaWhole("all_to_all", inputs, outputs, [&](const Tensors& hostIn, const Tensors& hostOut) {
      Tensors o = hostOut, i = hostIn;
      return alltoall(o, i, opts);
    });
  }
  const DataType dtype = checkMovedTensor(inputs[0], who(), "all_to_all");
  std::vector<Staged> outs, ins;
  std::vector<size_t> inCounts, outCounts;
  for (int p = 0; p < size_; ++p) {
    checkMovedTensor(inputs[p], who(), "all_to_all");
    checkMovedTensor(outputs[p], who(), "all_to_all");
    checkSameType(outputs[p], inputs[0], who(), "all_to_all");
    checkSameType(inputs[p], inputs[0], who(), "all_to_all");
    outs.push_back(stageOut(outputs[p], who(), "all_to_all"));
    ins.push_back(stageIn(inputs[p]));
    inCounts.push_back(static_cast<size_t>(inputs[p].numel()));
    outCounts.push_back(static_cast<size_t>(outputs[p].numel()));
  }
  stageSharersApart(outs, outputs, Staged::Way::kFresh);  // written in list order
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

}  // namespace smddp::torchext
