#include "core/fork.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>

namespace smddp {
namespace {

std::atomic<pid_t> cachedPid{0};

void refreshPid() { cachedPid.store(getpid(), std::memory_order_relaxed); }

// At load: fork() runs the handler in the child before it returns there, so no code of the
// child ever reads the parent's id.
const bool registered = [] {
  refreshPid();
  return pthread_atfork(nullptr, nullptr, refreshPid) == 0;
}();

}  // namespace

// Not yet registered: asked during another file's static set-up (or pthread_atfork failed).
pid_t currentPid() { return registered ? cachedPid.load(std::memory_order_relaxed) : getpid(); }

}  // namespace smddp
