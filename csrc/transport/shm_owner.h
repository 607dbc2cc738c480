// Who created a name in /dev/shm. Every name smddp creates there (topology tokens, segments)
// begins with its creator's stamp, so that names left by a process killed while it set up a group
// (SIGKILL, or the SIGTERM torchrun sends its workers: the names live only during set-up) can be
// told from names in use, and removed by the next group set up on the host.
#pragma once

#include <chrono>
#include <cstdint>

namespace smddp::shm {

struct OwnerStamp {
  uint64_t magic = 0;
  uint64_t pidNamespace = 0;  // inode of the creator's pid namespace (0: unknown): `pid` means it there only
  uint64_t startTicks = 0;    // the creator's start, in clock ticks after boot (0: unknown); tells a reused pid
  int32_t pid = 0;
  int32_t reserved = 0;
  uint64_t check = 0;         // over the fields above: a stamp read while being written fails it

  // This process's stamp.
  static OwnerStamp mine();
  // Whole and of this format (not zeros, not torn, not another version's).
  bool intact() const;
  // False only where this process can tell the creator is gone: it shares our pid namespace and
  // has exited, is a zombie, or its pid names a process started later. Across pid namespaces
  // (containers sharing /dev/shm but not their pids) it cannot tell, and answers true.
  bool creatorAlive() const;
};

// This process's pid namespace, by its inode; 0 where /proc does not say.
uint64_t pidNamespaceId();

// A name without an intact stamp is one being created (its creator stamps it microseconds after
// creating it), or one whose creator was killed in between: after this long, the latter.
constexpr std::chrono::seconds kUnstampedGrace{60};

// Removes the names smddp left in /dev/shm that belong to this user and whose creators are gone
// (creatorAlive() false), or that have had no intact stamp for `unstampedGrace`; names of live
// processes, of other users or other pid namespaces stay. Returns how many it removed. Cheap (a
// directory listing); run once per process, at its first set-up of a group of two or more ranks.
int sweepStaleNames(int rank, std::chrono::seconds unstampedGrace = kUnstampedGrace);

}  // namespace smddp::shm
