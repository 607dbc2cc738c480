#include "core/random.h"

#include <sys/random.h>

#include <vector>

#include "core/error.h"

namespace smddp {

std::string randomHex(size_t bytes) {
  std::vector<unsigned char> raw(bytes);
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = getrandom(raw.data() + got, bytes - got, 0);
    if (n < 0) throwError(ErrorCode::kSystemError, "getrandom failed: %s", errnoString(errno).c_str());
    got += static_cast<size_t>(n);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out += kHex[c >> 4];
    out += kHex[c & 15];
  }
  return out;
}

}  // namespace smddp
