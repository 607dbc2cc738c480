#include "core/store.h"

#include <algorithm>
#include <cctype>
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
// In the group's namespace: how many ranks know that its set-up failed.
constexpr char kKnowingOfFailureKey[] = "smddp/failure-known";
constexpr char kCouldNotSetUp[] = " could not set up the process group: ";

// Whether `what` is a rank's published account of its failed set-up: "rank N could not set up
// the process group: ...".
bool isSetUpFailure(const std::string& what) {
  size_t at = 5;
  if (what.compare(0, at, "rank ") != 0) return false;
  while (at < what.size() && std::isdigit(static_cast<unsigned char>(what[at]))) ++at;
  return at > 5 && what.compare(at, sizeof(kCouldNotSetUp) - 1, kCouldNotSetUp) == 0;
}
}  // namespace

const std::string& BootstrapStore::unlessFailed(const std::string& value) {
  if (value.compare(0, kFailedChars, kFailed) != 0) return value;
  countKnowingOfFailure();
  throw Error(ErrorCode::kRemoteError, value.substr(kFailedChars));
}

void BootstrapStore::countKnowingOfFailure() noexcept {
  if (knowsOfFailure_) return;
  knowsOfFailure_ = true;
  try {
    inner_.add(kKnowingOfFailureKey, 1);
  } catch (...) {  // the store is gone: nobody is waiting for the count
  }
}

void BootstrapStore::awaitPeersKnowingOfFailure(int size, std::chrono::milliseconds patience,
                                                std::chrono::milliseconds quiet) noexcept {
  countKnowingOfFailure();
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + patience;
  auto lastCounted = Clock::now();
  int64_t seen = 0;
  auto pause = std::chrono::milliseconds(1);
  try {
    for (int64_t known; (known = inner_.add(kKnowingOfFailureKey, 0)) < size;) {
      const auto now = Clock::now();
      if (known > seen) {
        seen = known;
        lastCounted = now;
      }
      if (now >= deadline || now - lastCounted >= quiet) return;
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
  } catch (...) {  // the store is gone: nothing to wait for
  }
}

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
    // A peer's account read from the store is passed on as it is: its rank is the one at fault,
    // where "rank 4 could not set up ...: rank 15 could not set up ..." named a relay first.
    const std::string own = withoutRankPrefix(why);  // named once
    const std::string account = isSetUpFailure(own) ? own : "rank " + std::to_string(rank) + kCouldNotSetUp + own;
    const std::string value = kFailed + account;
    for (const std::string& key : keys) {
      if (set_.count(key) == 0) inner_.set(key, value);
    }
    // The first cause, rather than a peer's account of it (rank 1 could not ...: rank 0 could not ...).
    if (!inner_.check(kSetUpFailedKey)) inner_.set(kSetUpFailedKey, value);
  } catch (...) {  // the store is gone too: peers will hear of that from it
  }
  countKnowingOfFailure();
}

void BootstrapStore::tellPeersOfFailure(const std::vector<std::string>& keys, int rank, int size,
                                        std::chrono::milliseconds timeout, const std::string& why) noexcept {
  // Rank 0's patience is as long as it answers ranks of another world size (freshNamespace); its
  // peers waiting on the keys it failed to set read them within milliseconds.
  constexpr auto kPatience = std::chrono::seconds(10);
  constexpr auto kQuiet = std::chrono::seconds(2);
  publishFailure(keys, rank, why);
  if (rank == 0) awaitPeersKnowingOfFailure(size, std::min<std::chrono::milliseconds>(kPatience, timeout), kQuiet);
}

void throwIfASetUpFailed(Store& store) {
  try {
    if (!store.check(kSetUpFailedKey)) return;
  } catch (const Error&) {
    return;
  }
  const std::string value = store.get(kSetUpFailedKey);  // a BootstrapStore throws the error itself
  if (value.compare(0, kFailedChars, kFailed) == 0) throw Error(ErrorCode::kRemoteError, value.substr(kFailedChars));
}

