// hybrimoe._engine.measure_*: device measurements for calibration (src/runtime/calibration.h).
#include "runtime/calibration.h"
#include "common.h"

namespace hybrimoe_bind {

void bind_calibration(py::module_ & m) {
    m.def("measure_h2d_s", [](uintptr_t device, size_t bytes, int reps) {
              py::gil_scoped_release nogil;
              return hybrimoe::measure_h2d_s(reinterpret_cast<ggml_backend_dev_t>(device), bytes, reps);
          }, py::arg("device"), py::arg("bytes"), py::arg("reps") = 5,
          "Seconds per host-to-device copy of `bytes` to a ggml device (int pointer): median of `reps` copies, "
          "each synchronised, from the device's pinned host buffer type if it has one. RuntimeError on failure.");

    m.def("measure_copy_overlap", [](uintptr_t device, size_t bytes, int reps) {
              py::gil_scoped_release nogil;
              return hybrimoe::measure_copy_overlap(reinterpret_cast<ggml_backend_dev_t>(device), bytes, reps);
          }, py::arg("device"), py::arg("bytes"), py::arg("reps") = 5,
          "Share (0..1) of a host-to-device copy of `bytes` during which the device still computes (CostModel."
          "copy_overlap): a copy alone, a matrix-product chain of about its time alone, both together; median of "
          "`reps`. RuntimeError on failure.");

    m.def("measure_cpu_copy_overlap", [](uintptr_t device, size_t bytes, int reps, int n_threads) {
              py::gil_scoped_release nogil;
              return hybrimoe::measure_cpu_copy_overlap(reinterpret_cast<ggml_backend_dev_t>(device), bytes, reps,
                                                        n_threads);
          }, py::arg("device"), py::arg("bytes"), py::arg("reps") = 5, py::arg("n_threads") = 1,
          "Share (0..1) of a host-to-device copy of `bytes` during which the host CPU still computes at full speed "
          "(CostModel.cpu_copy_overlap): copies queued as the engine queues them alone, a memory-bound CPU chain "
          "(n_threads threads) of about their time alone, both together; median of `reps`. RuntimeError on failure.");
}

}  // namespace hybrimoe_bind
