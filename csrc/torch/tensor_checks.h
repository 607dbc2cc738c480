// Phase 1 of every op, on the caller's thread: which tensors, dtypes and reduce ops smddp takes,
// refused at once with the exception Python expects (ValueError, TypeError,
// NotImplementedError) naming the rank and the op.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/types.h"

namespace smddp::torchext {

// The core's dtype for a torch dtype it computes in (nullopt: one it does not reduce).
std::optional<DataType> toDataType(at::ScalarType t);

// What every op needs of a tensor: defined, dense, on the CPU or a CUDA device.
void checkPlacement(const at::Tensor& t, const std::string& who, const char* op);

// A tensor that an op reduces: its dtype must be one smddp computes in.
DataType checkTensor(const at::Tensor& t, const std::string& who, const char* op);

// torch hands all_reduce a complex tensor as pairs of reals (view_as_real), but reduce and the
// reduce-scatters as it is: the same here, for the ops that act on both parts alike (as gloo
// and NCCL reduce them). Empty when no tensor is complex; a call mixing complex tensors with
// others is refused.
std::vector<at::Tensor> complexAsReals(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op,
                                       const std::string& who, const char* name);
// The same for a coalesced call, item by item (item i: outputs[i], and inputs[i] where inputs is
// not empty): a complex item as its real views, the others as they are, so that one list may mix
// them as torch's _coalescing_manager hands them over. nullopt when no tensor is complex.
std::optional<std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> complexItemsAsReals(
    const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, const c10d::ReduceOp& op,
    const std::string& who, const char* name);

// A tensor that an op only moves (broadcast, the gathers, scatter, all_to_all, send/recv): any
// dtype of 1, 2, 4 or 8 bytes (the other float8 kinds and complex32/64 too), carried bit for bit
// as the integer type of its size, which every step of such an op treats alike.
DataType checkMovedTensor(const at::Tensor& t, const std::string& who, const char* op);

// An op's input and output must have one dtype.
void checkSameType(const at::Tensor& a, const at::Tensor& b, const std::string& who, const char* op);

// a followed by b.
std::vector<at::Tensor> concatTensors(std::vector<at::Tensor> a, const std::vector<at::Tensor>& b);

// The one tensor of a list that must hold exactly one (torch's list form of single-tensor ops).
const at::Tensor& onlyTensor(const std::vector<at::Tensor>& tensors, const std::string& who, const char* op);
// The index of the root's tensor in that list (BroadcastOptions' and ReduceOptions' rootTensor): 0.
void checkRootTensor(int64_t rootTensor, const std::string& who, const char* op);

// torch's reduce op for `dtype` as the core's (PREMUL_SUM's factor, AVG's divisor `size`);
// NotImplementedError for a pair the core does not compute.
Reduction toReduction(const c10d::ReduceOp& op, DataType dtype, int size, const std::string& who, const char* opName);

// A tensor the op writes must not have elements that share memory (an expand()ed view): ranks'
// results for those elements could differ, and torch refuses to write such a tensor too, but only
// after the op has run; refuse it before anything is sent (or see stageOut's `refusal`).
void checkWritable(const at::Tensor& t, const std::string& who, const char* op);
// checkWritable's error text, or "" for a tensor it accepts.
std::string writableRefusal(const at::Tensor& t, const std::string& who, const char* op);


}  // namespace smddp::torchext
