// hybrimoe._engine.MoeHook: the MoE hook of one llama_context (src/runtime/moe_hook.h).
#include "runtime/engine.h"
#include "runtime/moe_hook.h"
#include "common.h"

using hybrimoe::Engine;
using hybrimoe::MoeHook;

namespace hybrimoe_bind {

void bind_moe_hook(py::module_ & m) {
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
        .def("set_engine", [](MoeHook & h, std::shared_ptr<Engine> e) { h.set_engine(std::move(e)); },
             py::arg("engine").none(true),
             "Use an Engine for the layers it handles (None: the CPU-only path); rebuilds the graphs.")
        .def("engine_skipped", &MoeHook::engine_skipped,
             "(layer, reason) for supported layers the engine left to the CPU-only path.")
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
}

}  // namespace hybrimoe_bind
