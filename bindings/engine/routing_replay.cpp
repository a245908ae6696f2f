// hybrimoe._engine.RoutingReplay: forced routing through llama_set_moe_routing (src/runtime/routing_replay.h).
#include "runtime/routing_replay.h"
#include "common.h"

#include <optional>

using hybrimoe::RoutingReplay;

namespace hybrimoe_bind {

void bind_routing_replay(py::module_ & m) {
    py::class_<RoutingReplay, std::shared_ptr<RoutingReplay>>(m, "RoutingReplay", R"doc(
Forces every MoE layer's routed expert ids (llama_set_moe_routing, patch 0002).

The token at position p of sequence s gets row ``(offsets[s] + p) % n_rows`` of ``ids`` in every MoE layer (every
offset 0 unless set: :meth:`set_sequence_offsets`); routing weights are still the router's probabilities at those
ids.

Args:
    ids: int array [n_rows, n_layers, k]; layer index = model layer (rows of dense layers are ignored).
    n_expert: experts per layer; every id must be in [0, n_expert).
    scores: optional float array [n_rows, n_layers, n_expert]: the router scores of each row (a trace's), which an
        engine given this replay (Engine.set_routing_replay) shows its cache policies instead of the model's own.
Raises:
    ValueError: empty table, ids out of range, or scores of another shape.
)doc")
        .def(py::init([](py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids, int n_expert,
                         std::optional<py::array_t<float, py::array::c_style | py::array::forcecast>> scores) {
                if (ids.ndim() != 3) throw std::invalid_argument("ids must have shape [n_rows, n_layers, k]");
                std::vector<int32_t> v(ids.data(), ids.data() + ids.size());
                auto r = std::make_shared<RoutingReplay>(std::move(v), (int) ids.shape(0), (int) ids.shape(1),
                                                         (int) ids.shape(2), n_expert);
                if (scores) {
                    const auto & s = *scores;
                    if (s.ndim() != 3 || s.shape(0) != ids.shape(0) || s.shape(1) != ids.shape(1) ||
                        s.shape(2) != n_expert) {
                        throw std::invalid_argument("scores must have shape [n_rows, n_layers, n_expert]");
                    }
                    r->set_scores(std::vector<float>(s.data(), s.data() + s.size()));
                }
                return r;
            }), py::arg("ids"), py::arg("n_expert"), py::arg("scores") = py::none())
        .def("attach", [](RoutingReplay & r, uintptr_t ctx) { r.attach(ctx_from(ctx)); }, py::arg("ctx"))
        .def("detach", &RoutingReplay::detach)
        .def_property("sequence_offsets", &RoutingReplay::sequence_offsets,
                      [](RoutingReplay & r, std::vector<int64_t> v) { r.set_sequence_offsets(std::move(v)); },
                      "offsets[s]: the table row sequence s starts at (sequences past the list: 0); set between "
                      "decodes")
        .def("calls", &RoutingReplay::calls, py::arg("layer"), "ubatches replayed so far in a layer");
}

}  // namespace hybrimoe_bind
