#include "torch/errors.h"

#include <cstring>
#include <new>

#include "core/fork.h"

namespace smddp::torchext {

const char* opName(const char* title) { return std::strncmp(title, "smddp:", 6) == 0 ? title + 6 : title; }

namespace {
// The world ranks of a group's ranks, in group rank order, as briefly as they allow: "2-9",
// "0, 4, ..., 28", or the list (its first 8 and a count where it is longer than 16).
std::string worldRanksText(const std::vector<int64_t>& ranks) {
  const size_t n = ranks.size();
  const int64_t step = n > 1 ? ranks[1] - ranks[0] : 0;
  bool even = n > 1 && step > 0;
  for (size_t i = 2; even && i < n; ++i) even = ranks[i] - ranks[i - 1] == step;
  if (even && step == 1) return std::to_string(ranks.front()) + "-" + std::to_string(ranks.back());
  if (even && n > 3) {
    return std::to_string(ranks[0]) + ", " + std::to_string(ranks[1]) + ", ..., " + std::to_string(ranks.back());
  }
  std::string text;
  const size_t shown = n > 16 ? 8 : n;
  for (size_t i = 0; i < shown; ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  if (shown < n) text += ", ... (" + std::to_string(n) + " in all)";
  return text;
}
}  // namespace

std::string rankName(int rank, bool defaultGroup, const std::string& groupUid, const std::string& groupDesc,
                     const std::vector<int64_t>& worldRanks) {
  std::string name = "smddp rank " + std::to_string(rank);
  if (defaultGroup) return name;
  const std::string worldRank = std::to_string(worldRanks[static_cast<size_t>(rank)]);
  if (groupUid.empty()) return name + " (world rank " + worldRank + ")";
  name += " of group " + groupUid;
  if (!groupDesc.empty() && groupDesc != "undefined") name += " (" + groupDesc + ")";
  name += ", world rank " + worldRank;
  bool renumbered = false;
  for (size_t r = 0; r < worldRanks.size(); ++r) renumbered |= worldRanks[r] != static_cast<int64_t>(r);
  if (!renumbered || worldRanks.size() < 2) return name;
  // The ranks its messages name are this group's: "rank 5 could not set up" is no world rank 5.
  return name + " (group ranks 0-" + std::to_string(worldRanks.size() - 1) + " are world ranks " +
         worldRanksText(worldRanks) + ")";
}

std::string rankPrefix(const std::string& who) { return who + ": "; }

std::exception_ptr toTorchError(const Error& e, const std::string& who) {
  // Messages from this layer's code that knows the rank already start with rankPrefix(who).
  const std::string prefix = rankPrefix(who);
  const std::string what = e.what();
  const std::string msg = what.rfind(prefix, 0) == 0 ? what : prefix + withoutRankPrefix(what);
  const c10::SourceLocation loc{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
  switch (e.code()) {
    case ErrorCode::kInvalidUsage: return std::make_exception_ptr(c10::ValueError(loc, msg));
    case ErrorCode::kNotSupported: return std::make_exception_ptr(c10::NotImplementedError(loc, msg));
    case ErrorCode::kTimeout: return std::make_exception_ptr(TimeoutError(loc, msg));
    default: return std::make_exception_ptr(c10::DistBackendError(loc, msg));
  }
}

std::exception_ptr bodyError(algo::Communicator& c, const std::string& who, int size, const char* title) {
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
      return toTorchError(e, who);
    } catch (const std::exception& e) {
      message = messageOf(e);
    } catch (...) {
      message = "an exception of unknown type";
    }
    const std::string prefix = rankPrefix(who);
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

std::exception_ptr asTorchError(std::exception_ptr error, const std::string& who) {
  if (!error) return error;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    return toTorchError(e, who);
  } catch (...) {
    return error;
  }
}

std::string forkedWhy(pid_t owner) {
  return "this process (pid " + std::to_string(currentPid()) + ") is a fork of process " + std::to_string(owner) +
         ", which made the process group: the group's threads, connections and shared memory are that "
         "process's, so only it can run the group's ops (a DataLoader worker or other forked child must leave "
         "communication to its parent)";
}

}  // namespace smddp::torchext