void throwFirstCauseWithin(Store& store, std::chrono::milliseconds patience) {
  for (const auto until = std::chrono::steady_clock::now() + patience; std::chrono::steady_clock::now() < until;) {
    throwIfASetUpFailed(store);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
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

namespace {
// A ticket's value: "<hex> <group size>"; its answer's: "<namespace> <rank 0's group size>".
// The sizes travel with them so that a rank started with another world_size (or, with new_group,
// other ranks) fails at once, naming both sizes, instead of waiting out the timeout for ranks
// that will never come.
struct Sized {
  std::string word;
  int size = -1;  // -1: not a number (left by a build before sizes travelled): no check
};

Sized parseSized(const std::string& value) {
  Sized out;
  const size_t space = value.find(' ');
  out.word = value.substr(0, space);
  if (space == std::string::npos) return out;
  try {
    size_t used = 0;
    const int n = std::stoi(value.substr(space + 1), &used);
    if (used == value.size() - space - 1 && n > 0) out.size = n;
  } catch (const std::exception&) {  // stoi's invalid_argument or out_of_range: not a size
  }
  return out;
}

// Ranks of one launch start within seconds of each other; one that comes later than this after
// a mismatch waits out its timeout, naming rank 0's silence.
constexpr std::chrono::seconds kMismatchGrace{10};

std::string sized(const std::string& word, int size) { return word + " " + std::to_string(size); }

std::string sizeMismatch(int rank0Size, int rank, int size) {
  return formatString("rank 0 sets the group up with %d rank(s) and rank %d with %d%s: every rank must be given the "
                      "same world_size (with new_group, the same ranks)",
                      rank0Size, rank, size, rank >= rank0Size ? ", so rank 0 has no such rank" : "");
}
}  // namespace

FreshNamespace freshNamespace(Store& store, int rank, int size, std::chrono::milliseconds timeout,
                              std::vector<std::string>& keysSet) {
  auto ticketKey = [](int r) { return "smddp/ticket/" + std::to_string(r); };
  auto answerKey = [](const std::string& ticket) { return "smddp/answer/" + ticket; };
  auto confirmKey = [](const std::string& ns, int r) { return "smddp/confirm/" + ns + "/" + std::to_string(r); };
  if (rank != 0) {
    const std::string ticket = randomHex(8);
    store.set(ticketKey(rank), sized(ticket, size));
    // This rank's, though rank 0 set the answer: only this rank knows which answer it read.
    keysSet.insert(keysSet.end(), {ticketKey(rank), answerKey(ticket)});
    Sized answer;
    try {
      answer = parseSized(store.get(answerKey(ticket)));
    } catch (const Error& e) {
      if (!isTimeout(e)) throw;
      throwError(ErrorCode::kTimeout,
                 "rank 0 never answered this rank's arrival: it did not reach the group's set-up within the timeout, "
                 "or another process joined as rank %d and was answered instead (%s)",
                 rank, e.what());
    }
    // Counted, not set: a second process started as this rank (two launches given the same
    // RANK) reads the same answer, and the count tells it so. Confirmed even where the sizes
    // differ, so that rank 0 stops waiting for this rank and tells the others.
    int64_t claims = 1;
    try {
      claims = store.add(confirmKey(answer.word, rank), 1);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidUsage) throw;
      store.set(confirmKey(answer.word, rank), "1");  // a store that cannot add: no such check
    }
    keysSet.push_back(confirmKey(answer.word, rank));
    if (answer.size > 0 && answer.size != size) {
      throwError(ErrorCode::kInvalidUsage, "%s", sizeMismatch(answer.size, rank, size).c_str());
    }
    if (claims > 1) {
      throwError(ErrorCode::kInvalidUsage,
                 "another process has joined the group as rank %d too: every process must be given a rank of its own",
                 rank);
    }
    return {answer.word + "/", ""};
  }
  const std::string ns = randomHex(8);
  const std::string answerValue = sized(ns, size);
  std::vector<std::string> answered(size);  // the ticket each rank was last answered for
  std::vector<int> answeredSize(size, size);  // the size that ticket named
  std::vector<int> pending;
  for (int r = 1; r < size; ++r) pending.push_back(r);
  std::string waiting;  // the ranks not come yet, as last published under kNotArrivedKey
  const std::string notArrivedKey = ns + "/" + kNotArrivedKey;
  bool notArrivedSet = false;
  std::string mismatch;  // the first rank that came with another size, as sizeMismatch says it
  std::chrono::steady_clock::time_point mismatchSeen;
  // Past this group's last rank, up to the largest size a ticket named: ranks that cannot join,
  // answered (once per ticket) so that they fail at once naming rank 0's size.
  int outsideEnd = size;
  std::vector<std::string> outsideAnswered;
  // Rank r's ticket, answered where it is not the one answered last (`last`, updated).
  auto answerTicket = [&](int r, std::string& last) {
    const Sized ticket = parseSized(store.get(ticketKey(r)));
    if (ticket.word != last) {
      store.set(answerKey(ticket.word), answerValue);
      // The rank that drew a ticket answered before never reads that answer now.
      if (!last.empty()) keysSet.push_back(answerKey(last));
      last = ticket.word;
    }
    return ticket;
  };
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    // A size is taken from a ticket once its rank has confirmed: only then is the ticket known to
    // be this run's (a restarted job's store may hold tickets of a run with another world_size).
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [&](int r) {
                                   if (!store.check(confirmKey(ns, r))) return false;
                                   if (answeredSize[r] > 0 && answeredSize[r] != size && mismatch.empty()) {
                                     mismatch = sizeMismatch(size, r, answeredSize[r]);
                                     mismatchSeen = std::chrono::steady_clock::now();
                                     outsideEnd = std::max(outsideEnd, answeredSize[r]);
                                   }
                                   return true;
                                 }),
                  pending.end());
    // Polled, not waited for in rank order: every rank that has come is answered, whoever is late.
    std::vector<int> absent;
    for (int r : pending) {
      if (!store.check(ticketKey(r))) {
        absent.push_back(r);
        continue;
      }
      answeredSize[r] = answerTicket(r, answered[r]).size;
    }
    outsideAnswered.resize(static_cast<size_t>(outsideEnd - size));
    bool outsideAllTold = true;
    for (int r = size; r < outsideEnd; ++r) {
      std::string& last = outsideAnswered[static_cast<size_t>(r - size)];
      if (!last.empty() && store.check(confirmKey(ns, r))) continue;
      outsideAllTold = false;
      if (store.check(ticketKey(r))) answerTicket(r, last);
    }
    if (std::string now = joinRanks(absent); now != waiting) {
      waiting = std::move(now);
      store.set(notArrivedKey, waiting);
      if (!notArrivedSet) keysSet.push_back(notArrivedKey);
      notArrivedSet = true;
    }
    if (pending.empty() && outsideAllTold) break;
    // After a mismatch some ranks may never come (started with a smaller world_size, or past the
    // end of rank 0's): rank 0 answers those that come within kMismatchGrace and then stops,
    // telling the answered ones through its own set-up's keys (FreshNamespace::refusal), which
    // they wait for next.
    if (!mismatch.empty() && std::chrono::steady_clock::now() > mismatchSeen + kMismatchGrace) break;
    if (std::chrono::steady_clock::now() > deadline) {
      const std::string late = formatString("rank(s) %s did not reach the group's set-up within %lld ms",
                                            waiting.c_str(), static_cast<long long>(timeout.count()));
      // The ranks answered wait in the new namespace for rank 0's keys, each until its own
      // deadline, a moment after this one: told there (Communicator::refuseSetUp), they name the
      // late ranks rather than the loss of the store that rank 0's process may host.
      if (!absent.empty() && pending.size() + 1 < static_cast<size_t>(size)) {
        return {ns + "/", late, ErrorCode::kTimeout};
      }
      if (!absent.empty()) throwError(ErrorCode::kTimeout, "%s", late.c_str());
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
  return {ns + "/", mismatch};
}

}  // namespace smddp
