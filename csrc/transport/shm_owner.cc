#include "transport/shm_owner.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/hash.h"
#include "core/log.h"

namespace smddp::shm {
namespace {

constexpr uint64_t kStampMagic = 0x736d646470776e31ull;  // "smddpwn1"

uint64_t checksum(const OwnerStamp& s) { return fnv1a(kFnv1aBasis, &s, offsetof(OwnerStamp, check)); }

struct ProcessState {
  bool known = false;  // /proc/<pid>/stat was readable
  bool exited = false;  // zombie or dead
  uint64_t startTicks = 0;
};

// /proc/<pid>/stat's state (field 3) and start time (field 22).
ProcessState readProcess(int pid) {
  ProcessState st;
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = fopen(path, "r");
  if (f == nullptr) return st;
  char buf[1024];
  const size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char* p = strrchr(buf, ')');  // the command name before it may hold spaces and parentheses
  if (p == nullptr || p[1] != ' ') return st;
  st.known = true;
  st.exited = p[2] == 'Z' || p[2] == 'X';
  p += 2;  // at field 3
  for (int field = 3; field < 22 && p != nullptr; ++field) {
    p = strchr(p, ' ');
    if (p != nullptr) ++p;
  }
  if (p != nullptr) st.startTicks = strtoull(p, nullptr, 10);
  return st;
}

// Whether the name `st` describes has not changed for `grace`: its creator, which stamps it as
// soon as it has sized it, is gone (a creator's every step changes the name's ctime).
bool unstampedFor(const struct stat& st, std::chrono::seconds grace) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  return now.tv_sec - st.st_ctim.tv_sec >= grace.count();
}

}  // namespace

uint64_t pidNamespaceId() {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

OwnerStamp OwnerStamp::mine() {
  OwnerStamp s;
  s.magic = kStampMagic;
  s.pidNamespace = pidNamespaceId();
  s.pid = getpid();
  s.startTicks = readProcess(s.pid).startTicks;
  s.check = checksum(s);
  return s;
}

bool OwnerStamp::intact() const { return magic == kStampMagic && check == checksum(*this); }

bool OwnerStamp::creatorAlive() const {
  static const uint64_t ourNamespace = pidNamespaceId();
  if (pidNamespace == 0 || pidNamespace != ourNamespace) return true;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  // A killed process stays a zombie until its parent reaps it, and kill() still finds it.
  const ProcessState st = readProcess(pid);
  if (!st.known) return true;
  return !st.exited && (startTicks == 0 || st.startTicks == startTicks);
}

int sweepStaleNames(int rank, std::chrono::seconds unstampedGrace) {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  const uid_t me = geteuid();
  while (const dirent* e = readdir(dir)) {
    if (strncmp(e->d_name, "smddp-", 6) != 0) continue;
    const std::string name = std::string("/") + e->d_name;
    const int fd = shm_open(name.c_str(), O_RDONLY, 0);
    if (fd < 0) continue;  // another user's, or removed meanwhile
    struct stat st;
    OwnerStamp stamp;
    const bool ours = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == me;
    const bool whole = ours && pread(fd, &stamp, sizeof(stamp), 0) == static_cast<ssize_t>(sizeof(stamp));
    close(fd);
    if (!ours) continue;
    const bool stamped = whole && stamp.intact();
    if (stamped ? stamp.creatorAlive() : !unstampedFor(st, unstampedGrace)) continue;
    if (shm_unlink(name.c_str()) == 0) {
      ++removed;
      if (stamped) {
        SMDDP_INFO(kShm, "rank %d removed /dev/shm%s, left by pid %d, which has exited", rank, name.c_str(), stamp.pid);
      } else {
        SMDDP_INFO(kShm, "rank %d removed /dev/shm%s, which has had no owner stamp for %lld s or more (its creator "
                   "was killed as it made it)", rank, name.c_str(), static_cast<long long>(unstampedGrace.count()));
      }
    }
  }
  closedir(dir);
  return removed;
}

}  // namespace smddp::shm
