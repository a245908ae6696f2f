#include "common.h"

#include "policy/simulator.h"
#include "../common/decision_dict.h"

namespace hybrimoe_bind {

using namespace hybrimoe;

namespace {

std::shared_ptr<Trace> make_trace(py::array_t<int16_t, py::array::c_style | py::array::forcecast> ids,
                                  py::array_t<int64_t, py::array::c_style | py::array::forcecast> prompt_offsets,
                                  std::vector<double> expert_bytes, int n_experts, int n_dense_layers,
                                  py::object scores) {
    if (ids.ndim() != 3) {
        throw py::value_error("Trace: expert ids must be 3-D [tokens, moe_layers, top_k], got " +
                              std::to_string(ids.ndim()) + "-D");
    }
    if (prompt_offsets.ndim() != 1) throw py::value_error("Trace: prompt_offsets must be 1-D");
    auto t = std::make_shared<Trace>();
    t->n_tokens = static_cast<int>(ids.shape(0));
    t->n_layers = static_cast<int>(ids.shape(1));
    t->top_k = static_cast<int>(ids.shape(2));
    t->n_experts = n_experts;
    t->n_dense_layers = n_dense_layers;
    t->ids.assign(ids.data(), ids.data() + ids.size());
    t->prompt_offsets.assign(prompt_offsets.data(), prompt_offsets.data() + prompt_offsets.size());
    t->expert_bytes = std::move(expert_bytes);
    if (!scores.is_none()) {
        auto s = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(scores);
        if (!s || s.ndim() != 3) throw py::value_error("Trace: scores must be 3-D [tokens, moe_layers, n_experts]");
        t->scores.assign(s.data(), s.data() + s.size());
    }
    {
        py::gil_scoped_release release;
        t->validate();
    }
    return t;
}

}  // namespace

void bind_simulator(py::module_ & m) {
    py::class_<Trace, std::shared_ptr<Trace>>(m, "Trace", "Routing trace in memory (disk format: hybrimoe.trace).")
        .def(py::init(&make_trace), py::arg("expert_ids"), py::arg("prompt_offsets"), py::arg("expert_bytes"),
             py::arg("n_experts"), py::arg("n_dense_layers") = 0, py::arg("scores") = py::none(),
             "expert_ids int [tokens, moe_layers, top_k]; prompt_offsets int64 [prompts+1]; expert_bytes one per MoE "
             "layer. ValueError on ids out of range, repeated ids in a row, inconsistent shapes or offsets.")
        .def_readonly("n_tokens", &Trace::n_tokens)
        .def_readonly("n_layers", &Trace::n_layers)
        .def_readonly("top_k", &Trace::top_k)
        .def_readonly("n_experts", &Trace::n_experts)
        .def_readonly("n_dense_layers", &Trace::n_dense_layers)
        .def_readonly("expert_bytes", &Trace::expert_bytes)
        .def_property_readonly("n_prompts", &Trace::n_prompts)
        .def_property_readonly("has_scores", [](const Trace & t) { return !t.scores.empty(); });

    py::class_<TruthModel>(m, "TruthModel",
                           "What the planner does not see (seeded log-normal noise per task, extra first-expert "
                           "overhead, CPU/link memory contention, systematic scales).")
        .def(py::init<>())
        .def_readwrite("seed", &TruthModel::seed)
        .def_readwrite("cpu_noise", &TruthModel::cpu_noise)
        .def_readwrite("gpu_noise", &TruthModel::gpu_noise)
        .def_readwrite("h2d_noise", &TruthModel::h2d_noise)
        .def_readwrite("act_noise", &TruthModel::act_noise)
        .def_readwrite("layer_noise", &TruthModel::layer_noise)
        .def_readwrite("cpu_startup_extra_s", &TruthModel::cpu_startup_extra_s)
        .def_readwrite("contention", &TruthModel::contention)
        .def_readwrite("cpu_scale", &TruthModel::cpu_scale)
        .def_readwrite("gpu_scale", &TruthModel::gpu_scale)
        .def_readwrite("h2d_scale", &TruthModel::h2d_scale)
        .def("validate", &TruthModel::validate);

    // A tuple, so that it cannot be changed in place: SimConfig() starts from the compiled-in default, a changed
    // copy here would not reach it.
    m.attr("DEFAULT_PREDICTOR_RECALL") = py::tuple(py::cast(kDefaultPredictorRecall));
    py::class_<RamTierConfig>(m, "RamTierConfig",
                              "How the RAM tier reads experts from the model file: reads ('queued' or 'faulting'), "
                              "keep (offer read experts to the RAM cache), lookahead (MoE layers read ahead), "
                              "ready_first (the CPU runs resident experts first), exclusive (GPU and RAM hold "
                              "different experts; evicted GPU experts are copied back), fault_bytes, read_around "
                              "(bytes a fault reads per byte faulted), other_bytes (bytes per MoE layer outside the "
                              "routed experts, in the same page cache), fault_bandwidth_Bps (bytes/s the disk "
                              "delivers to a decode's faults, their latency included; 0: the queued figures, "
                              "read_bandwidth_Bps or the disk's), read_bandwidth_Bps (bytes/s of its other reads, "
                              "where they differ from the disk's: through the page cache, or direct into huge "
                              "pages; 0: the disk's), "
                              "read_cpu_s_per_byte (CPU-share delay per "
                              "byte read), recall.")
        .def(py::init<>())
        .def_readwrite("reads", &RamTierConfig::reads)
        .def_readwrite("keep", &RamTierConfig::keep)
        .def_readwrite("lookahead", &RamTierConfig::lookahead)
        .def_readwrite("ready_first", &RamTierConfig::ready_first)
        .def_readwrite("exclusive", &RamTierConfig::exclusive)
        .def_readwrite("fault_bytes", &RamTierConfig::fault_bytes)
        .def_readwrite("read_around", &RamTierConfig::read_around)
        .def_readwrite("other_bytes", &RamTierConfig::other_bytes)
        .def_readwrite("fault_bandwidth_Bps", &RamTierConfig::fault_bandwidth_Bps)
        .def_readwrite("read_bandwidth_Bps", &RamTierConfig::read_bandwidth_Bps)
        .def_readwrite("read_cpu_s_per_byte", &RamTierConfig::read_cpu_s_per_byte)
        .def_readwrite("recall", &RamTierConfig::recall)
        .def("validate", &RamTierConfig::validate);

    py::class_<SimConfig>(m, "SimConfig", "Simulator settings; recall per distance is an assumption to report.")
        .def(py::init<>())
        .def_readwrite("stage", &SimConfig::stage)
        .def_readwrite("ubatch", &SimConfig::ubatch)
        .def_readwrite("prompt_tokens", &SimConfig::prompt_tokens,
                       "decode: each prompt's first this many tokens prefilled in ubatches first (0: none)")
        .def_readwrite("prefetch_depth", &SimConfig::prefetch_depth)
        .def_readwrite("recall", &SimConfig::recall)
        .def_readwrite("predictor_seed", &SimConfig::predictor_seed)
        .def_readwrite("fill_on_miss", &SimConfig::fill_on_miss)
        .def_readwrite("max_tokens", &SimConfig::max_tokens)
        .def_readwrite("timeline_step", &SimConfig::timeline_step)
        .def_readwrite("timeline_layers", &SimConfig::timeline_layers)
        .def_readwrite("ram", &SimConfig::ram)
        .def("validate", &SimConfig::validate);

    py::class_<TimelineEvent>(m, "TimelineEvent", "resource 0 CPU, 1 GPU, 2 PCIe; kind 0 compute, 1 demand copy, "
                                                  "2 prefetch, 3 fill, 4 non-expert, 5 activations.")
        .def_readonly("step", &TimelineEvent::step)
        .def_readonly("layer", &TimelineEvent::layer)
        .def_readonly("resource", &TimelineEvent::resource)
        .def_readonly("expert", &TimelineEvent::expert)
        .def_readonly("kind", &TimelineEvent::kind)
        .def_readonly("start_s", &TimelineEvent::start_s)
        .def_readonly("end_s", &TimelineEvent::end_s);

    py::class_<SimResult>(m, "SimResult", "Outputs of a simulation run (seconds of simulated time).")
        .def_readonly("stage", &SimResult::stage)
        .def_readonly("tokens", &SimResult::tokens)
        .def_readonly("steps", &SimResult::steps)
        .def_readonly("prompts", &SimResult::prompts)
        .def_readonly("total_s", &SimResult::total_s)
        .def_readonly("ttft_s", &SimResult::ttft_s)
        .def_readonly("tpot_s", &SimResult::tpot_s)
        .def_readonly("tokens_per_s", &SimResult::tokens_per_s)
        .def_readonly("cache", &SimResult::cache)
        .def_readonly("bytes_h2d", &SimResult::bytes_h2d)
        .def_readonly("bytes_demand", &SimResult::bytes_demand)
        .def_readonly("bytes_prefetch", &SimResult::bytes_prefetch)
        .def_readonly("bytes_fill", &SimResult::bytes_fill)
        .def_readonly("prefetch_issued", &SimResult::prefetch_issued)
        .def_readonly("prefetch_declined", &SimResult::prefetch_declined)
        .def_readonly("prefetch_used", &SimResult::prefetch_used)
        .def_readonly("cpu_busy_s", &SimResult::cpu_busy_s)
        .def_readonly("gpu_busy_s", &SimResult::gpu_busy_s)
        .def_readonly("link_busy_s", &SimResult::link_busy_s)
        .def_readonly("predicted_moe_s", &SimResult::predicted_moe_s)
        .def_readonly("charged_moe_s", &SimResult::charged_moe_s)
        .def_readonly("ram_cache", &SimResult::ram_cache)
        .def_readonly("bytes_disk", &SimResult::bytes_disk)
        .def_readonly("bytes_disk_prefetch", &SimResult::bytes_disk_prefetch)
        .def_readonly("disk_reads", &SimResult::disk_reads)
        .def_readonly("page_faults", &SimResult::page_faults)
        .def_readonly("ram_prefetch_issued", &SimResult::ram_prefetch_issued)
        .def_readonly("demotions", &SimResult::demotions)
        .def_readonly("bytes_demoted", &SimResult::bytes_demoted)
        .def_readonly("disk_busy_s", &SimResult::disk_busy_s)
        .def_readonly("decision_us_mean", &SimResult::decision_us_mean)
        .def_readonly("prefetch_us_mean", &SimResult::prefetch_us_mean)
        .def_readonly("layer_moe_s", &SimResult::layer_moe_s)
        .def_readonly("device_cache", &SimResult::device_cache, "Per device: its cache's CacheStats.")
        .def_readonly("device_bytes_h2d", &SimResult::device_bytes_h2d, "Per device: bytes copied to it.")
        .def_readonly("device_link_busy_s", &SimResult::device_link_busy_s,
                      "Per device: seconds its copies took on the link.")
        .def_readonly("timeline", &SimResult::timeline);

    m.def(
        "make_steps",
        [](const Trace & t, int first, int end, const SimConfig & cfg) {
            std::vector<std::tuple<int64_t, int64_t, int>> out;
            for (const Step & s : make_steps(t, first, end, cfg)) out.emplace_back(s.begin, s.end, s.prompt);
            return out;
        },
        py::arg("trace"), py::arg("first_prompt"), py::arg("end_prompt"), py::arg("config"),
        "Steps (token_begin, token_end, prompt) of a run. ValueError on a bad prompt range.");
    m.def("replay_cache", &replay_cache, py::arg("trace"), py::arg("cache"), py::arg("first_prompt"),
          py::arg("end_prompt"), py::arg("config"), py::call_guard<py::gil_scoped_release>(),
          "Cache-only replay (every miss offered for admission); returns CacheStats.");
    m.def("simulate", &simulate, py::arg("trace"), py::arg("cache"), py::arg("scheduler"), py::arg("prefetcher"),
          py::arg("planner"), py::arg("truth_cost"), py::arg("truth"), py::arg("config"), py::arg("first_prompt"),
          py::arg("end_prompt"), py::arg("ram_cache") = static_cast<ExpertCache *>(nullptr),
          py::call_guard<py::gil_scoped_release>(),
          "Event-driven simulation of prompts [first_prompt, end_prompt); ram_cache: the RAM tier's ExpertCache "
          "(None: every expert in RAM); see hybrimoe.simulate.");
    m.def(
        "simulate_devices",
        [](const Trace & trace, std::vector<std::tuple<ExpertCache *, SchedulePolicy *, PrefetchPolicy *, CostModel,
                                                       CostModel>> devices,
           std::vector<int> layer_device, bool shared_link, const TruthModel & truth, const SimConfig & cfg,
           int first_prompt, int end_prompt, ExpertCache * ram) {
            std::vector<SimDevice> devs;
            for (auto & d : devices) {
                SimDevice sd;
                sd.cache = std::get<0>(d);
                sd.scheduler = std::get<1>(d);
                sd.prefetcher = std::get<2>(d);
                sd.planner = std::get<3>(d);
                sd.truth = std::get<4>(d);
                devs.push_back(sd);
            }
            py::gil_scoped_release nogil;
            return simulate_devices(trace, devs, layer_device, shared_link, truth, cfg, first_prompt, end_prompt,
                                    ram);
        },
        py::arg("trace"), py::arg("devices"), py::arg("layer_device"), py::arg("shared_link"), py::arg("truth"),
        py::arg("config"), py::arg("first_prompt"), py::arg("end_prompt"),
        py::arg("ram_cache") = static_cast<ExpertCache *>(nullptr),
        "simulate over several devices (llama.cpp's layer split): devices is a list of (cache, scheduler, "
        "prefetcher, planner CostModel, truth CostModel), one per device, each cache holding only its device's "
        "layers (expert bytes 0 for the others); layer_device: per MoE layer its device (empty: all on the first); "
        "shared_link: every device's copies share one link. The result's device_* fields are per device. "
        "ValueError on no device, a shared cache or a bad layer_device.");
    m.def("replay_decisions",
          [](py::iterable log, py::object cache, py::object scheduler, py::object prefetcher, const CostModel & cost,
             bool has_slots, int prefetch_layers, bool fill_on_miss) {
              const std::vector<DecisionRecord> recs = decisions_from_list(log);
              DeciderConfig cfg;
              cfg.has_slots = has_slots;
              cfg.prefetch_layers = prefetch_layers;
              cfg.fill_on_miss = fill_on_miss;
              auto c = cache.cast<std::shared_ptr<ExpertCache>>();
              auto s = scheduler.cast<std::shared_ptr<SchedulePolicy>>();
              auto p = prefetcher.cast<std::shared_ptr<PrefetchPolicy>>();
              std::vector<DecisionRecord> out;
              {
                  py::gil_scoped_release release;
                  out = replay_decisions(recs, c, s, p, cost, cfg);
              }
              return decisions_to_list(out);
          },
          py::arg("log"), py::arg("cache"), py::arg("scheduler"), py::arg("prefetcher"), py::arg("cost_model"),
          py::arg("has_slots"), py::arg("prefetch_layers"), py::arg("fill_on_miss"), R"doc(
Replays the engine's decision records (``Engine.take_log()``, logged from its first ubatch on) through fresh policy
objects built as the engine's were (same preset, budget in slots, initial fill) with the engine's cost model and
rules, and returns the simulator's records (same keys; its own decisions, which must equal the engine's:
docs/design.md §7); see ``hybrimoe.simulate.replay_engine_log``.

Raises:
    ValueError: a record misses a key, has the wrong types, or does not fit the cache (layer, expert, shapes).
    RuntimeError: a policy failed.
)doc");
    m.def(
        "record_makespans",
        [](py::iterable log, const CostModel & cost) {
            const std::vector<DecisionRecord> recs = decisions_from_list(log);
            cost.validate();
            std::vector<double> out;
            out.reserve(recs.size());
            for (const DecisionRecord & r : recs) out.push_back(record_makespan(r, cost));
            return out;
        },
        py::arg("log"), py::arg("cost_model"), R"doc(
Predicted makespans (seconds, one per record) of logged decision records' split runs under ``cost_model``
(``hybrimoe::record_makespan``: the record's own decisions, re-timed). Under the cost model the records were
decided with, each equals its ``makespan_s``; ``hybrimoe.calibration`` fits the copy-overlap fields with it against
the engine's ``measured_s``.

Raises:
    ValueError: a record misses a key or its vectors disagree in length; a cost model field out of range.
)doc");
    m.def("first_difference",
          [](py::iterable a, py::iterable b) { return first_difference(decisions_from_list(a), decisions_from_list(b)); },
          py::arg("a"), py::arg("b"),
          "First decision on which two decision logs differ ('record i (ubatch u, MoE layer l): field: a vs b'), or "
          "'' when they agree on every decision and have the same length.");
}

}  // namespace hybrimoe_bind
