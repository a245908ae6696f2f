// hybrimoe._engine.RoutingReplay: forced routing through llama_set_moe_routing (src/runtime/routing_replay.h).
#include "runtime/routing_replay.h"
#include "common.h"

using hybrimoe::RoutingReplay;

namespace hybrimoe_bind {

void bind_routing_replay(py::module_ & m) {
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

}  // namespace hybrimoe_bind
