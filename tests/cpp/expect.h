// The few lines every C++ test binary here shares: count checks, print each failure, and end
// with the "N passed, N failed" line tests/test_core_cpp.py looks for.
#pragma once

#include <cstdio>
#include <string>

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

}  // namespace smddp::test
