// hybrimoe._engine.RoutingRecorder: routing recorded through cb_eval (src/runtime/routing_recorder.h).
#include "runtime/routing_recorder.h"
#include "common.h"

#include <cstring>

using hybrimoe::RoutingRecorder;

namespace hybrimoe_bind {

void bind_routing_recorder(py::module_ & m) {
    py::class_<RoutingRecorder>(m, "RoutingRecorder", R"doc(
Records every MoE layer's routed ids and router scores through llama.cpp's eval callback (cb_eval).

Install it before the context exists: ``llama_context_params.cb_eval = callback_address`` and
``cb_eval_user_data = address`` (hybrimoe.Llama(record_routing=True) does it). It reads the nodes
build_moe_ffn names "ffn_moe_topk-<il>" (I32 [k, T]) and "ffn_moe_probs-<il>" (F32 [E, T]: after the gating
function, before any selection bias) from whichever device computed them; results are unchanged. Starts
disabled. The object must outlive the context.
)doc")
        .def(py::init<>())
        .def_property("enabled", &RoutingRecorder::enabled, &RoutingRecorder::set_enabled,
                      "whether computed graphs are recorded")
        .def_property_readonly("address", [](RoutingRecorder & r) { return (uintptr_t) &r; },
                               "the cb_eval_user_data pointer (an int)")
        .def_property_readonly_static("callback_address", [](py::object) {
                return (uintptr_t) &RoutingRecorder::callback;
            }, "the cb_eval function pointer (an int)")
        .def_property_readonly("error", &RoutingRecorder::error,
                               "the first node that could not be recorded (type or shape), or ''")
        .def("rows", [](const RoutingRecorder & r) {
                py::dict d;
                for (size_t il = 0; il < r.layers().size(); ++il) {
                    const auto & L = r.layers()[il];
                    if (L.k == 0 && L.n_expert == 0) continue;
                    d[py::int_(il)] = py::make_tuple(L.k ? L.ids.size() / (size_t) L.k : 0,
                                                     L.n_expert ? L.scores.size() / (size_t) L.n_expert : 0);
                }
                return d;
            }, "{layer: (id rows, score rows)} recorded so far")
        .def("take", [](RoutingRecorder & r) {
                py::dict d;
                auto layers = r.take();
                for (size_t il = 0; il < layers.size(); ++il) {
                    auto & L = layers[il];
                    if (L.k == 0 && L.n_expert == 0) continue;
                    const py::ssize_t nk = L.k ? (py::ssize_t) (L.ids.size() / (size_t) L.k) : 0;
                    const py::ssize_t ns = L.n_expert ? (py::ssize_t) (L.scores.size() / (size_t) L.n_expert) : 0;
                    py::array_t<int32_t> ids({nk, (py::ssize_t) L.k});
                    if (!L.ids.empty()) std::memcpy(ids.mutable_data(), L.ids.data(), L.ids.size() * 4);
                    py::array_t<float> sc({ns, (py::ssize_t) L.n_expert});
                    if (!L.scores.empty()) std::memcpy(sc.mutable_data(), L.scores.data(), L.scores.size() * 4);
                    d[py::int_(il)] = py::make_tuple(ids, sc);
                }
                return d;
            }, "{layer: (ids int32 [rows, k], scores float32 [rows, E])} recorded since the last take; starts empty");
}

}  // namespace hybrimoe_bind
