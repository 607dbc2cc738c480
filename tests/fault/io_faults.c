// An LD_PRELOAD library that makes a process's system calls behave as the kernel may, but on a
// quiet machine seldom does, so that the code handling those cases runs in every test that
// loads it:
//
// - Stream sockets move less than asked: send, sendmsg, recv and recvmsg (MSG_PEEK included)
//   transfer a random prefix of the request, down to one byte, as a full socket buffer or a
//   segment boundary would make them.
// - A send that would not block (MSG_DONTWAIT or an O_NONBLOCK socket) sometimes returns EAGAIN
//   without moving anything, as the kernel's TCP memory pressure makes it do even with room in
//   the buffer; a blocking send or receive sometimes returns EINTR, as if a signal had come. A
//   non-blocking receive is only cut short: it fails with EAGAIN only when nothing has arrived,
//   which code may rely on (no other thread reads these sockets).
// - A signal storm: a thread of this library sends a signal with a handler that does nothing,
//   installed without SA_RESTART, to a random thread of the process every few hundred
//   microseconds, so that poll(), futex waits, sleeps, process_vm_readv and every blocking call
//   of every thread get interrupted (poll() and the sleeps fail with EINTR even under
//   SA_RESTART, so any handler does this to them: a profiler's SIGPROF, pytest-timeout's SIGALRM).
//
// IO_FAULTS_SEED seeds the choices (default 1); IO_FAULTS_SIGNAL_US sets the storm's period (0:
// no storm); IO_FAULTS_LOG names a file to which each process appends one line per kind of fault
// the first time it injects it ("<pid> short", "eagain", "eintr", "signal"), so a test can tell
// that the faults really happened.
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum Fault { kShort, kEagain, kEintr, kSignal, kFaults };
static const char* const kFaultNames[kFaults] = {"short", "eagain", "eintr", "signal"};
static int logged[kFaults];

static ssize_t (*real_send)(int, const void*, size_t, int);
static ssize_t (*real_recv)(int, void*, size_t, int);
static ssize_t (*real_sendmsg)(int, const struct msghdr*, int);
static ssize_t (*real_recvmsg)(int, struct msghdr*, int);

static uint64_t seed = 1;
static __thread uint64_t rng;

static uint64_t next_random(void) {
  if (rng == 0) rng = (seed * 0x9E3779B97F4A7C15ull) ^ (uint64_t)syscall(SYS_gettid) ^ 0x2545F4914F6CDD1Dull;
  rng ^= rng << 13;  // xorshift64
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

// Once per process and kind: the test reads these lines to know the faults were exercised.
static void note(enum Fault f) {
  if (__atomic_exchange_n(&logged[f], 1, __ATOMIC_RELAXED)) return;
  const char* path = getenv("IO_FAULTS_LOG");
  if (path == NULL) return;
  const int saved = errno;  // the caller reads errno after us
  const int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd >= 0) {
    char line[64];
    const int n = snprintf(line, sizeof line, "%d %s\n", (int)getpid(), kFaultNames[f]);
    if (write(fd, line, (size_t)n) < 0) {
    }
    close(fd);
  }
  errno = saved;
}

static int is_stream_socket(int fd) {
  int type = 0;
  socklen_t len = sizeof type;
  const int saved = errno;
  const int stream = getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM;
  errno = saved;
  return stream;
}

static int would_not_block(int fd, int flags) {
  return (flags & MSG_DONTWAIT) || (fcntl(fd, F_GETFL) & O_NONBLOCK);
}

// Before a transfer of `len` bytes on `fd`: -1 with errno set to fail it, else how many bytes
// to offer the kernel (a random prefix half the time, biased towards small ones).
static ssize_t choose(int fd, int flags, size_t len, int sending) {
  if (len == 0 || !is_stream_socket(fd)) return (ssize_t)len;
  const uint64_t r = next_random();
  if (r % 16 == 0) {
    const int nonblocking = would_not_block(fd, flags);
    if (nonblocking && sending) {
      note(kEagain);
      errno = EAGAIN;
      return -1;
    }
    if (!nonblocking) {
      note(kEintr);
      errno = EINTR;
      return -1;
    }
  }
  if ((r >> 8) % 2 == 0 || len == 1) return (ssize_t)len;
  static const size_t caps[] = {1, 3, 17, 300, 4096, 65536};
  const size_t cap = caps[(r >> 16) % (sizeof caps / sizeof caps[0])];
  const size_t limit = cap < len ? cap : len - 1;
  note(kShort);
  return (ssize_t)(1 + (r >> 32) % limit);
}

