// Ctrl-C in a blocking call. CPython runs its SIGINT handler (which raises KeyboardInterrupt)
// only between bytecodes, so a thread blocked in a collective did not answer Ctrl-C until the op
// ended or timed out (gloo's waits and torch's TCP store do the same). smddp puts a handler in
// front of SIGINT's that notes the signal and then calls the one it replaced, so that waits
// which sleep can look (the signal also wakes their futex or poll with EINTR), and asks the
// Python layer (a Checker) whether the signal ends the wait.
// Only the Python main thread acts on the signal: it is the one Python runs handlers on.
#pragma once

#include <atomic>

namespace smddp::interrupt {

namespace detail {
extern std::atomic<bool> noted;
}  // namespace detail

// SIGINT arrived since the last clearNoted() (which may have been handled already: a hint to look).
inline bool noted() { return detail::noted.load(std::memory_order_relaxed); }
void clearNoted();

// `id`: the program's main thread (pthread_t, as Python's threading.main_thread().ident gives
// it). Until set (and with SMDDP_INTERRUPTIBLE_WAITS=0) nothing here acts.
void setMainThread(unsigned long id);
bool onMainThread();

// On the main thread: puts the handler in front of SIGINT's, unless it is there already or
// SIGINT is ignored or left to its default. A program may replace the handler at any time
// (Python's signal.signal()), so waits about to sleep call this; it looks at most every 100 ms.
void watch();

// Whether a SIGINT noted ends a wait on the main thread in the middle of an op (the Python
// layer's answer: it does where Python's own handler would raise KeyboardInterrupt, which the
// layer then owes the program). Runs on the main thread only, after noted().
using Checker = bool (*)();
void setChecker(Checker checker);

// For a wait in the middle of an op, after each sleep (the signal cuts a futex or poll short):
// whether the noted SIGINT ends it, as the checker says; only ever on the main thread.
bool endsWait();
// The error such a wait throws, Error(kAborted) "interrupted by SIGINT (KeyboardInterrupt) while
// <what>": the op then fails as any other failure does (its peers are told).
[[noreturn]] void throwInterrupted(const char* what);
inline void throwIfInterrupted(const char* what) {
  if (noted() && endsWait()) throwInterrupted(what);
}

}  // namespace smddp::interrupt
