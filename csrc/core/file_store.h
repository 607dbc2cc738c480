// A Store over a shared directory (like gloo's --shared-path): lets torch-free programs (the
// benchmark binary, C++ tests) bootstrap ranks that run as separate processes on one host.
#pragma once

#include <chrono>
#include <string>

#include "core/store.h"

namespace smddp {

class FileStore : public Store {
 public:
  FileStore(std::string dir, std::chrono::milliseconds timeout);
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key) override;
  bool check(const std::string& key) override;

 private:
  std::string pathOf(const std::string& key) const;
  std::string dir_;
  std::chrono::milliseconds timeout_;
};

}  // namespace smddp
