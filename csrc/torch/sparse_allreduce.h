// all_reduce of sparse COO tensors, which gloo offers and DDP relies on for sparse gradients
// (nn.Embedding(sparse=True), EmbeddingBag): without it a script that trains such a model on gloo
// cannot move to smddp.
//
// The ranks' nonzeros fall anywhere in the tensor, so each rank needs every rank's nonzeros:
// after a local coalesce (an embedding's gradient holds one row per lookup, repeated tokens
// included), one all-gather of every rank's nonzero count and shape, then one of the indices and
// values themselves (packed together, so the op costs two collective latencies, which across
// hosts are network round trips), then every rank sums them alike: rows with the same index are
// added in rank order (16-bit floats in float32), so every rank holds the same bits. The result
// replaces the input's indices and values in place (the tensor object stays the caller's),
// coalesced, as gloo's does.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <chrono>
#include <functional>
#include <memory>

#include "algo/communicator.h"

namespace smddp::torchext {

using SparseAllreduceBody = std::function<void(algo::Communicator&, std::chrono::milliseconds)>;

// Memory a group's sparse all-reduces reuse: each op's packed nonzeros and every rank's gathered
// ones, grown to the largest op so far. Fresh memory costs a page fault per 4 KiB touched, which
// made up a quarter of an op's time (2 ranks, 7 MB of nonzeros each). Ops of a group run one at
// a time, so one scratch serves them all.
struct SparseScratch {
  at::Tensor packed;
  at::Tensor gathered;
};

// Checks `t` (a CPU sparse COO tensor) and `op` (SUM, or AVG on floating-point values) at the
// call; the body runs the op on the group's thread. A rank whose tensor's shape,
// sparse/dense split or dtype differs from rank 0's makes the op fail with a ValueError on every
// rank alike (each sees every rank's description), and leaves the group usable.
// `who`: this rank as messages name it (rankName()).
SparseAllreduceBody sparseAllreduce(const at::Tensor& t, const c10d::ReduceOp& op, int rank,
                                    std::shared_ptr<const std::string> who, int size,
                                    std::shared_ptr<SparseScratch> scratch);

}  // namespace smddp::torchext
