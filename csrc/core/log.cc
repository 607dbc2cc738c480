#include "core/log.h"

#include <strings.h>
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

// Names are matched regardless of case, as NCCL_DEBUG's and NCCL_DEBUG_SUBSYS's are.
bool sameName(const std::string& a, const char* b) { return strcasecmp(a.c_str(), b) == 0; }

unsigned subsysBit(const std::string& name) {
  if (sameName(name, "INIT")) return kInit;
  if (sameName(name, "COLL")) return kColl;
  if (sameName(name, "SHM")) return kShm;
  if (sameName(name, "ENV")) return kEnv;
  if (sameName(name, "NET")) return kNet;
  if (sameName(name, "P2P")) return kP2p;
  if (sameName(name, "ALL")) return kAll;
  return 0;
}

// A setting the logger cannot read is said on stderr (the logger is not set up yet), once per
// process: a silently ignored SMDDP_DEBUG=info looks like a job that logs nothing.
void warnSetting(const Config& c, const char* name, const std::string& value, const char* what) {
  fprintf(stderr, "%s:%d:%ld SMDDP WARN %s=%s: %s\n", c.host, getpid(), (long)syscall(SYS_gettid), name,
          value.c_str(), what);
}

const Config& config() {
  static const Config cfg = [] {
    Config c;
    gethostname(c.host, sizeof(c.host) - 1);
    const std::string& lvl = env::debugLevel();
    if (sameName(lvl, "NONE")) c.level = kNone;
    else if (sameName(lvl, "WARN")) c.level = kWarn;
    else if (sameName(lvl, "INFO")) c.level = kInfo;
    else if (sameName(lvl, "TRACE")) c.level = kTrace;
    else warnSetting(c, "SMDDP_DEBUG", lvl, "not NONE, WARN, INFO or TRACE; logging warnings only");
    std::string subs = env::debugSubsys();
    bool invert = !subs.empty() && subs[0] == '^';
    if (invert) subs.erase(0, 1);
    unsigned mask = 0;
    std::stringstream ss(subs);
    for (std::string item; std::getline(ss, item, ',');) {
      const unsigned bit = subsysBit(item);
      if (bit == 0 && !item.empty()) {
        warnSetting(c, "SMDDP_DEBUG_SUBSYS", env::debugSubsys(),
                    ("no subsystem \"" + item + "\" (INIT, ENV, SHM, NET, COLL, P2P or ALL); ignored").c_str());
      }
      mask |= bit;
    }
    c.mask = invert ? ~mask : mask;
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
