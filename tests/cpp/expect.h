// The few lines every C++ test binary here shares: count checks, print each failure, and end
// with the "N passed, N failed" line tests/test_core_cpp.py looks for.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace smddp::test {

inline int passed = 0;
inline int failed = 0;

inline void expect(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAIL %s\n", what.c_str());
  }
}

// Prints the summary line; the process exit code.
inline int report() {
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

using DirTest = std::function<void(const std::string& dir)>;

// Runs each test with a directory of its own (for its FileStore), made under /tmp from `name`
// and removed afterwards; false if one could not be made.
inline bool runInOwnDirs(const std::string& name, const std::vector<DirTest>& tests) {
  for (const DirTest& test : tests) {
    std::string dir = "/tmp/" + name + ".XXXXXX";
    if (!mkdtemp(dir.data())) return false;
    test(dir);
    std::filesystem::remove_all(dir);
  }
  return true;
}

}  // namespace smddp::test
