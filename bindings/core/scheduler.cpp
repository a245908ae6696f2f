#include "common.h"

#include "policy/scheduler.h"

namespace hybrimoe_bind {

using namespace hybrimoe;

namespace {

// Python-returned split -> vector of 0/1 (any sequence of truthy values, numpy arrays included).
std::vector<uint8_t> to_flags(const py::object & o) {
    std::vector<uint8_t> out;
    for (py::handle item : o) {
        const int t = PyObject_IsTrue(item.ptr());
        if (t < 0) throw py::error_already_set();
        out.push_back(static_cast<uint8_t>(t));
    }
    return out;
}

/// Trampoline: a Python subclass of SchedulePolicy overrides name() and split(layer_input, cost_model).
class PySchedulePolicy : public SchedulePolicy, public py::trampoline_self_life_support {
public:
    std::string name() const override {
        auto conv = [](const py::object & o) { return o.cast<std::string>(); };
        HYBRIMOE_CALL_OVERRIDE(SchedulePolicy, "SchedulePolicy", "name", conv);
        return "python";
    }
    void split(const LayerInput & in, const CostModel & cost, std::vector<uint8_t> & on_gpu) override {
        auto conv = [&](const py::object & o) {
            on_gpu = to_flags(o);
            if (on_gpu.size() != in.size()) {
                throw py::value_error("SchedulePolicy '" + python_class_name(this, typeid(SchedulePolicy)) +
                                      "'.split returned " + std::to_string(on_gpu.size()) + " flags for " +
                                      std::to_string(in.size()) + " activated experts");
            }
        };
        HYBRIMOE_CALL_OVERRIDE(SchedulePolicy, "SchedulePolicy", "split", conv, in, cost);
        py::gil_scoped_acquire gil;
        throw py::type_error("SchedulePolicy subclass must override split(layer_input, cost_model)");
    }
};

}  // namespace

void bind_scheduler(py::module_ & m) {
    py::class_<LayerInput>(m, "LayerInput",
                           "One MoE layer of one ubatch as the scheduler sees it (HybriMoE §IV.B). Times in seconds "
                           "from the start of the layer's routed-expert work; per-expert lists have length k.")
        .def(py::init<>())
        .def(py::init([](std::vector<int32_t> experts, std::vector<int32_t> loads, std::vector<uint8_t> cached,
                         std::vector<double> ready_s, double expert_bytes, int n_tokens, int layer, double pcie_free_s) {
                 LayerInput in;
                 in.experts = std::move(experts);
                 in.loads = std::move(loads);
                 in.cached = std::move(cached);
                 in.ready_s = ready_s.empty() ? std::vector<double>(in.experts.size(), 0.0) : std::move(ready_s);
                 in.expert_bytes = expert_bytes;
                 in.n_tokens = n_tokens;
                 in.layer = layer;
                 in.pcie_free_s = pcie_free_s;
                 in.validate();
                 return in;
             }),
             py::arg("experts"), py::arg("loads"), py::arg("cached"), py::arg("ready_s") = std::vector<double>{},
             py::arg("expert_bytes") = 0.0, py::arg("n_tokens") = 1, py::arg("layer") = 0,
             py::arg("pcie_free_s") = 0.0,
             "Builds and validates an input; raises ValueError on mismatched lengths, loads < 1, repeated experts.")
        .def_readwrite("layer", &LayerInput::layer)
        .def_readwrite("n_tokens", &LayerInput::n_tokens)
        .def_readwrite("expert_bytes", &LayerInput::expert_bytes)
        .def_readwrite("pcie_free_s", &LayerInput::pcie_free_s)
        .def_readwrite("experts", &LayerInput::experts)
        .def_readwrite("loads", &LayerInput::loads)
        .def_readwrite("cached", &LayerInput::cached)
        .def_readwrite("ready_s", &LayerInput::ready_s)
        .def_readwrite("on_disk", &LayerInput::on_disk,
                       "per expert: 1 when not in RAM yet (a RAM tier; read before the CPU or a copy); [] none")
        .def_readwrite("read_s", &LayerInput::read_s, "seconds one expert read takes (0: no reads in the timeline)")
        .def_readwrite("read_slots", &LayerInput::read_slots, "reads in flight at once")
        .def("__len__", &LayerInput::size)
        .def("validate", &LayerInput::validate)
        .def(
            "set_routing",
            [](LayerInput & in, py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids, int n_experts) {
                if (ids.ndim() != 2) throw py::value_error("set_routing: ids must be 2-D [n_tokens, top_k]");
                in.set_routing(ids.data(), static_cast<int>(ids.shape(0)), static_cast<int>(ids.shape(1)), n_experts);
            },
            py::arg("ids"), py::arg("n_experts"),
            "Sets experts/loads from routed ids [n_tokens, top_k]; all uncached. ValueError on ids out of range.");

    py::class_<SchedulePlan>(m, "SchedulePlan", "A CPU/GPU split and its predicted timeline (seconds).")
        .def(py::init<>())
        .def_readonly("on_gpu", &SchedulePlan::on_gpu)
        .def_readonly("cpu_experts", &SchedulePlan::cpu_experts)
        .def_readonly("gpu_experts", &SchedulePlan::gpu_experts)
        .def_readonly("load_experts", &SchedulePlan::load_experts)
        .def_readonly("makespan_s", &SchedulePlan::makespan_s)
        .def_readonly("cpu_end_s", &SchedulePlan::cpu_end_s)
        .def_readonly("gpu_end_s", &SchedulePlan::gpu_end_s)
        .def_readonly("pcie_end_s", &SchedulePlan::pcie_end_s)
        .def_readonly("method", &SchedulePlan::method);

    m.def(
        "evaluate_plan",
        [](const LayerInput & in, const CostModel & cost, std::vector<uint8_t> on_gpu) {
            SchedulePlan p;
            evaluate_plan(in, cost, on_gpu, p);
            p.method = "given";
            return p;
        },
        py::arg("layer_input"), py::arg("cost"), py::arg("on_gpu"),
        "Predicted timeline of a given split (k flags, 1 = GPU). ValueError if the length differs from k.");
    m.def(
        "assign_pairs",
        [](const LayerInput & in, const SchedulePlan & plan,
           py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids) {
            if (ids.ndim() != 2) throw py::value_error("assign_pairs: ids must be 2-D [n_tokens, top_k]");
            const int n = static_cast<int>(ids.shape(0)), k = static_cast<int>(ids.shape(1));
            std::vector<uint8_t> dev = assign_pairs(in, plan, ids.data(), n, k);
            py::array_t<uint8_t> out({n, k});
            std::copy(dev.begin(), dev.end(), out.mutable_data());
            return out;
        },
        py::arg("layer_input"), py::arg("plan"), py::arg("ids"),
        "Device of every routed (token, rank) pair: uint8 [n_tokens, top_k], 1 = GPU, so each partial output "
        "keeps its own routing weight (HybriMoE §IV.B). ValueError on an expert not in the input.");

    py::classh<SchedulePolicy, PySchedulePolicy>(m, "SchedulePolicy",
                                                 "Base of split policies. Subclass in Python: override name() and "
                                                 "split(layer_input, cost) -> k flags (1 = GPU).")
        .def(py::init<>())
        .def("name", &SchedulePolicy::name)
        .def(
            "split",
            [](SchedulePolicy & self, const LayerInput & in, const CostModel & cost) {
                std::vector<uint8_t> on_gpu(in.size(), 0);
                self.split(in, cost, on_gpu);
                return on_gpu;
            },
            py::arg("layer_input"), py::arg("cost"))
        .def(
            "plan",
            [](SchedulePolicy & self, const LayerInput & in, const CostModel & cost) {
                in.validate();
                SchedulePlan p;
                self.plan(in, cost, p);
                return p;
            },
            py::arg("layer_input"), py::arg("cost"), "Split plus predicted timeline (SchedulePlan).");
    py::classh<HybriMoEScheduler, SchedulePolicy>(m, "HybriMoEScheduler",
                                                  "HybriMoE §IV.B greedy split, best of greedy/all-CPU/all-GPU.")
        .def(py::init<>())
        .def(
            "greedy_split",
            [](HybriMoEScheduler & self, const LayerInput & in, const CostModel & cost) {
                std::vector<uint8_t> on_gpu;
                self.greedy_split(in, cost, on_gpu);
                return on_gpu;
            },
            py::arg("layer_input"), py::arg("cost"), "The paper's greedy split alone (no best-of).")
        .def(
            "makespan",
            [](HybriMoEScheduler & self, const LayerInput & in, const CostModel & cost) {
                in.validate();
                return self.makespan(in, cost);
            },
            py::arg("layer_input"), py::arg("cost"),
            "plan(layer_input, cost).makespan_s without building the plan (seconds; the prefetcher's evaluation).");
    py::classh<CpuUncachedScheduler, SchedulePolicy>(m, "CpuUncachedScheduler",
                                                     "kTransformers-style: uncached experts on the CPU.")
        .def(py::init<>());
    py::classh<GpuOnDemandScheduler, SchedulePolicy>(m, "GpuOnDemandScheduler",
                                                     "Every expert on the GPU, loading on demand.")
        .def(py::init<>());
    py::classh<StaticLayerScheduler, SchedulePolicy>(m, "StaticLayerScheduler",
                                                     "Upstream --n-cpu-moe N: MoE layers < N on the CPU.")
        .def(py::init<int>(), py::arg("n_cpu_layers"))
        .def_property_readonly("n_cpu_layers", &StaticLayerScheduler::n_cpu_layers);
    py::classh<ExhaustiveScheduler, SchedulePolicy>(m, "ExhaustiveScheduler",
                                                    "Optimal split by exhaustive search for k <= max_exhaustive, "
                                                    "else a labelled local-search optimum (evaluation only).")
        .def(py::init<int>(), py::arg("max_exhaustive") = 10);
    m.def("make_scheduler", &make_scheduler, py::arg("name"), py::arg("n_cpu_layers") = 0,
          "Scheduler by name: hybrimoe, ktransformers, gpu-on-demand, upstream-ncmoe, exhaustive. "
          "ValueError on an unknown name.");
}

}  // namespace hybrimoe_bind
