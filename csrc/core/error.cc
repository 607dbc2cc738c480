#include "core/error.h"

#include <sys/resource.h>

#include <cctype>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace smddp {

const char* errorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidUsage: return "invalid usage";
    case ErrorCode::kNotSupported: return "not supported";
    case ErrorCode::kSystemError: return "system error";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kRemoteError: return "remote error";
    case ErrorCode::kAborted: return "aborted";
  }
  return "error";
}

namespace {
std::string formatList(const char* fmt, va_list ap) {
  char buf[2048];
  vsnprintf(buf, sizeof(buf), fmt, ap);
  return buf;
}
}  // namespace

std::string formatString(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = formatList(fmt, ap);
  va_end(ap);
  return s;
}

std::string joinRanks(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

void throwError(ErrorCode code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = formatList(fmt, ap);
  va_end(ap);
  throw Error(code, s);
}

std::string errnoString(int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* s = strerror_r(err, buf, sizeof(buf));
  std::string text = std::string(s) + " (errno " + std::to_string(err) + ")";
  // "Too many open files" alone sends users looking for a leak; a group's set-up opens a few
  // descriptors per peer, so a low `ulimit -n` is the usual cause, and the limit says so.
  if (err == EMFILE) {
    rlimit files{};
    if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY) {
      text += ": this process may open " + std::to_string(files.rlim_cur) + " files (ulimit -n); raise that limit";
    }
  } else if (err == ENFILE) {
    text += ": the system's limit on open files (sysctl fs.file-max) is reached";
  }
  return text;
}

std::string withoutRankPrefix(const std::string& what) {
  size_t at = 0;
  for (const std::string start : {"smddp rank ", "rank "}) {
    if (what.compare(at, start.size(), start) != 0) continue;
    size_t end = at + start.size();
    while (end < what.size() && what[end] >= '0' && what[end] <= '9') ++end;
    if (end > at + start.size() && what.compare(end, 2, ": ") == 0) at = end + 2;
  }
  return what.substr(at);
}

std::string inTheWordsOf(int rank, const std::string& why) {
  const auto isWordChar = [&](size_t i) { return std::isalnum(static_cast<unsigned char>(why[i])) != 0; };
  std::string out;
  size_t i = 0;
  while (i < why.size()) {
    const bool phrase = why.compare(i + 1, 8, "his rank") == 0 && (why[i] == 't' || why[i] == 'T') &&
                        (i == 0 || !isWordChar(i - 1)) && (i + 9 == why.size() || !isWordChar(i + 9));
    if (phrase) {
      out += why[i] == 'T' ? "Rank " : "rank ";
      out += std::to_string(rank);
      i += 9;
    } else {
      out += why[i++];
    }
  }
  return out;
}

}  // namespace smddp
