#include "torch/interrupts.h"

#include <pybind11/pybind11.h>

#include <signal.h>

#include "core/interrupt.h"

namespace py = pybind11;

namespace smddp::torchext {
namespace {

// A SIGINT that ended an op (the checker took it from Python's own flag): the KeyboardInterrupt
// its handler would have raised, still to be raised by raiseInterrupt(). Main thread only.
bool gOwed = false;

// _signal's functions, not signal.py's: Python code would run the interpreter's loop, which runs
// the pending handler then and there.
bool defaultHandlerInstalled() {
  py::module_ signal = py::module_::import("_signal");
  return signal.attr("getsignal")(SIGINT).is(signal.attr("default_int_handler"));
}

// core/interrupt.h's Checker, on the main thread, in the middle of an op. Only Python's default
// handler ends the op: it raises KeyboardInterrupt and does nothing else, so the signal can be
// taken now and the exception raised once the op has failed. Any other handler is left to run
// where Python would run it, outside the op (it may issue ops itself, or save a checkpoint).
bool opEndsOnSigint() {
  if (!Py_IsInitialized()) return false;
  py::gil_scoped_acquire gil;
#if PY_VERSION_HEX >= 0x030D0000
  if (Py_IsFinalizing()) return false;
#else
  if (_Py_IsFinalizing()) return false;
#endif
  try {
    if (!defaultHandlerInstalled()) return false;
  } catch (py::error_already_set&) {
    return false;  // (the error is dropped with it)
  }
  interrupt::clearNoted();  // before taking Python's flag: a later signal is noted again
  if (!PyOS_InterruptOccurred()) return false;  // noted, but Python has handled it already
  gOwed = true;
  return true;
}

}  // namespace

void watchInterrupts(unsigned long mainThreadId) {
  interrupt::setChecker(&opEndsOnSigint);
  interrupt::setMainThread(mainThreadId);
  interrupt::watch();
}

bool interruptPending() { return interrupt::onMainThread() && (interrupt::noted() || gOwed); }

void raiseInterrupt() {
  if (!interruptPending() || !Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  interrupt::clearNoted();
  if (gOwed) {
    gOwed = false;
    PyErr_SetNone(PyExc_KeyboardInterrupt);
  } else if (PyErr_CheckSignals() == 0) {
    return;
  }
  throw py::error_already_set();
}

}  // namespace smddp::torchext
