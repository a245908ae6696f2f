// pybind11 module hybrimoe._engine: the runtime side that links our patched libllama.
// The llama_context pointer comes from llama-cpp-python (Llama._ctx.ctx, a ctypes c_void_p) as an int.
#include "runtime/moe_hook.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;
using hybrimoe::MoeHook;
using hybrimoe::RoutingReplay;

namespace {

llama_context * ctx_from(uintptr_t ptr) {
    if (ptr == 0) {
        throw std::invalid_argument("llama_context pointer is NULL (model closed?)");
    }
    return reinterpret_cast<llama_context *>(ptr);
}

} // namespace

PYBIND11_MODULE(_engine, m) {
    m.doc() = "hybrimoe runtime: the MoE hook and routing replay installed into a llama_context "
              "(vendor/llama.cpp/patches 0001 and 0002).";

    py::class_<MoeHook>(m, "MoeHook", R"doc(
The MoE hook of one llama_context (llama_set_moe_hook, patch 0001).

For each SiLU-GLU MoE layer it inserts a plan node that runs once per layer and ubatch on the CPU (reading
routing ids, weights and router probabilities together), then computes the routed experts with ggml's CPU
kernels in upstream's op and summation order, so results equal upstream's. Other expert variants stay on
upstream's path (see ``unsupported()``).

Args:
    max_layers: the model's layer count (layer indices at or above it are left to upstream).
)doc")
        .def(py::init<int>(), py::arg("max_layers"))
        .def("attach", [](MoeHook & h, uintptr_t ctx) { h.attach(ctx_from(ctx)); }, py::arg("ctx"),
             "Install on a llama_context given as an integer pointer; forces a graph rebuild.")
        .def("detach", &MoeHook::detach, "Remove the hook from its context (upstream's graph again).")
        .def("reset_counters", &MoeHook::reset_counters)
        .def_property_readonly("max_layers", &MoeHook::max_layers)
        .def("runs", [](const MoeHook & h) {
                std::vector<uint64_t> v; for (int i = 0; i < h.max_layers(); ++i) v.push_back(h.layer(i).runs.load());
                return v; }, "Executions of each layer's plan node (one per ubatch), indexed by layer.")
        .def("tokens", [](const MoeHook & h) {
                std::vector<uint64_t> v; for (int i = 0; i < h.max_layers(); ++i) v.push_back(h.layer(i).tokens.load());
                return v; }, "Tokens processed by each layer's plan node, summed over runs.")
        .def("hook_calls", [](const MoeHook & h) {
                std::vector<uint64_t> v; for (int i = 0; i < h.max_layers(); ++i) v.push_back(h.layer(i).hook_calls.load());
                return v; }, "Graph builds (reserve or rebuild) that called the hook, per layer.")
        .def("unsupported", &MoeHook::unsupported, "(layer, reason) for layers kept on upstream's path.")
        .def("set_recording", &MoeHook::set_recording, py::arg("on"),
             "Keep every routed id each layer sees (execution order); clears what was kept.")
        .def("recorded", [](const MoeHook & h, int il) {
                if (il < 0 || il >= h.max_layers()) throw py::index_error("layer out of range");
                int32_t k = 0;
                std::vector<int32_t> v = h.recorded(il, &k);
                py::array_t<int32_t> a({(py::ssize_t) (k ? v.size() / k : 0), (py::ssize_t) k});
                if (!v.empty()) std::copy(v.begin(), v.end(), a.mutable_data());
                return a; }, py::arg("layer"),
             "Recorded routed ids of a layer: int32 [rows, k], one row per token in execution order.");

    py::class_<RoutingReplay>(m, "RoutingReplay", R"doc(
Forces every MoE layer's routed expert ids (llama_set_moe_routing, patch 0002).

The token at position p (any sequence) gets row ``p % n_rows`` of ``ids`` in every MoE layer; routing weights
are still the router's probabilities at those ids.

Args:
    ids: int array [n_rows, n_layers, k]; layer index = model layer (rows of dense layers are ignored).
    n_expert: experts per layer; every id must be in [0, n_expert).
Raises:
    ValueError: empty table or ids out of range.
)doc")
        .def(py::init([](py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids, int n_expert) {
                if (ids.ndim() != 3) throw std::invalid_argument("ids must have shape [n_rows, n_layers, k]");
                std::vector<int32_t> v(ids.data(), ids.data() + ids.size());
                return new RoutingReplay(std::move(v), (int) ids.shape(0), (int) ids.shape(1), (int) ids.shape(2), n_expert);
            }), py::arg("ids"), py::arg("n_expert"))
        .def("attach", [](RoutingReplay & r, uintptr_t ctx) { r.attach(ctx_from(ctx)); }, py::arg("ctx"))
        .def("detach", &RoutingReplay::detach)
        .def("calls", &RoutingReplay::calls, py::arg("layer"), "ubatches replayed so far in a layer");
}
