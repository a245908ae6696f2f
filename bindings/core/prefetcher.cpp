#include "common.h"

#include "policy/prefetcher.h"
#include "policy/router_predictor.h"

namespace hybrimoe_bind {

using namespace hybrimoe;

namespace {

/// Trampoline: a Python subclass of PrefetchPolicy overrides name() and plan(ctx, cache, cost) returning an
/// iterable of (layer, expert) pairs.
class PyPrefetchPolicy : public PrefetchPolicy, public py::trampoline_self_life_support {
public:
    std::string name() const override {
        auto conv = [](const py::object & o) { return o.cast<std::string>(); };
        HYBRIMOE_CALL_OVERRIDE(PrefetchPolicy, "PrefetchPolicy", "name", conv);
        return "python";
    }
    std::vector<std::pair<int, int>> plan(const PrefetchContext & ctx, const ExpertCache & cache,
                                          const CostModel & cost) override {
        auto conv = [](const py::object & o) {
            std::vector<std::pair<int, int>> out;
            for (py::handle item : o) out.push_back(item.cast<std::pair<int, int>>());
            return out;
        };
        // The cache goes to Python by reference (read it, do not keep it).
        HYBRIMOE_CALL_OVERRIDE(PrefetchPolicy, "PrefetchPolicy", "plan", conv, ctx,
                               py::cast(&cache, py::return_value_policy::reference), cost);
        py::gil_scoped_acquire gil;
        throw py::type_error("PrefetchPolicy subclass must override plan(ctx, cache, cost)");
    }
};

}  // namespace

void bind_prefetcher(py::module_ & m) {
    py::class_<Prediction>(m, "Prediction", "Predicted routing of an upcoming MoE layer (HybriMoE §IV.C).")
        .def(py::init<>())
        .def_readwrite("layer", &Prediction::layer)
        .def_readwrite("distance", &Prediction::distance)
        .def_readwrite("confidence", &Prediction::confidence)
        .def_readwrite("start_s", &Prediction::start_s)
        .def_readwrite("expert_bytes", &Prediction::expert_bytes)
        .def_readwrite("experts", &Prediction::experts)
        .def_readwrite("loads", &Prediction::loads);
    py::class_<PrefetchContext>(m, "PrefetchContext", "What a prefetch policy sees after a layer's router ran.")
        .def(py::init<>())
        .def_readwrite("layer", &PrefetchContext::layer)
        .def_readwrite("n_tokens", &PrefetchContext::n_tokens)
        .def_readwrite("top_k", &PrefetchContext::top_k)
        .def_readwrite("now_s", &PrefetchContext::now_s)
        .def_readwrite("pcie_free_at_s", &PrefetchContext::pcie_free_at_s)
        .def_readwrite("predictions", &PrefetchContext::predictions);

    py::classh<PrefetchPolicy, PyPrefetchPolicy>(m, "PrefetchPolicy",
                                                 "Base of prefetch policies. Subclass in Python: override name() and "
                                                 "plan(ctx, cache, cost) -> [(layer, expert), ...].")
        .def(py::init<>())
        .def("name", &PrefetchPolicy::name)
        .def("plan", &PrefetchPolicy::plan, py::arg("ctx"), py::arg("cache"), py::arg("cost"));
    py::classh<NoPrefetcher, PrefetchPolicy>(m, "NoPrefetcher", "No prefetching.").def(py::init<>());
    py::classh<TopKPrefetcher, PrefetchPolicy>(m, "TopKPrefetcher",
                                               "Next layer's predicted top experts (count 0 = top_k).")
        .def(py::init<int>(), py::arg("count") = 0);
    py::classh<ImpactPrefetcher, PrefetchPolicy>(m, "ImpactPrefetcher",
                                                 "HybriMoE §IV.C impact-driven prefetch (gain = drop in the layer's "
                                                 "simulated makespan x confidence, minus waste_weight x (1 - "
                                                 "confidence) x the copy's seconds), lazy greedy, bounded candidates; "
                                                 "share_equal_evaluations: candidates that cannot differ share one "
                                                 "makespan evaluation (the same plans; False only to check that).")
        .def(py::init<int, int, bool, double, bool>(), py::arg("max_copies") = 0, py::arg("max_candidates") = 12,
             py::arg("use_confidence") = true, py::arg("waste_weight") = kDefaultPrefetchWasteWeight,
             py::arg("share_equal_evaluations") = true)
        .def_property_readonly("evaluations", &ImpactPrefetcher::evaluations);
    m.def("make_prefetcher", &make_prefetcher, py::arg("name"),
          "Prefetcher by name: none, topk, impact. ValueError on an unknown name.");
    // A tuple, so that it cannot be changed in place: the engine's default is compiled in, a changed copy here
    // would not reach it.
    m.attr("DEFAULT_PREFETCH_WASTE_WEIGHT") = kDefaultPrefetchWasteWeight;
    m.attr("DEFAULT_PREDICTION_CONFIDENCE") = py::tuple(py::cast(kDefaultPredictionConfidence));
}

}  // namespace hybrimoe_bind
