// The c10d store a process group is created with, as the torch-free core's Store.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/store.h"

namespace smddp::torchext {

// Failures of the c10d store become smddp errors, so that one during an op (a group's first
// all_to_all reads peers' addresses) fails the op like any other: named, and the group broken.
// Reads wait as long as the group's timeout says, not the store's own (init_process_group's,
// which a later group may exceed: its ranks would give up on a late rank 0 sooner than rank 0
// on them, and blame each other).
class C10dStore : public Store {
 public:
  C10dStore(c10::intrusive_ptr<c10d::Store> store, std::chrono::milliseconds timeout)
      : store_(std::move(store)), timeout_(timeout) {}
  void set(const std::string& key, const std::string& value) override {
    guarded("setting", key, [&] { store_->set(key, std::vector<uint8_t>(value.begin(), value.end())); });
  }
  std::string get(const std::string& key) override {
    std::string value;
    guarded("reading", key, [&] {
      try {
        store_->wait({key}, timeout_);
      } catch (const std::exception& e) {
        if (isTimeout(e)) timedOut({key});  // the store answered: the key never came
        throw;
      }
      auto v = store_->get(key);
      value.assign(v.begin(), v.end());
    });
    return value;
  }
  bool check(const std::string& key) override {
    bool found = false;
    guarded("checking", key, [&] { found = store_->check({key}); });
    return found;
  }
  bool deleteKey(const std::string& key) override {
    bool deleted = false;
    guarded("deleting", key, [&] { deleted = store_->deleteKey(key); });
    return deleted;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    int64_t sum = 0;
    guarded("adding to", key, [&] { sum = store_->add(key, delta); });
    return sum;
  }
  // c10d's TCPStore waits for them all in one request, then reads them in another.
  std::vector<std::string> multiGet(const std::vector<std::string>& keys) override {
    std::vector<std::string> values;
    if (keys.empty()) return values;
    const std::string what = keys.size() == 1 ? keys[0] : keys[0] + " (and " + std::to_string(keys.size() - 1) +
                                                               " more keys)";
    guarded("reading", what, [&] {
      try {
        store_->wait(keys, timeout_);
      } catch (const std::exception& e) {
        if (isTimeout(e)) timedOut(keys);
        throw;
      }
      for (const std::vector<uint8_t>& v : store_->multiGet(keys)) values.emplace_back(v.begin(), v.end());
    });
    return values;
  }

 private:
  template <class Fn>
  static void guarded(const char* what, const std::string& key, Fn&& fn) {
    try {
      fn();
    } catch (const Error&) {
      throw;  // timedOut()'s, which says what was missing
    } catch (const std::exception& e) {
      std::string why = e.what();
      why = why.substr(0, why.find('\n'));  // c10 appends a C++ backtrace
      if (isTimeout(e)) {
        throwError(ErrorCode::kTimeout, "the process group's store did not answer while %s %s (%s)", what, key.c_str(),
                   why.c_str());
      }
      throwError(ErrorCode::kRemoteError,
                 "the process group's store failed while %s %s (%s): the process that hosts it (rank 0's, for "
                 "init_method tcp:// or env://) may have exited",
                 what, key.c_str(), why.c_str());
    }
  }
  // The store's own timeout: TCPStore's DistStoreError; FileStore's are plain c10::Errors (its
  // get's, and its wait's).
  static bool isTimeout(const std::exception& e) {
    return dynamic_cast<const c10::DistStoreError*>(&e) != nullptr ||
           std::strncmp(e.what(), "Timeout waiting for key", 23) == 0 || std::strncmp(e.what(), "Wait timeout", 12) == 0;
  }
  // Whether `key`'s last part is a rank ("smddp/topo/info/11"), not a ticket's 16 hex digits.
  static bool endsInARank(const std::string& key) {
    const std::string last = key.substr(key.rfind('/') + 1);
    return !last.empty() && last.size() <= 7 &&
           std::all_of(last.begin(), last.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
  }
  // Which of `keys` never came, rather than the store's list of all of them: their names end in
  // the rank that sets them (the set-up's keys), so the message names the ranks that did not come.
  [[noreturn]] void timedOut(const std::vector<std::string>& keys) {
    std::string missing;
    size_t count = 0;
    bool ranked = false;  // a missing key ends in the rank that sets it
    for (const std::string& k : keys) {
      bool there = true;
      try {
        there = store_->check({k});
      } catch (const std::exception&) {
      }
      if (there) continue;
      missing += (count++ ? ", " : "") + k;
      ranked |= endsInARank(k);
    }
    throwError(ErrorCode::kTimeout, "timed out after %lld ms waiting for %zu of %zu keys in the process group's store: %s%s",
               static_cast<long long>(timeout_.count()), count, keys.size(), count ? missing.c_str() : "(none missing now)",
               ranked ? " (the number that ends a key is the rank that sets it, counted within its host where the key "
                        "names one, as in smddp/host1/...: that rank has not come this far into the set-up, being "
                        "late, stalled or gone)"
                      : "");
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
};

}  // namespace smddp::torchext
