#include "common.h"

#include "policy/expert_cache.h"
#include "policy/reuse_policy.h"

namespace hybrimoe_bind {

using namespace hybrimoe;

namespace {

/// Trampoline: a Python subclass of CachePolicy overrides name() and priority(layer, expert), and optionally
/// reset, observe, admit, bypass, prepare, clairvoyant.
class PyCachePolicy : public CachePolicy, public py::trampoline_self_life_support {
public:
    std::string name() const override {
        auto conv = [](const py::object & o) { return o.cast<std::string>(); };
        HYBRIMOE_CALL_OVERRIDE(CachePolicy, "CachePolicy", "name", conv);
        return "python";
    }
    void reset(int n_layers, int n_experts) override {
        auto conv = [](const py::object &) {};
        HYBRIMOE_CALL_OVERRIDE(CachePolicy, "CachePolicy", "reset", conv, n_layers, n_experts);
    }
    void observe(const LayerObservation & obs) override {
        auto conv = [](const py::object &) {};
        HYBRIMOE_CALL_OVERRIDE(CachePolicy, "CachePolicy", "observe", conv, obs);
    }
    double priority(int layer, int expert) override {
        auto conv = [](const py::object & o) { return o.cast<double>(); };
        HYBRIMOE_CALL_OVERRIDE(CachePolicy, "CachePolicy", "priority", conv, layer, expert);
        py::gil_scoped_acquire gil;
        throw py::type_error("CachePolicy subclass must override priority(layer, expert)");
    }
    bool admit(int layer, int expert) override {
        auto conv = [](const py::object & o) { return o.cast<bool>(); };
        HYBRIMOE_CALL_OVERRIDE(CachePolicy, "CachePolicy", "admit", conv, layer, expert);
        return true;
    }
    bool bypass() const override {
        auto conv = [](const py::object & o) { return o.cast<bool>(); };
        HYBRIMOE_CALL_OVERRIDE(CachePolicy, "CachePolicy", "bypass", conv);
        return false;
    }
    void prepare(const FutureAccesses & future) override {
        auto conv = [](const py::object &) {};
        HYBRIMOE_CALL_OVERRIDE(CachePolicy, "CachePolicy", "prepare", conv, future);
    }
    bool clairvoyant() const override {
        auto conv = [](const py::object & o) { return o.cast<bool>(); };
        HYBRIMOE_CALL_OVERRIDE(CachePolicy, "CachePolicy", "clairvoyant", conv);
        return false;
    }
};

}  // namespace

void bind_expert_cache(py::module_ & m) {
    py::class_<LayerObservation>(m, "LayerObservation",
                                 "A (MoE layer, ubatch) as a cache policy sees it; scores empty or "
                                 "[n_tokens * n_experts] row-major router probabilities.")
        .def(py::init<>())
        .def_readwrite("step", &LayerObservation::step)
        .def_readwrite("layer", &LayerObservation::layer)
        .def_readwrite("n_tokens", &LayerObservation::n_tokens)
        .def_readwrite("top_k", &LayerObservation::top_k)
        .def_readwrite("n_experts", &LayerObservation::n_experts)
        .def_readwrite("experts", &LayerObservation::experts)
        .def_readwrite("loads", &LayerObservation::loads)
        .def_readwrite("scores", &LayerObservation::scores);

    py::class_<FutureAccesses>(m, "FutureAccesses", "Future access times per key (time = step * n_layers + layer).")
        .def(py::init<>())
        .def_readwrite("n_layers", &FutureAccesses::n_layers)
        .def_readwrite("n_experts", &FutureAccesses::n_experts)
        .def_readwrite("uses", &FutureAccesses::uses);

    py::class_<CacheStats>(m, "CacheStats", "Hits are activated (layer, ubatch, expert) resident when scheduled (a copy "
                                            "still in flight is a miss, also counted as late); demand and prefetch-made "
                                            "hits apart.")
        .def(py::init<>())
        .def_readonly("accesses", &CacheStats::accesses)
        .def_readonly("demand_hits", &CacheStats::demand_hits)
        .def_readonly("prefetch_hits", &CacheStats::prefetch_hits)
        .def_readonly("misses", &CacheStats::misses)
        .def_readonly("late", &CacheStats::late)
        .def_readonly("admissions", &CacheStats::admissions)
        .def_readonly("evictions", &CacheStats::evictions)
        .def_readonly("declined", &CacheStats::declined)
        .def_property_readonly("hit_rate", &CacheStats::hit_rate)
        .def_property_readonly("demand_hit_rate", [](const CacheStats & s) {
            return s.accesses ? double(s.demand_hits) / double(s.accesses) : 0.0;
        });

    py::classh<CachePolicy, PyCachePolicy>(m, "CachePolicy",
                                           "Base of cache replacement policies. Subclass in Python: override name() "
                                           "and priority(layer, expert) (higher keeps longer; ties LRU), optionally "
                                           "reset, observe(obs), admit, bypass, prepare, clairvoyant.")
        .def(py::init<>())
        .def("name", &CachePolicy::name)
        .def("reset",
             [](CachePolicy & p, int n_layers, int n_experts) {
                 p.set_shape(-1, -1);  // a reset that throws leaves no sizes to check keys against
                 p.reset(n_layers, n_experts);
                 p.set_shape(n_layers, n_experts);
             },
             py::arg("n_layers"), py::arg("n_experts"))
        .def("observe", &CachePolicy::observe, py::arg("obs"))
        // checked here, not in the policies: the cache calls priority() on its hot path with keys it owns
        .def("priority",
             [](CachePolicy & p, int layer, int expert) {
                 p.check_key(layer, expert, (p.name() + ".priority").c_str());
                 return p.priority(layer, expert);
             },
             py::arg("layer"), py::arg("expert"), "Higher keeps longer. IndexError outside the last reset's sizes.")
        .def("admit",
             [](CachePolicy & p, int layer, int expert) {
                 p.check_key(layer, expert, (p.name() + ".admit").c_str());
                 return p.admit(layer, expert);
             },
             py::arg("layer"), py::arg("expert"))
        .def("bypass", &CachePolicy::bypass)
        .def("prepare", &CachePolicy::prepare, py::arg("future"))
        .def("clairvoyant", &CachePolicy::clairvoyant);
    py::classh<MRSPolicy, CachePolicy>(m, "MRSPolicy",
                                       "HybriMoE §IV.D MRS: S <- alpha*TopP(s) + (1-alpha)*S; p=0 means 2*top_k; "
                                       "use_max aggregates a batch by max instead of mean. Without router scores "
                                       "each token scores its activated experts 1/top_k.")
        .def(py::init<double, int, bool>(), py::arg("alpha") = 0.5, py::arg("p") = 0, py::arg("use_max") = false)
        .def("score", &MRSPolicy::score, py::arg("layer"), py::arg("expert"))
        .def("set_score", &MRSPolicy::set_score, py::arg("layer"), py::arg("expert"), py::arg("score"));
    py::classh<LRUPolicy, CachePolicy>(m, "LRUPolicy", "Least recently used.").def(py::init<>());
    py::classh<LFUPolicy, CachePolicy>(m, "LFUPolicy", "Least frequently used (ties LRU).").def(py::init<>());
    py::classh<StaticPolicy, CachePolicy>(m, "StaticPolicy",
                                          "Static hot set: only `keys` (layer*n_experts+expert) are admitted.")
        .def(py::init<std::vector<int64_t>, std::vector<double>>(), py::arg("keys"),
             py::arg("weights") = std::vector<double>{});
    py::classh<BeladyPolicy, CachePolicy>(m, "BeladyPolicy", "Belady with bypass (clairvoyant; evaluation only).")
        .def(py::init<>());
    py::classh<ReusePolicy, CachePolicy>(m, "ReusePolicy",
                                         "Reuse prediction: per (layer, expert) the probability of use within the "
                                         "next `horizon` visits of its layer, from an online logistic regression "
                                         "(SGD step `rate`) over MRS scores at alpha 0.5, 0.1 and 0.01, use now, "
                                         "recency and how often it follows this visit's experts (over the run and "
                                         "with counts decaying by 0.995 per visit); starts ranking as MRS, learns "
                                         "from decode-sized visits only and ranks a larger (prefill) visit's layer "
                                         "by the alpha-0.5 score. ValueError: horizon outside 1..1024 or rate "
                                         "outside (0, 1].")
        .def(py::init<int, double>(), py::arg("horizon") = ReusePolicy::kDefaultHorizon,
             py::arg("rate") = ReusePolicy::kDefaultRate)
        .def("probability", &ReusePolicy::probability, py::arg("layer"), py::arg("expert"))
        .def("weights", &ReusePolicy::weights)
        .def_property_readonly("samples", &ReusePolicy::samples)
        .def_property_readonly("log_loss", &ReusePolicy::log_loss)
        .def_property_readonly("brier", &ReusePolicy::brier)
        .def_property_readonly("positive_rate", &ReusePolicy::positive_rate)
        .def_property_readonly("horizon", &ReusePolicy::horizon)
        .def_property_readonly("rate", &ReusePolicy::rate)
        .def_property_readonly("bytes_per_layer", &ReusePolicy::bytes_per_layer);
    m.def("make_cache_policy", &make_cache_policy, py::arg("name"),
          "Cache policy by name: mrs, lru, lfu, reuse, belady. ValueError on an unknown name.");

    py::classh<ExpertCache>(m, "ExpertCache",
                            "GPU expert cache over one byte budget shared by all MoE layers (HybriMoE §IV.D). "
                            "ValueError on a negative budget or a positive one smaller than one expert.")
        .def(py::init<std::vector<double>, int, double, std::shared_ptr<CachePolicy>>(),
             py::arg("expert_bytes_per_layer"), py::arg("n_experts"), py::arg("budget_bytes"), py::arg("policy"))
        .def_property_readonly("n_layers", &ExpertCache::n_layers)
        .def_property_readonly("n_experts", &ExpertCache::n_experts)
        .def_property_readonly("budget_bytes", &ExpertCache::budget_bytes)
        .def_property_readonly("used_bytes", &ExpertCache::used_bytes)
        .def_property_readonly("total_expert_bytes", &ExpertCache::total_expert_bytes)
        .def_property_readonly("n_resident", &ExpertCache::n_resident)
        .def_property_readonly("policy", &ExpertCache::policy_ptr)
        .def_property_readonly("stats", &ExpertCache::stats)
        .def("resident", &ExpertCache::resident, py::arg("layer"), py::arg("expert"))
        .def("ready_s", &ExpertCache::ready_s, py::arg("layer"), py::arg("expert"))
        .def("pinned", &ExpertCache::pinned, py::arg("layer"), py::arg("expert"))
        .def("resident_keys", &ExpertCache::resident_keys)
        .def("observe", &ExpertCache::observe, py::arg("obs"))
        .def("access", &ExpertCache::access, py::arg("layer"), py::arg("expert"),
             py::arg("now_s") = std::numeric_limits<double>::infinity(),
             "Counts a lookup at now_s: 0 miss, 1 demand hit, 2 prefetch hit, 3 late (copy still in flight: a miss).")
        .def("admit", &ExpertCache::admit, py::arg("layer"), py::arg("expert"), py::arg("ready_s") = 0.0,
             py::arg("by_prefetch") = false, py::arg("demand") = false,
             "Makes (layer, expert) resident, evicting the lowest priorities; False when refused. demand: a load "
             "the scheduler runs on the GPU now, which a bypass policy (Belady) does not refuse.")
        .def("admit_read_ahead", &ExpertCache::admit_read_ahead, py::arg("layer"), py::arg("expert"),
             py::arg("ready_s") = 0.0,
             "admit(by_prefetch=True) ranked as the most recently used, as the kernel's page cache adds a read "
             "ahead of use at its LRU head (folio_add_lru); False when refused.")
        .def("admit_demoted", &ExpertCache::admit_demoted, py::arg("layer"), py::arg("expert"),
             py::arg("ready_s") = 0.0,
             "admit(by_prefetch=True) of an expert a faster tier gave up, only over residents that rank below it "
             "(exclusive tiers); False when refused.")
        .def("found_read_ahead", &ExpertCache::found_read_ahead, py::arg("layer"), py::arg("expert"),
             "Recounts the miss of a lookup as a prefetch hit: a read ahead brought the expert in by its use.")
        .def("admit_batch", &ExpertCache::admit_batch, py::arg("layer"), py::arg("experts"),
             py::arg("ready_s") = std::vector<double>{}, py::arg("by_prefetch") = false,
             "Admits several experts of one layer, highest priority first, as sequential admits with the newcomers "
             "pinned would; returns how many were admitted.")
        .def("pin", &ExpertCache::pin, py::arg("layer"), py::arg("expert"))
        .def("unpin", &ExpertCache::unpin, py::arg("layer"), py::arg("expert"))
        .def("evict", &ExpertCache::evict, py::arg("layer"), py::arg("expert"))
        .def("fill", &ExpertCache::fill, py::arg("keys"))
        .def("reset_stats", &ExpertCache::reset_stats)
        .def("set_priority_admission", &ExpertCache::set_priority_admission, py::arg("on"),
             "In a decode-sized ubatch (at most 4 tokens) a prefetch or fill that needs victims enters only if its "
             "policy priority is at least each victim's, instead of by frequency (larger ubatches keep frequency "
             "admission); demand loads exempt. For a policy that predicts reuse.")
        .def_property_readonly("priority_admission", &ExpertCache::priority_admission)
        .def("set_frequency_admission", &ExpertCache::set_frequency_admission, py::arg("on"), py::arg("window") = 0,
             "TinyLFU frequency admission (Einziger et al., ACM ToS 2017): a prefetch or fill needing victims is "
             "admitted only if the newcomer's access frequency is above each victim's (demand loads exempt); "
             "counts halve every window accesses (0: 10 x the capacity in experts). ValueError on window < 0.")
        .def_property_readonly("frequency_admission", &ExpertCache::frequency_admission)
        .def("frequency", &ExpertCache::frequency, py::arg("layer"), py::arg("expert"))
        .def("set_streaming_demand", &ExpertCache::set_streaming_demand, py::arg("min_active_fraction"),
             "Streaming demand loads (LIP insertion, Qureshi et al., ISCA 2007): in a (layer, ubatch) that activates "
             "at least this fraction of the layer's experts, a demand load is ranked below every other resident "
             "until a later lookup hits it. 0 turns it off. ValueError unless 0 <= fraction <= 1.")
        .def_property_readonly("streaming_demand", &ExpertCache::streaming_demand)
        .def("on_probation", &ExpertCache::on_probation, py::arg("layer"), py::arg("expert"))
        .def("set_record_evicted", &ExpertCache::set_record_evicted, py::arg("on"))
        .def("take_evicted", &ExpertCache::take_evicted);
}

}  // namespace hybrimoe_bind
