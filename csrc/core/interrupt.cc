#include "core/interrupt.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cstring>

#include "core/env.h"
#include "core/error.h"

namespace smddp::interrupt {

namespace detail {
std::atomic<bool> noted{false};
}  // namespace detail

namespace {

std::atomic<bool> gMainKnown{false};
pthread_t gMain;
std::atomic<Checker> gChecker{nullptr};
// The handler ours calls on: written only while ours is not installed (watch()).
struct sigaction gPrevious;
int64_t gLastLookNs = 0;  // main thread only

void onSigint(int sig, siginfo_t* info, void* context) {
  const int savedErrno = errno;
  detail::noted.store(true, std::memory_order_relaxed);
  if (gPrevious.sa_flags & SA_SIGINFO) {
    gPrevious.sa_sigaction(sig, info, context);
  } else if (gPrevious.sa_handler != SIG_DFL && gPrevious.sa_handler != SIG_IGN) {
    gPrevious.sa_handler(sig);
  }
  errno = savedErrno;
}

bool isOurs(const struct sigaction& a) { return (a.sa_flags & SA_SIGINFO) && a.sa_sigaction == &onSigint; }

}  // namespace

void clearNoted() { detail::noted.store(false, std::memory_order_relaxed); }

void setMainThread(unsigned long id) {
  if (env::interruptibleWaits() == 0) return;
  gMain = static_cast<pthread_t>(id);
  gMainKnown.store(true, std::memory_order_release);
}

bool onMainThread() {
  return gMainKnown.load(std::memory_order_acquire) && pthread_equal(pthread_self(), gMain);
}

void watch() {
  if (!onMainThread()) return;
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch()).count();
  if (gLastLookNs != 0 && now - gLastLookNs < 100'000'000) return;
  gLastLookNs = now;
  struct sigaction current;
  if (sigaction(SIGINT, nullptr, &current) != 0 || isOurs(current)) return;
  if (!(current.sa_flags & SA_SIGINFO) && (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN)) return;
  gPrevious = current;
  struct sigaction ours = current;  // the same mask and flags (whether calls restart, ...)
  ours.sa_flags |= SA_SIGINFO;
  ours.sa_sigaction = &onSigint;
  sigaction(SIGINT, &ours, nullptr);
}

void setChecker(Checker checker) { gChecker.store(checker, std::memory_order_release); }

bool endsWait() {
  const Checker checker = gChecker.load(std::memory_order_acquire);
  return checker != nullptr && onMainThread() && checker();
}

void throwInterrupted(const char* what) {
  throwError(ErrorCode::kAborted, "interrupted by SIGINT (KeyboardInterrupt) while %s", what);
}

}  // namespace smddp::interrupt
