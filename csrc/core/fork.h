// Fork awareness. A child made by fork() has only the thread that called it; the threads of
// objects made before the fork are gone there, and their sockets and shared memory are still
// the parent's, in use by it. Such objects must neither run nor tear down in the child (a join
// would wait for a thread that is not there; closing a connection politely shuts it down for the
// parent too): they compare the process they were made in with the current one.
#pragma once

#include <sys/types.h>

namespace smddp {

// The calling process's id: a load of a value a pthread_atfork handler keeps current, where
// getpid() is a system call (85 ns on the development VM), so every op can check it for free.
pid_t currentPid();

}  // namespace smddp
