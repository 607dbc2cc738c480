#include "core/log.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>

#include "core/env.h"

namespace smddp::log {
namespace {

struct Config {
  Level level = kWarn;
  unsigned mask = kAll;
  char host[64] = {};
};

unsigned subsysBit(const std::string& name) {
  if (name == "INIT") return kInit;
  if (name == "COLL") return kColl;
  if (name == "SHM") return kShm;
  if (name == "ENV") return kEnv;
  if (name == "NET") return kNet;
  if (name == "P2P") return kP2p;
  if (name == "ALL") return kAll;
  return 0;
}

const Config& config() {
  static const Config cfg = [] {
    Config c;
    const std::string& lvl = env::debugLevel();
    if (lvl == "NONE") c.level = kNone;
    else if (lvl == "INFO") c.level = kInfo;
    else if (lvl == "TRACE") c.level = kTrace;
    else c.level = kWarn;
    std::string subs = env::debugSubsys();
    bool invert = !subs.empty() && subs[0] == '^';
    if (invert) subs.erase(0, 1);
    unsigned mask = 0;
    std::stringstream ss(subs);
    for (std::string item; std::getline(ss, item, ',');) mask |= subsysBit(item);
    c.mask = invert ? ~mask : mask;
    gethostname(c.host, sizeof(c.host) - 1);
    return c;
  }();
  return cfg;
}

// SMDDP_DEBUG_FILE's pattern, as NCCL_DEBUG_FILE's: %h = host name, %p = process id, %% = %.
std::string expandPath(const std::string& pattern, const char* host) {
  std::string path;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '%' || i + 1 == pattern.size()) {
      path += pattern[i];
      continue;
    }
    const char c = pattern[++i];
    if (c == 'h') path += host;
    else if (c == 'p') path += std::to_string(getpid());
    else if (c == '%') path += '%';
    else path.append(1, '%').append(1, c);  // not a placeholder: kept as written
  }
  return path;
}

// Opened at the first line logged, so a process that logs nothing leaves no file behind.
FILE* output() {
  static FILE* const out = [] {
    const std::string& pattern = env::debugFile();
    if (pattern.empty()) return stderr;
    const std::string path = expandPath(pattern, config().host);
    // Appended to, so ranks given one name add their lines rather than erase each other's;
    // close-on-exec, so processes the program starts do not hold it.
    FILE* f = fopen(path.c_str(), "ae");
    if (f == nullptr) {
      fprintf(stderr, "%s:%d:%ld SMDDP WARN SMDDP_DEBUG_FILE=%s: cannot open %s (%s); logging to stderr\n",
              config().host, getpid(), (long)syscall(SYS_gettid), pattern.c_str(), path.c_str(), strerror(errno));
      return stderr;
    }
    setvbuf(f, nullptr, _IOLBF, 0);  // whole lines reach the file, even if the process is killed next
    return f;
  }();
  return out;
}

const char* levelName(Level level) {
  switch (level) {
    case kWarn: return "WARN";
    case kInfo: return "INFO";
    case kTrace: return "TRACE";
    default: return "";
  }
}

}  // namespace

bool enabled(Level level, Subsys subsys) {
  const Config& c = config();
  return level <= c.level && (level == kWarn || (c.mask & subsys) != 0);
}

void write(Level level, Subsys, const char* file, int line, const char* fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  const char* base = strrchr(file, '/');
  base = base ? base + 1 : file;
  // One fprintf per line so lines from several threads do not interleave.
  if (level == kWarn) {
    fprintf(output(), "%s:%d:%ld SMDDP WARN %s:%d %s\n", config().host, getpid(), (long)syscall(SYS_gettid), base,
            line, msg);
  } else {
    fprintf(output(), "%s:%d:%ld SMDDP %s %s\n", config().host, getpid(), (long)syscall(SYS_gettid),
            levelName(level), msg);
  }
}

}  // namespace smddp::log
