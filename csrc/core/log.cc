#include "core/log.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
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
  return level <= c.level && (c.mask & subsys) != 0;
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
    fprintf(stderr, "%s:%d:%ld SMDDP WARN %s:%d %s\n", config().host, getpid(), (long)syscall(SYS_gettid), base,
            line, msg);
  } else {
    fprintf(stderr, "%s:%d:%ld SMDDP %s %s\n", config().host, getpid(), (long)syscall(SYS_gettid),
            levelName(level), msg);
  }
}

}  // namespace smddp::log
