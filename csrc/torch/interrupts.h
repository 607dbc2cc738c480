// Ctrl-C during smddp's waits, the Python side (core/interrupt.h has the signal's side): what a
// SIGINT noted there means to the program, and raising its KeyboardInterrupt.
#pragma once

namespace smddp::torchext {

// Called once, with the GIL, at import: registers the checker, the main thread and the handler.
void watchInterrupts(unsigned long mainThreadId);

// On the main thread: a SIGINT was noted, or its KeyboardInterrupt is owed (a wait that runs ops
// or moves point-to-point messages stops there and calls raiseInterrupt()).
bool interruptPending();

// On the main thread, where a SIGINT was noted or its KeyboardInterrupt is owed (an op this
// thread ran failed for it): runs Python's signal handlers, as the interpreter would between
// bytecodes, and throws what they raise (pybind11::error_already_set, which becomes the Python
// exception itself); returns where they raise nothing. Anywhere else: returns at once.
// Called without the GIL, outside any op.
void raiseInterrupt();

}  // namespace smddp::torchext
