// An LD_PRELOAD library that makes process_vm_readv() fail, or take long, where smddp reads a
// host-mate's memory (single-copy collectives and point-to-point): reads that the kernel may
// refuse mid-job (the peer exited: ESRCH; a security module changed its mind: EPERM) but that a
// healthy machine never refuses once set-up's probe has passed.
//
// Only reads of another process of more than 64 bytes are touched, so set-up's probe of each
// peer (one 8-byte word) still passes and the single-copy paths are chosen. The variables are
// read at each such call, so a rank's script can arm them after init_process_group:
//   VM_READ_FAULT_ERRNO     fail each such read with this errno (a number; unset or 0: do not)
//   VM_READ_FAULT_DELAY_MS  sleep this long before each such read (before failing it, if armed)
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static long env_number(const char* name) {
  const char* v = getenv(name);
  return v ? strtol(v, NULL, 10) : 0;
}

ssize_t process_vm_readv(pid_t pid, const struct iovec* local, unsigned long liovcnt, const struct iovec* remote,
                         unsigned long riovcnt, unsigned long flags) {
  static ssize_t (*real)(pid_t, const struct iovec*, unsigned long, const struct iovec*, unsigned long,
                         unsigned long);
  if (real == NULL) real = dlsym(RTLD_NEXT, "process_vm_readv");
  size_t bytes = 0;
  for (unsigned long i = 0; i < riovcnt; ++i) bytes += remote[i].iov_len;
  if (pid != getpid() && bytes > 64) {
    const long delay_ms = env_number("VM_READ_FAULT_DELAY_MS");
    if (delay_ms > 0) {
      struct timespec ts = {delay_ms / 1000, (delay_ms % 1000) * 1000000L};
      nanosleep(&ts, NULL);
    }
    const long err = env_number("VM_READ_FAULT_ERRNO");
    if (err > 0) {
      errno = (int)err;
      return -1;
    }
  }
  return real(pid, local, liovcnt, remote, riovcnt, flags);
}