ssize_t send(int fd, const void* buf, size_t len, int flags) {
  const ssize_t n = choose(fd, flags, len, 1);
  return n < 0 ? -1 : real_send(fd, buf, (size_t)n, flags);
}

ssize_t recv(int fd, void* buf, size_t len, int flags) {
  const ssize_t n = choose(fd, flags, len, 0);
  return n < 0 ? -1 : real_recv(fd, buf, (size_t)n, flags);
}

// sendmsg/recvmsg: the chosen prefix of the iovecs, in a copy of the caller's header.
static ssize_t message_call(int fd, struct msghdr* msg, int flags, int sending) {
  size_t total = 0;
  for (size_t i = 0; i < msg->msg_iovlen; ++i) total += msg->msg_iov[i].iov_len;
  const ssize_t n = choose(fd, flags, total, sending);
  if (n < 0) return -1;
  if ((size_t)n == total) return sending ? real_sendmsg(fd, msg, flags) : real_recvmsg(fd, msg, flags);
  struct iovec iov[64];
  struct msghdr cut = *msg;
  size_t left = (size_t)n, k = 0;
  for (; k < msg->msg_iovlen && k < 64 && left > 0; ++k) {
    iov[k] = msg->msg_iov[k];
    if (iov[k].iov_len > left) iov[k].iov_len = left;
    left -= iov[k].iov_len;
  }
  cut.msg_iov = iov;
  cut.msg_iovlen = k;
  const ssize_t got = sending ? real_sendmsg(fd, &cut, flags) : real_recvmsg(fd, &cut, flags);
  msg->msg_flags = cut.msg_flags;
  return got;
}

ssize_t sendmsg(int fd, const struct msghdr* msg, int flags) {
  return message_call(fd, (struct msghdr*)msg, flags, 1);
}

ssize_t recvmsg(int fd, struct msghdr* msg, int flags) { return message_call(fd, msg, flags, 0); }

// The storm: SIGURG's default is to ignore it, so a stray one (before our handler, or after a
// program replaced it) harms nothing.
#define STORM_SIGNAL SIGURG

static void on_storm_signal(int sig) { (void)sig; }

static void* storm(void* arg) {
  const long period_us = (long)(intptr_t)arg;
  const pid_t self = (pid_t)syscall(SYS_gettid), pid = getpid();
  for (;;) {
    const struct timespec pause = {period_us / 1000000, (period_us % 1000000) * 1000};
    nanosleep(&pause, NULL);
    pid_t tids[256];
    int count = 0;
    DIR* dir = opendir("/proc/self/task");
    if (dir == NULL) continue;
    for (struct dirent* e; (e = readdir(dir)) != NULL && count < 256;) {
      const pid_t tid = (pid_t)atoi(e->d_name);
      if (tid > 0 && tid != self) tids[count++] = tid;
    }
    closedir(dir);
    if (count > 0 && syscall(SYS_tgkill, pid, tids[next_random() % (uint64_t)count], STORM_SIGNAL) == 0) {
      note(kSignal);
    }
  }
  return NULL;
}

static void start_storm(void) {
  const char* us = getenv("IO_FAULTS_SIGNAL_US");
  const long period_us = us ? atol(us) : 500;
  if (period_us <= 0) return;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_storm_signal;  // no SA_RESTART: interrupted calls return EINTR
  sigemptyset(&sa.sa_mask);
  sigaction(STORM_SIGNAL, &sa, NULL);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);  // the storm thread takes no signal itself
  pthread_t t;
  pthread_create(&t, &attr, storm, (void*)(intptr_t)period_us);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
}

// A child that fork() made without exec() (which would load this library afresh) notes its own
// faults. It has no storm: the storm's thread did not survive the fork, and starting threads
// between fork() and exec() is what a child must not do.
static void after_fork_in_child(void) {
  memset(logged, 0, sizeof logged);
  rng = 0;
}

__attribute__((constructor)) static void init(void) {
  real_send = (ssize_t(*)(int, const void*, size_t, int))dlsym(RTLD_NEXT, "send");
  real_recv = (ssize_t(*)(int, void*, size_t, int))dlsym(RTLD_NEXT, "recv");
  real_sendmsg = (ssize_t(*)(int, const struct msghdr*, int))dlsym(RTLD_NEXT, "sendmsg");
  real_recvmsg = (ssize_t(*)(int, struct msghdr*, int))dlsym(RTLD_NEXT, "recvmsg");
  const char* s = getenv("IO_FAULTS_SEED");
  if (s) seed = strtoull(s, NULL, 10);
  pthread_atfork(NULL, NULL, after_fork_in_child);
  start_storm();
}
