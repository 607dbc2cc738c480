// The Python extension smddp._C: the backend class, its creator and a few introspection helpers.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "core/env.h"
#include "core/reduce.h"
#include "torch/backend.h"
#include "torch/flight_recorder.h"
#include "torch/interrupts.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "smddp: shared-memory collective backend for torch.distributed";
  // The c10d::Backend base type and the intrusive_ptr holder come from torch's own bindings.
  py::module::import("torch._C._distributed_c10d");
  py::class_<smddp::torchext::SmddpBackend, c10d::Backend, c10::intrusive_ptr<smddp::torchext::SmddpBackend>>(
      m, "SmddpBackend")
      // What split_group deep-copies from its parent; also lets users read the group's timeout.
      .def_property_readonly("options", &smddp::torchext::SmddpBackend::getBackendOptions)
      .def("_topology", &smddp::torchext::SmddpBackend::topologySummary)
      // Whether ops carry a fingerprint peers compare (SMDDP_DEBUG_CHECKS, TORCH_DISTRIBUTED_DEBUG=DETAIL).
      .def_property_readonly("_debug_checks", &smddp::torchext::SmddpBackend::debugChecks)
      // Bytes of receive scratch the inter-host collectives hold (tests check its bound).
      .def("_net_scratch_bytes", &smddp::torchext::SmddpBackend::netScratchBytes);

  m.def(
      "_create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
         const std::chrono::duration<float>& timeout, std::vector<int64_t> globalRanks, const std::string& groupUid) {
        try {
          return smddp::torchext::createBackend(store, rank, size,
                                                std::chrono::duration_cast<std::chrono::milliseconds>(timeout),
                                                std::move(globalRanks), groupUid);
        } catch (...) {
          smddp::torchext::raiseInterrupt();  // a set-up that a Ctrl-C ended raises KeyboardInterrupt
          throw;
        }
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("global_ranks"),
      py::arg("group_uid") = "",
      // Bootstrap blocks on the store: let other Python threads run meanwhile.
      py::call_guard<py::gil_scoped_release>());

  // smddp's atexit handler (see SmddpBackend::shutDownLiveGroups). Without the GIL: a pending
  // op's Python callbacks run on the groups' threads as their ops fail.
  m.def("_shut_down_live_groups", &smddp::torchext::SmddpBackend::shutDownLiveGroups,
        py::call_guard<py::gil_scoped_release>());

  // At import: Ctrl-C ends the main thread's waits (SMDDP_INTERRUPTIBLE_WAITS; torch/interrupts.h).
  m.def("_watch_interrupts", &smddp::torchext::watchInterrupts, py::arg("main_thread_id"));

  // setup.py runs this once after a build: formatting numbers into a message is what every error
  // of the extension does, and it crashes when the compiler's C++ headers do not match the
  // libstdc++ loaded at run time (seen with a second gcc in /opt on a GPU image).
  m.def("_format_selftest", [] { return c10::str("rank ", 7, ": ", 1.5, " ", int64_t{-3}); });
  m.def("_dump_flight_recorder", [] { return py::bytes(smddp::torchext::FlightRecorder::get().dump()); });
  m.def("_torch_version", [] { return std::string(SMDDP_TORCH_VERSION); });
  m.def("_reduce_isa", [] { return std::string(smddp::isaName(smddp::activeIsa())); });
  m.def("_env_params", [] {
    py::list out;
    for (const auto& p : smddp::env::allParams()) {
      out.append(py::dict(py::arg("name") = p.name, py::arg("default") = p.defaultValue, py::arg("help") = p.help,
                          py::arg("value") = p.value));
    }
    return out;
  });
}
