// Typed errors of the core. The torch layer maps each code to a Python exception type, so a
// caller can tell a usage mistake (ValueError) from a failure of the group (DistBackendError).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace smddp {

enum class ErrorCode {
  kInvalidUsage,  // the caller passed something wrong (shapes, dtypes, mismatched collectives)
  kNotSupported,  // a valid request this version does not implement
  kSystemError,   // an OS call failed (shm_open, mmap, ...)
  kTimeout,       // peers did not arrive in time
  kRemoteError,   // a peer died or reported a failure
  kAborted,       // the group was shut down or broken by an earlier error
};

const char* errorCodeName(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

// Formats like printf.
std::string formatString(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// "1, 3, 4": ranks as error messages list them.
std::string joinRanks(const std::vector<int>& ranks);

// Formats like printf and throws smddp::Error.
[[noreturn]] void throwError(ErrorCode code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// errno as text, for messages about failed system calls.
std::string errnoString(int err);

// `what` less the ways the core names the rank that raised it, at its start ("smddp rank 3: ",
// "rank 3: ", or both): for a message about to be given a prefix naming that rank again. Core
// messages that start with "rank N: " name the rank raising them.
std::string withoutRankPrefix(const std::string& what);

// A reason `rank` gave in its own words ("this rank runs allreduce #1 ..."), reworded for
// another rank's message about it ("rank 1 runs allreduce #1 ..."): relayed as written, its
// "this rank" read as the relaying rank.
std::string inTheWordsOf(int rank, const std::string& why);

}  // namespace smddp
