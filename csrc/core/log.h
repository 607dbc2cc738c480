// Level + subsystem logging to stderr or SMDDP_DEBUG_FILE, prefixed "host:pid:tid SMDDP LEVEL".
// The level and subsystem checks happen before any formatting, so disabled logs cost a branch.
// As in NCCL, the subsystems (SMDDP_DEBUG_SUBSYS) select INFO and TRACE lines: a warning is
// always logged unless SMDDP_DEBUG=NONE.
#pragma once

namespace smddp::log {

enum Level { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };
enum Subsys : unsigned {
  kInit = 1u << 0,
  kColl = 1u << 1,
  kShm = 1u << 2,
  kEnv = 1u << 3,
  kNet = 1u << 4,
  kP2p = 1u << 5,
  kAll = ~0u
};

bool enabled(Level level, Subsys subsys);
void write(Level level, Subsys subsys, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));

}  // namespace smddp::log

#define SMDDP_LOG(LEVEL, SUBSYS, ...)                                                            \
  do {                                                                                           \
    if (::smddp::log::enabled(::smddp::log::LEVEL, ::smddp::log::SUBSYS))                        \
      ::smddp::log::write(::smddp::log::LEVEL, ::smddp::log::SUBSYS, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

#define SMDDP_WARN(SUBSYS, ...) SMDDP_LOG(kWarn, SUBSYS, __VA_ARGS__)
#define SMDDP_INFO(SUBSYS, ...) SMDDP_LOG(kInfo, SUBSYS, __VA_ARGS__)
#define SMDDP_TRACE(SUBSYS, ...) SMDDP_LOG(kTrace, SUBSYS, __VA_ARGS__)
