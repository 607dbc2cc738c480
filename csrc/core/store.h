// The key-value store used for bootstrap. The torch layer adapts c10d::Store to it; the
// benchmark binary and C++ tests can use any other implementation.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"

namespace smddp {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` is set (or the store's own timeout expires, which throws).
  virtual std::string get(const std::string& key) = 0;
  // Whether `key` is set now; never blocks.
  virtual bool check(const std::string& key) = 0;
  // Removes `key`; false when it was not set, or when this store cannot remove keys.
  virtual bool deleteKey(const std::string& /*key*/) { return false; }
  // Adds `delta` to the integer under `key` (0 when not set), atomically; returns the sum.
  // Throws kInvalidUsage where the store has no such operation.
  virtual int64_t add(const std::string& key, int64_t delta);
  // get() of every key, in order. A set-up reads a record of every peer: a store that answers
  // them in a few round trips (c10d's TCPStore, TcpStore) spares a job of W ranks W round trips
  // per rank, and its server W^2 requests in all.
  virtual std::vector<std::string> multiGet(const std::vector<std::string>& keys) {
    std::vector<std::string> values;
    values.reserve(keys.size());
    for (const std::string& k : keys) values.push_back(get(k));
    return values;
  }
};

// keyOf(r) for every rank r < size that wanted(r) accepts: the records of its peers a set-up
// reads, for one multiGet.
template <class KeyOf, class Wanted>
std::vector<std::string> keysOf(int size, KeyOf&& keyOf, Wanted&& wanted) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) {
    if (wanted(r)) keys.push_back(keyOf(r));
  }
  return keys;
}
template <class KeyOf>
std::vector<std::string> keysOf(int size, KeyOf&& keyOf) {
  return keysOf(size, keyOf, [](int) { return true; });
}

// A setting every rank must share: rank 0 publishes `mine` under `key` and every rank returns
// rank 0's value (a rank compares it with its own to say when they differ).
inline std::string rank0Value(Store& store, int rank, const std::string& key, const std::string& mine) {
  if (rank != 0) return store.get(key);
  store.set(key, mine);
  return mine;
}

// A view of a store whose keys all start with `prefix`, so that a sub-protocol (one host's
// shared-memory domain, say) can reuse fixed key names without colliding with another's.
class PrefixStore : public Store {
 public:
  PrefixStore(Store& inner, std::string prefix) : inner_(inner), prefix_(std::move(prefix)) {}
  // Keeps `inner` alive as long as itself (StoreErrands' requests may outlive their group).
  PrefixStore(std::shared_ptr<Store> inner, std::string prefix)
      : owned_(std::move(inner)), inner_(*owned_), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::string& value) override { inner_.set(prefix_ + key, value); }
  std::string get(const std::string& key) override { return inner_.get(prefix_ + key); }
  bool check(const std::string& key) override { return inner_.check(prefix_ + key); }
  bool deleteKey(const std::string& key) override { return inner_.deleteKey(prefix_ + key); }
  int64_t add(const std::string& key, int64_t delta) override { return inner_.add(prefix_ + key, delta); }
  std::vector<std::string> multiGet(const std::vector<std::string>& keys) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const std::string& k : keys) full.push_back(prefix_ + k);
    return inner_.multiGet(full);
  }

 private:
  std::shared_ptr<Store> owned_;
  Store& inner_;
  std::string prefix_;
};

// A store may outlive the ranks that set a group up over it: torchrun (torch >= 2.5) hands the
// workers it restarts the store of the attempt that failed, every key of that attempt still in
// it under the same names. A rank that read one would take a dead rank's records (shared-memory
// names, ports) for its peer's. So a group's set-up first agrees on a namespace of its own,
// random, and keeps every other key under it.
//
// Rank 0 draws the namespace. Every other rank draws a ticket, publishes it under its rank and
// waits for the key named after the ticket, which only a rank 0 that read this ticket can have
// written. Rank 0 cannot tell a fresh ticket from a dead rank's, so it answers what it reads,
// re-reads the tickets of the ranks that have not confirmed, and answers again when one changes.
// Rank 0 polls the tickets, so every rank that has come is answered whoever is late, and
// publishes the ranks it has not heard from in the new namespace (namingLateRanks).
// `keysSet` gets the keys of `store` this rank is to remove once every rank has set up the group
// (no rank reads them then).
// Every rank's ticket and rank 0's answer carry the group's size as each was given it: a rank
// given another size than rank 0's fails here, naming both, and so does a second process that
// joins as a rank already taken; rank 0 returns its `refusal` for its set-up to publish.
struct FreshNamespace {
  std::string prefix;   // "<16 hex digits>/"
  // Rank 0: why the group cannot be set up, "" if it can: a rank given another size
  // (kInvalidUsage), or ranks that never came while others did (kTimeout).
  std::string refusal;
  ErrorCode refusalCode = ErrorCode::kInvalidUsage;
};
FreshNamespace freshNamespace(Store& store, int rank, int size, std::chrono::milliseconds timeout,
                              std::vector<std::string>& keysSet);

// `e` reworded to name the ranks rank 0 had not heard from at its latest look, read from a
// group's namespace (freshNamespace's prefix): they are why the key a rank's set-up waited for
// never came ("rank(s) 2 did not reach the group's set-up within the timeout (rank 0 waits for
// them; <e>)"). nullopt when `e` is no timeout, or rank 0 heard from all, or the store cannot say.
std::optional<Error> namingLateRanks(Store& groupStore, const Error& e);

// Set, with its error, by the first rank whose set-up of the group fails (publishFailure): a
// wait that reads no key of the failed rank's (ranks connecting to each other) looks at it now
// and then, and fails with that error instead of waiting out the timeout for a rank that gave up.
inline constexpr char kSetUpFailedKey[] = "smddp/set-up-failed";

// Throws the error a rank published under kSetUpFailedKey, if one did (kRemoteError, counted as
// BootstrapStore::get counts it where `store` is one). A store that fails to answer is left to
// the caller's own wait, which will say so.
void throwIfASetUpFailed(Store& store);

// For a set-up step that failed because of a peer (a connection it closed, a segment it already
// removed): what this rank saw is a consequence, and a peer whose set-up failed publishes its
// cause within a moment. Waits up to `patience` for it and throws it (throwIfASetUpFailed);
// returns if none came.
void throwFirstCauseWithin(Store& store, std::chrono::milliseconds patience);
// The patience set-up steps give it.
inline constexpr std::chrono::milliseconds kFirstCauseWait{1000};

// Runs `setUp`, a group's set-up over `groupStore`; a timeout it raises names the late ranks
// (namingLateRanks).
template <class Fn>
auto settingUp(Store& groupStore, Fn&& setUp) -> decltype(setUp()) {
  try {
    return setUp();
  } catch (const Error& e) {
    if (std::optional<Error> named = namingLateRanks(groupStore, e)) throw *named;
    throw;
  }
}

// The store as a group's set-up uses it. A rank whose set-up fails publishes its error under the
// keys its peers may still wait for (publishFailure), and get() turns such a value into that
// error: peers fail at once, naming the rank and its cause, instead of waiting out the store's
// timeout (the group's, 30 minutes by default) for a key that will never come; one host with a
// /dev/shm too small, or a setting only some ranks have, stops the whole job in seconds.
class BootstrapStore : public Store {
 public:
  explicit BootstrapStore(Store& inner) : inner_(inner) {}
  void set(const std::string& key, const std::string& value) override;
  // Throws kRemoteError with a failed peer's error where one stands in for the value.
  std::string get(const std::string& key) override;
  bool check(const std::string& key) override { return inner_.check(key); }
  bool deleteKey(const std::string& key) override { return inner_.deleteKey(key); }
  int64_t add(const std::string& key, int64_t delta) override { return inner_.add(key, delta); }
  // Throws as get() does for the first key that holds a failed peer's error.
  std::vector<std::string> multiGet(const std::vector<std::string>& keys) override;
  // Publishes "rank `rank` could not set up the process group: `why`" under each of `keys` this
  // rank has not set itself, and under kSetUpFailedKey unless a rank did first. Never throws:
  // the store may be what failed.
  void publishFailure(const std::vector<std::string>& keys, int rank, const std::string& why) noexcept;
  // publishFailure, then, on rank 0, awaitPeersKnowingOfFailure: at most 10 s (and `timeout`, the
  // group's), ending 2 s after the last rank counted (peers waiting elsewhere, or dead, would
  // not). A timeout of rank 0's own waits as well: peers already past the keys it failed to set
  // read its failure under the keys they wait for next, within milliseconds. Never throws.
  void tellPeersOfFailure(const std::vector<std::string>& keys, int rank, int size, std::chrono::milliseconds timeout,
                          const std::string& why) noexcept;
  // Waits up to `patience` for all `size` ranks to know that the set-up failed (each counts once:
  // as it publishes its own failure, or reads a peer's), and no longer than `quiet` after the
  // last one counted (peers waiting elsewhere, or dead, would not). Rank 0 calls it before
  // raising: its process may host the store (tcp://, env://), and a script exits when init
  // raises, so a peer that read after that would report the store's loss instead of the cause.
  // Never throws.
  void awaitPeersKnowingOfFailure(int size, std::chrono::milliseconds patience,
                                  std::chrono::milliseconds quiet) noexcept;
  // The keys set through this store so far.
  const std::set<std::string>& keysSet() const { return set_; }

 private:
  // Counts this rank among those that know the set-up failed, once. Never throws.
  void countKnowingOfFailure() noexcept;
  const std::string& unlessFailed(const std::string& value);

  Store& inner_;
  std::set<std::string> set_;  // keys this rank has set: their values are good
  bool knowsOfFailure_ = false;
};

}  // namespace smddp
