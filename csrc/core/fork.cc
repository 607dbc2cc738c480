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

pid_t currentPid() {
  const pid_t pid = cachedPid.load(std::memory_order_relaxed);
  return pid != 0 && registered ? pid : getpid();  // 0: asked during another file's static set-up
}

}  // namespace smddp
