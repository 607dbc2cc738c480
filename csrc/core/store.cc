#include "core/store.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "core/error.h"
#include "core/random.h"

namespace smddp {
namespace {
// Starts a value that stands for a failure; no key's value can start so (they are ranks' own
// records: addresses, numbers, hex, host records).
constexpr char kFailed[] = "\x01smddp: set-up failed\x01";
constexpr size_t kFailedChars = sizeof(kFailed) - 1;

const std::string& unlessFailed(const std::string& value) {
  if (value.compare(0, kFailedChars, kFailed) == 0) throw Error(ErrorCode::kRemoteError, value.substr(kFailedChars));
  return value;
}
}  // namespace

int64_t Store::add(const std::string& key, int64_t /*delta*/) {
  throwError(ErrorCode::kInvalidUsage, "this store cannot add to a key (%s)", key.c_str());
}

void BootstrapStore::set(const std::string& key, const std::string& value) {
  inner_.set(key, value);
  set_.insert(key);
}

std::string BootstrapStore::get(const std::string& key) { return unlessFailed(inner_.get(key)); }

std::vector<std::string> BootstrapStore::multiGet(const std::vector<std::string>& keys) {
  std::vector<std::string> values = inner_.multiGet(keys);
  for (const std::string& v : values) unlessFailed(v);
  return values;
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
bool isTimeout(const Error& e) { return e.code() == ErrorCode::kTimeout; }
// In the group's namespace: the ranks rank 0 has not heard from yet, as a list ("" once all came).
constexpr char kNotArrivedKey[] = "smddp/not-arrived";
}  // namespace

std::optional<Error> namingLateRanks(Store& groupStore, const Error& e) {
  if (!isTimeout(e)) return std::nullopt;
  std::string late;
  try {
    if (groupStore.check(kNotArrivedKey)) late = groupStore.get(kNotArrivedKey);
  } catch (const Error&) {  // the store is gone: nothing to add
  }
  if (late.empty()) return std::nullopt;
  return Error(ErrorCode::kTimeout, formatString("rank(s) %s did not reach the group's set-up within the timeout "
                                                 "(rank 0 waits for them; %s)",
                                                 late.c_str(), e.what()));
}

std::string freshNamespace(Store& store, int rank, int size, std::chrono::milliseconds timeout,
                           std::vector<std::string>& keysSet) {
  auto ticketKey = [](int r) { return "smddp/ticket/" + std::to_string(r); };
  auto answerKey = [](const std::string& ticket) { return "smddp/answer/" + ticket; };
  auto confirmKey = [](const std::string& ns, int r) { return "smddp/confirm/" + ns + "/" + std::to_string(r); };
  if (rank != 0) {
    const std::string ticket = randomHex(8);
    store.set(ticketKey(rank), ticket);
    // This rank's, though rank 0 set the answer: only this rank knows which answer it read.
    keysSet.insert(keysSet.end(), {ticketKey(rank), answerKey(ticket)});
    std::string ns;
    try {
      ns = store.get(answerKey(ticket));
    } catch (const Error& e) {
      if (!isTimeout(e)) throw;
      throwError(ErrorCode::kTimeout,
                 "rank 0 never answered this rank's arrival: it did not reach the group's set-up within the timeout "
                 "(%s)",
                 e.what());
    }
    store.set(confirmKey(ns, rank), "1");
    keysSet.push_back(confirmKey(ns, rank));
    return ns + "/";
  }
  const std::string ns = randomHex(8);
  std::vector<std::string> answered(size);  // the ticket each rank was last answered for
  std::vector<int> pending;
  for (int r = 1; r < size; ++r) pending.push_back(r);
  std::string waiting;  // the ranks not come yet, as last published under kNotArrivedKey
  const std::string notArrivedKey = ns + "/" + kNotArrivedKey;
  bool notArrivedSet = false;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    // Polled, not waited for in rank order: every rank that has come is answered, whoever is late.
    std::vector<int> absent;
    for (int r : pending) {
      if (!store.check(ticketKey(r))) {
        absent.push_back(r);
        continue;
      }
      const std::string ticket = store.get(ticketKey(r));
      if (ticket != answered[r]) {
        store.set(answerKey(ticket), ns);
        // The rank that drew a ticket answered before never reads that answer now.
        if (!answered[r].empty()) keysSet.push_back(answerKey(answered[r]));
        answered[r] = ticket;
      }
    }
    if (std::string now = joinRanks(absent); now != waiting) {
      waiting = std::move(now);
      store.set(notArrivedKey, waiting);
      if (!notArrivedSet) keysSet.push_back(notArrivedKey);
      notArrivedSet = true;
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&](int r) { return store.check(confirmKey(ns, r)); }),
                  pending.end());
    if (pending.empty()) break;
    if (std::chrono::steady_clock::now() > deadline) {
      if (!absent.empty()) {
        throwError(ErrorCode::kTimeout, "rank(s) %s did not reach the group's set-up within %lld ms",
                   waiting.c_str(), static_cast<long long>(timeout.count()));
      }
      throwError(ErrorCode::kTimeout,
                 "rank(s) %s did not join the group's set-up within %lld ms (the ticket the store holds for them "
                 "may be left from an earlier run over the same store, by ranks since gone)",
                 joinRanks(pending).c_str(), static_cast<long long>(timeout.count()));
    }
    std::this_thread::sleep_for(pause);
    // Each look reads every pending rank's keys: a large group's looks come less often, so that
    // the store (which every other rank is using too) is not swamped while ranks trickle in.
    const auto cap = std::chrono::milliseconds(std::clamp<int64_t>(static_cast<int64_t>(pending.size()) / 4, 20, 250));
    pause = std::min(pause * 2, cap);
  }
  return ns + "/";
}

}  // namespace smddp
