#include "core/file_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/error.h"

namespace smddp {

FileStore::FileStore(std::string dir, std::chrono::milliseconds timeout) : dir_(std::move(dir)), timeout_(timeout) {}

std::string FileStore::pathOf(const std::string& key) const {
  std::string name;
  for (char c : key) name += (c == '/') ? '%' : c;
  return dir_ + "/" + name;
}

void FileStore::set(const std::string& key, const std::string& value) {
  // Write then rename, so a reader never sees a partial value.
  const std::string path = pathOf(key);
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << value;
    if (!f) throwError(ErrorCode::kSystemError, "FileStore: cannot write %s", tmp.c_str());
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    throwError(ErrorCode::kSystemError, "FileStore: rename to %s failed: %s", path.c_str(), errnoString(errno).c_str());
  }
}

std::string FileStore::get(const std::string& key) {
  const std::string path = pathOf(key);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (true) {
    std::ifstream f(path, std::ios::binary);
    if (f) {
      std::stringstream ss;
      ss << f.rdbuf();
      return ss.str();
    }
    if (std::chrono::steady_clock::now() > deadline) {
      throwError(ErrorCode::kTimeout, "FileStore: timed out waiting for key %s in %s", key.c_str(), dir_.c_str());
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

bool FileStore::check(const std::string& key) { return access(pathOf(key).c_str(), F_OK) == 0; }

}  // namespace smddp
