// The key-value store used for bootstrap. The torch layer adapts c10d::Store to it; the
// benchmark binary and C++ tests can use any other implementation.
#pragma once

#include <string>

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

}  // namespace smddp
