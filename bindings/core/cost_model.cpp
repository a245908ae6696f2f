#include "common.h"

#include "policy/cost_model.h"

namespace hybrimoe_bind {

void bind_cost_model(py::module_ & m) {
    using hybrimoe::CostModel;
    py::class_<CostModel>(m, "CostModel", "Per-expert and per-layer costs in seconds (HybriMoE §IV.B). "
                                          "JSON (schema hybrimoe.cost_model/3; /2 and /1 are read too): cost_model_from_json / cost_model_to_json / "
                                          "load_cost_model / save_cost_model.")
        .def(py::init<>())
        .def_readwrite("cpu_a_s", &CostModel::cpu_a_s)
        .def_readwrite("cpu_b_s", &CostModel::cpu_b_s)
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
                       "share by their whole time, as the RPC stand-in's synchronous sends do).")
        .def("cpu", &CostModel::cpu, py::arg("n_tokens"), "CPU seconds of one expert over n tokens (no start-up).")
        .def("gpu", &CostModel::gpu, py::arg("n_tokens"), "GPU seconds of one expert over n tokens.")
        .def("h2d", &CostModel::h2d, py::arg("bytes"), "Seconds to copy `bytes` host to device.")
        .def("act", &CostModel::act, py::arg("n_tokens"), "Activation round trip of a GPU share, seconds.")
        .def("layer", &CostModel::layer, py::arg("n_tokens"), "Non-expert seconds of a MoE layer.")
        .def("dense", &CostModel::dense, py::arg("n_tokens"), "Seconds of a dense layer.")
        .def("validate", &CostModel::validate, "Raises ValueError naming a negative or non-finite field.")
        .def("__repr__", [](const CostModel & c) {
            return "CostModel(cpu=" + std::to_string(c.cpu_a_s) + "+" + std::to_string(c.cpu_b_s) + "n, gpu=" +
                   std::to_string(c.gpu_a_s) + "+" + std::to_string(c.gpu_b_s) + "n, h2d_bw=" +
                   std::to_string(c.h2d_bandwidth_Bps) + ")";
        });

    using hybrimoe::CostModelError;
    m.attr("COST_MODEL_SCHEMA") = hybrimoe::kCostModelSchema;
    m.attr("COST_MODEL_SCHEMA_V2") = hybrimoe::kCostModelSchemaV2;
    m.attr("COST_MODEL_SCHEMA_V1") = hybrimoe::kCostModelSchemaV1;
    // CostModelError derives from std::invalid_argument: pybind11 raises it as ValueError with the message.
    m.def("cost_model_from_json",
          [](const std::string & text, const std::string & where) {
              std::map<std::string, std::string> sources;
              CostModel cm = hybrimoe::cost_model_from_json(text, where, &sources);
              return std::make_pair(cm, sources);
          },
          py::arg("text"), py::arg("where") = "cost model",
          "Parses a hybrimoe.cost_model/3 (or /2, /1) document; returns (CostModel, sources dict). ValueError naming `where` "
          "and the problem (not valid JSON, not an object, schema, missing/unknown/bad field).");
    m.def("cost_model_to_json", &hybrimoe::cost_model_to_json, py::arg("cost"),
          py::arg("sources") = std::map<std::string, std::string>{},
          "The hybrimoe.cost_model/3 document of a CostModel (17 significant digits: reads back exactly).");
    m.def("load_cost_model",
          [](const std::string & path) {
              std::map<std::string, std::string> sources;
              CostModel cm = hybrimoe::load_cost_model(path, &sources);
              return std::make_pair(cm, sources);
          },
          py::arg("path"), "Reads a cost-model JSON file; returns (CostModel, sources). ValueError naming the path.");
    m.def("save_cost_model", &hybrimoe::save_cost_model, py::arg("cost"), py::arg("path"),
          py::arg("sources") = std::map<std::string, std::string>{}, "Writes a cost-model JSON file.");
}

}  // namespace hybrimoe_bind
