#include "common.h"

#include "policy/cost_model.h"

namespace hybrimoe_bind {

void bind_cost_model(py::module_ & m) {
    using hybrimoe::CostModel;
    py::class_<CostModel>(m, "CostModel", "Per-expert and per-layer costs in seconds (HybriMoE §IV.B). JSON files "
                                          "(schema hybrimoe.cost_model/4; /3, /2 and /1 are read too): hybrimoe.policy."
                                          "load_cost_model / save_cost_model.")
        .def(py::init<>())
        .def_readwrite("cpu_a_s", &CostModel::cpu_a_s)
        .def_readwrite("cpu_b_s", &CostModel::cpu_b_s)
        .def_readwrite("cpu_c_s", &CostModel::cpu_c_s,
                       "Extra seconds of each of a CPU expert's first CPU_SMALL_ROWS rows (row-by-row kernels).")
        .def_readwrite("cpu_startup_s", &CostModel::cpu_startup_s)
        .def_readwrite("gpu_a_s", &CostModel::gpu_a_s)
        .def_readwrite("gpu_b_s", &CostModel::gpu_b_s)
        .def_readwrite("h2d_bandwidth_Bps", &CostModel::h2d_bandwidth_Bps)
        .def_readwrite("h2d_latency_s", &CostModel::h2d_latency_s)
        .def_readwrite("act_a_s", &CostModel::act_a_s)
        .def_readwrite("act_b_s", &CostModel::act_b_s)
        .def_readwrite("layer_a_s", &CostModel::layer_a_s)
        .def_readwrite("layer_b_s", &CostModel::layer_b_s)
        .def_readwrite("dense_a_s", &CostModel::dense_a_s)
        .def_readwrite("dense_b_s", &CostModel::dense_b_s)
        .def_readwrite("copy_overlap", &CostModel::copy_overlap,
                       "Share (0..1) of a host-to-device copy's time during which the device still computes (1: a "
                       "copy engine beside compute; 0: one thing at a time, as the RPC stand-in).")
        .def_readwrite("cpu_copy_overlap", &CostModel::cpu_copy_overlap,
                       "Share (0..1) of a host-to-device copy's time during which the host's CPU share still runs at "
                       "full speed (1: copies cost the CPU nothing; 0: the copies issued for a layer delay its CPU "
                       "share by their whole time).")
        .def_readwrite("disk_bandwidth_Bps", &CostModel::disk_bandwidth_Bps,
                       "Read bandwidth of the disk holding the model file, bytes/s (0: no disk figures).")
        .def_readwrite("disk_latency_s", &CostModel::disk_latency_s, "Seconds one read waits before data flows.")
        .def_readwrite("disk_queue_depth", &CostModel::disk_queue_depth,
                       "Reads in flight at once that still gain throughput (>= 1); they share the bandwidth.")
        .def_property_readonly("has_disk", &CostModel::has_disk, "Whether the disk figures are known.")
        .def("disk_read", &CostModel::disk_read, py::arg("bytes"),
             "Seconds to read `bytes` from the disk with no other read in flight (infinity without disk figures).")
        .def("cpu", &CostModel::cpu, py::arg("n_tokens"),
             "CPU seconds of one expert over n tokens (no start-up): a + b*n + c*min(n, CPU_SMALL_ROWS).")
        .def("gpu", &CostModel::gpu, py::arg("n_tokens"), "GPU seconds of one expert over n tokens.")
        .def("h2d", &CostModel::h2d, py::arg("bytes"), "Seconds to copy `bytes` host to device.")
        .def("act", &CostModel::act, py::arg("n_tokens"), "Activation round trip of a GPU share, seconds.")
        .def("layer", &CostModel::layer, py::arg("n_tokens"), "Non-expert seconds of a MoE layer.")
        .def("dense", &CostModel::dense, py::arg("n_tokens"), "Seconds of a dense layer.")
        .def("validate", &CostModel::validate,
             "Raises ValueError naming the first field that is negative or not finite, a bandwidth that is not > 0, "
             "a copy_overlap or cpu_copy_overlap above 1, or a disk_queue_depth below 1.")
        .def("__repr__", [](const CostModel & c) {
            return "CostModel(cpu=" + std::to_string(c.cpu_a_s) + "+" + std::to_string(c.cpu_b_s) + "n, gpu=" +
                   std::to_string(c.gpu_a_s) + "+" + std::to_string(c.gpu_b_s) + "n, h2d_bw=" +
                   std::to_string(c.h2d_bandwidth_Bps) + ")";
        });
    m.attr("CPU_SMALL_ROWS") = CostModel::kCpuSmallRows;
}

}  // namespace hybrimoe_bind
