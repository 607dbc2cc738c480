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
