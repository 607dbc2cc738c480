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

}  // namespace smddp
