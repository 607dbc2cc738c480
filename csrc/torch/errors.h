// How failures reach Python: smddp's own errors become the c10 exception types torch maps to
// Python classes (ValueError, NotImplementedError, DistBackendError, its timeout), every message
// starts with the rank's name (rankName()) and ": ", and a collective body's failure breaks the
// group so its peers hear at once.
#pragma once

#include <c10/util/Exception.h>
#include <sys/types.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "algo/communicator.h"
#include "core/error.h"

namespace smddp::torchext {

// An op whose peers did not come in time: a DistBackendError to Python, which
// Work::getFutureResult() reports as TIMEOUT rather than COMM_ERROR.
class TimeoutError : public c10::DistBackendError {
  using c10::DistBackendError::DistBackendError;
};

// "all_reduce" for the profiler's "smddp:all_reduce": how messages name an op.
const char* opName(const char* title);

// How messages name a rank: "smddp rank 1" in the default group (`defaultGroup`). Group ranks
// repeat across a job's groups (every tensor-parallel group has a rank 0), so in any other the
// name also gives the group as torch names it (`groupUid`, and `groupDesc` unless torch's
// "undefined") and the world rank, as torch's own logs do, and where the group numbers its ranks
// otherwise than the world, which world ranks they are (`worldRanks`, by group rank; the other
// ranks its messages name are group ranks): "smddp rank 1 of group 3 (mesh_tp), world rank 5
// (group ranks 0-1 are world ranks 4-5)"; before torch has named the group, "smddp rank 1
// (world rank 5)".
std::string rankName(int rank, bool defaultGroup, const std::string& groupUid, const std::string& groupDesc,
                     const std::vector<int64_t>& worldRanks);

// "<who>: ", how every message of this layer starts; `who` is a rankName().
std::string rankPrefix(const std::string& who);

// smddp::Error -> the c10 error type Python maps to the right exception class. The core names
// a rank by its number alone ("smddp rank 1: "): that is replaced by `who`.
std::exception_ptr toTorchError(const Error& e, const std::string& who);

// An exception's text for a message: a c10::Error's without the C++ backtrace its what() carries.
std::string messageOf(const std::exception& e);

// The same for an error caught anywhere: smddp::Errors converted, null and others as they are.
std::exception_ptr asTorchError(std::exception_ptr error, const std::string& who);

// The error a collective's body (run on the progress thread, or inline) ended with, called from
// its `catch (...)`, as torch should see it, naming the rank and the op (`title`). A failure
// outside the body's collectives (torch's, in this rank's own staging or copying back, or a step
// locally() named; the core's, but for a usage error every rank raises alike) first breaks the
// group as a failed collective does and tells the peers why (when the group has any): they may
// wait in a collective this rank will not reach, or would pair its next op with this one.
std::exception_ptr bodyError(algo::Communicator& c, const std::string& who, int size, const char* title);

// Runs `fn`, a step of this rank's own work inside an op (staging before its first collective,
// or work between two), so that an error names the step: "`who`: `op`: `step` failed: why",
// a DistBackendError, as every failure that breaks the group is (bodyError).
template <class Fn>
auto locally(const std::string& who, const char* op, const std::string& step, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, rankPrefix(who) + op + ": " + step + " failed: " + messageOf(e));
  }
}

// Why a process forked from `owner`, which made a group, may not use it or wait for its ops.
std::string forkedWhy(pid_t owner);

}  // namespace smddp::torchext
