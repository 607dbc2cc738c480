// The key-value store used for bootstrap. The torch layer adapts c10d::Store to it; the
// benchmark binary and C++ tests can use any other implementation.
#pragma once

#include <set>
#include <string>
#include <vector>

namespace smddp {

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` is set (or the store's own timeout expires, which throws).
  virtual std::string get(const std::string& key) = 0;
};

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
  void set(const std::string& key, const std::string& value) override { inner_.set(prefix_ + key, value); }
  std::string get(const std::string& key) override { return inner_.get(prefix_ + key); }

 private:
  Store& inner_;
  std::string prefix_;
};

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
  // Publishes "rank `rank` could not set up the process group: `why`" under each of `keys` this
  // rank has not set itself. Never throws: the store may be what failed.
  void publishFailure(const std::vector<std::string>& keys, int rank, const std::string& why) noexcept;

 private:
  Store& inner_;
  std::set<std::string> set_;  // keys this rank has set: their values are good
};

}  // namespace smddp
