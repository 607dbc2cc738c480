#include "core/store.h"

#include "core/error.h"

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

}  // namespace smddp
