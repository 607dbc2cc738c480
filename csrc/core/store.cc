#include "core/store.h"

#include <algorithm>
#include <thread>

#include "core/error.h"
#include "core/random.h"

namespace smddp {
namespace {
// Starts a value that stands for a failure; no key's value can start so (they are ranks' own
// records: addresses, numbers, hex, host records).
constexpr char kFailed[] = "\x01smddp: set-up failed\x01";
constexpr size_t kFailedChars = sizeof(kFailed) - 1;
}  // namespace

void BootstrapStore::set(const std::string& key, const std::string& value) {
  inner_.set(key, value);
  set_.insert(key);
}

std::string BootstrapStore::get(const std::string& key) {
  std::string value = inner_.get(key);
  if (value.compare(0, kFailedChars, kFailed) == 0) throw Error(ErrorCode::kRemoteError, value.substr(kFailedChars));
  return value;
}

void BootstrapStore::publishFailure(const std::vector<std::string>& keys, int rank, const std::string& why) noexcept {
  try {
    // The error may name the rank already; once is enough.
    std::string cause = why;
    for (const std::string& named : {formatString("smddp rank %d: ", rank), formatString("rank %d: ", rank)}) {
      if (cause.compare(0, named.size(), named) == 0) cause.erase(0, named.size());
    }
    const std::string value =
        kFailed + formatString("rank %d could not set up the process group: %s", rank, cause.c_str());
    for (const std::string& key : keys) {
      if (set_.count(key) == 0) inner_.set(key, value);
    }
  } catch (...) {  // the store is gone too: peers will hear of that from it
  }
}

namespace {
// The store's own timeout on a key some rank never wrote, said as what it means here.
template <class Fn>
std::string awaitRank(Fn&& get, const char* fmt, int rank) {
  try {
    return get();
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kTimeout) throw;
    throwError(ErrorCode::kTimeout, "%s (%s)", formatString(fmt, rank).c_str(), e.what());
  }
}
}  // namespace

std::string freshNamespace(Store& store, int rank, int size, std::chrono::milliseconds timeout) {
  auto ticketKey = [](int r) { return "smddp/ticket/" + std::to_string(r); };
  auto answerKey = [](const std::string& ticket) { return "smddp/answer/" + ticket; };
  auto confirmKey = [](const std::string& ns, int r) { return "smddp/confirm/" + ns + "/" + std::to_string(r); };
  if (rank != 0) {
    const std::string ticket = randomHex(8);
    store.set(ticketKey(rank), ticket);
    const std::string ns = awaitRank([&] { return store.get(answerKey(ticket)); },
                                     "rank %d of the group never answered this rank's arrival: it did not reach the "
                                     "group's set-up within the timeout",
                                     0);
    store.set(confirmKey(ns, rank), "1");
    return ns + "/";
  }
  const std::string ns = randomHex(8);
  std::vector<std::string> answered(size);  // the ticket each rank was last answered for
  std::vector<int> pending;
  for (int r = 1; r < size; ++r) pending.push_back(r);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  while (!pending.empty()) {
    for (int r : pending) {
      // Blocks until rank r has come at least once.
      std::string ticket = awaitRank([&] { return store.get(ticketKey(r)); },
                                     "rank %d did not reach the group's set-up within the timeout", r);
      if (ticket != answered[r]) {
        store.set(answerKey(ticket), ns);
        answered[r] = ticket;
      }
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&](int r) { return store.check(confirmKey(ns, r)); }),
                  pending.end());
    if (pending.empty()) break;
    if (std::chrono::steady_clock::now() > deadline) {
      std::string ranks;
      for (int r : pending) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      throwError(ErrorCode::kTimeout,
                 "rank(s) %s did not join the group's set-up within %lld ms (the ticket the store holds for them "
                 "may be left from an earlier run over the same store, by ranks since gone)",
                 ranks.c_str(), static_cast<long long>(timeout.count()));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
  return ns + "/";
}

}  // namespace smddp
