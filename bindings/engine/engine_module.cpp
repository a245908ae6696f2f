// pybind11 module hybrimoe._engine: the runtime side that links our patched libllama.
// The llama_context pointer comes from llama-cpp-python (Llama._ctx.ctx, a ctypes c_void_p) as an int.
//
// The policy core's classes (CostModel, ExpertCache, the policies) are bound once, by hybrimoe._core; this module
// imports it first and takes those objects as they are: both modules link the one libhybrimoe_policy.so, so the
// C++ types behind _core's Python classes are the types the engine uses, and pybind11 (one registry per
// interpreter) converts them for the arguments below.
#include "runtime/calibration.h"
#include "runtime/engine.h"
#include "runtime/moe_hook.h"
#include "runtime/routing_recorder.h"
#include "runtime/routing_replay.h"
#include "policy/cost_model.h"
#include "policy/expert_cache.h"
#include "policy/prefetcher.h"
#include "policy/scheduler.h"
#include "../decision_dict.h"

#include <cstring>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;
using hybrimoe::Engine;
using hybrimoe::EngineConfig;
using hybrimoe::MoeHook;
using hybrimoe::RoutingReplay;
using hybrimoe::RoutingRecorder;

namespace {

// The Engine talks to its device when it is made (backends, slot pool), released and destroyed, and waits for
// it there. Python's GIL must not be held meanwhile: whatever the device's backend calls back into Python (ggml's
// log callback of llama-cpp-python takes the GIL, from whatever thread logs) would wait for it, and other Python
// threads could not run. The last reference may be dropped with the GIL held (a wrapper's dealloc, MoeHook
// replacing its engine): the deleter frees the device side without it, the rest as the caller left the GIL.
void delete_engine(Engine * e) {
    if (PyGILState_Check()) {
        py::gil_scoped_release nogil;
        e->release();
    }
    delete e;
}

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
    // registers the policy core's classes, which Engine's arguments are
    py::module_::import("hybrimoe._core");

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
             "Use an Engine for the layers it handles (None: the CPU-only seed path); rebuilds the graphs.")
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


    py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine", R"doc(
The hybrid CPU+GPU MoE engine of one llama_context (src/runtime/engine.h; HybriMoE §IV).

Install it with ``MoeHook.set_engine``. Per MoE layer and ubatch it splits the activated experts between the
CPU (ggml's kernels on the host weights) and the GPU (a pool of ``n_slots`` expert slots on ``device``), with
the given cache, schedule and prefetch policies (hybrimoe._core objects, C++ or Python subclasses).

Args:
    n_layer, n_expert, top_k, n_embd: model facts.
    moe_layers: model layer index of each MoE layer (the cache's layer index is the position in this list).
    expert_bytes: per MoE layer, bytes of one expert's (gate or fused gate_up, up, down) matrices as stored in
        the GGUF, 0 for a matrix the layer lacks (up with a fused gate_up; gate in an ungated FFN).
    expert_types: per MoE layer, ggml type ids of the (gate or gate_up, up, down) matrices.
    bias_bytes: per MoE layer, bytes of one expert's (gate or gate_up, up, down) F32 bias rows, 0 where the layer
        has none (gpt-oss); empty: no biases. The slot pool carries them per slot.
    scale_bytes: per MoE layer, bytes of one expert's (gate, up, down) F32 scales (``ffn_*_exps.scale``: 4, else
        0); empty: no scales. The slot pool carries them per slot.
    n_slots: GPU expert slots (0: everything on the CPU).
    device: ggml_backend_dev_t as an int (0 when n_slots is 0).
    max_buffer_bytes: bytes one slot buffer may hold at most (0: the device's max buffer size,
        ggml_backend_buft_get_max_size); a larger pool is split over several device buffers.
    cost_model: hybrimoe._core.CostModel, the planner's costs (seconds, bytes/s), copied.
    prefetch_layers: MoE layers predicted ahead (0: none); a prediction at distance d is taken to be right with
        probability hybrimoe._core.DEFAULT_PREDICTION_CONFIDENCE[d - 1] (the last value beyond).
    fill_on_miss: offer CPU-computed misses to the cache while the copy queue idles.
    routers: per MoE layer, F32 [n_expert, n_embd] router weights or an empty array (no prediction).
    router_bias: per MoE layer, F32 [n_expert] selection bias or an empty array.
    sigmoid_gating: router probabilities by sigmoid (else softmax).
    cache: hybrimoe._core.ExpertCache sized in slots (every layer's expert_bytes = slot_bytes).
    scheduler, prefetcher: hybrimoe._core.SchedulePolicy / PrefetchPolicy.
Raises:
    ValueError: inconsistent facts or cost model. RuntimeError: the device cannot hold the slot pool.
    TypeError: cache, scheduler, prefetcher or cost_model is not the hybrimoe._core class named above.
)doc")
        .def(py::init([](int n_layer, int n_expert, int top_k, int n_embd, std::vector<int> moe_layers,
                         std::vector<std::array<int64_t, 3>> expert_bytes,
                         std::vector<std::array<int32_t, 3>> expert_types, int64_t n_slots, uintptr_t device,
                         const hybrimoe::CostModel & cost_model, int prefetch_layers, bool fill_on_miss,
                         std::vector<py::array_t<float, py::array::c_style | py::array::forcecast>> routers,
                         std::vector<py::array_t<float, py::array::c_style | py::array::forcecast>> router_bias,
                         bool sigmoid_gating, std::shared_ptr<hybrimoe::ExpertCache> cache,
                         std::shared_ptr<hybrimoe::SchedulePolicy> scheduler,
                         std::shared_ptr<hybrimoe::PrefetchPolicy> prefetcher, int64_t max_buffer_bytes,
                         std::vector<std::array<int64_t, 3>> bias_bytes,
                         std::vector<std::array<int64_t, 3>> scale_bytes) {
                 EngineConfig c;
                 c.n_layer = n_layer;
                 c.n_expert = n_expert;
                 c.top_k = top_k;
                 c.n_embd = n_embd;
                 c.moe_layers = std::move(moe_layers);
                 c.expert_bytes = std::move(expert_bytes);
                 c.expert_types = std::move(expert_types);
                 c.bias_bytes = std::move(bias_bytes);
                 c.scale_bytes = std::move(scale_bytes);
                 c.n_slots = n_slots;
                 c.device = reinterpret_cast<ggml_backend_dev_t>(device);
                 c.max_buffer_bytes = max_buffer_bytes;
                 c.cost = cost_model;  // a copy: later changes to the Python object do not reach the engine
                 c.prefetch_layers = prefetch_layers;
                 c.fill_on_miss = fill_on_miss;
                 for (auto & r : routers) c.routers.emplace_back(r.data(), r.data() + r.size());
                 for (auto & b : router_bias) c.router_bias.emplace_back(b.data(), b.data() + b.size());
                 c.sigmoid_gating = sigmoid_gating;
                 // The arguments keep the policies (and a Python subclass's object) alive while the GIL is
                 // released: nothing Python is freed without it.
                 py::gil_scoped_release nogil;
                 return std::shared_ptr<Engine>(new Engine(std::move(c), cache, scheduler, prefetcher),
                                                delete_engine);
             }),
             py::arg("n_layer"), py::arg("n_expert"), py::arg("top_k"), py::arg("n_embd"), py::arg("moe_layers"),
             py::arg("expert_bytes"), py::arg("expert_types"), py::arg("n_slots"), py::arg("device"), py::arg("cost_model"),
             py::arg("prefetch_layers"), py::arg("fill_on_miss"), py::arg("routers"), py::arg("router_bias"),
             py::arg("sigmoid_gating"), py::arg("cache"), py::arg("scheduler"), py::arg("prefetcher"),
             py::arg("max_buffer_bytes") = 0, py::arg("bias_bytes") = std::vector<std::array<int64_t, 3>>{},
             py::arg("scale_bytes") = std::vector<std::array<int64_t, 3>>{})
        .def_static("slot_bytes_for", &Engine::slot_bytes_for, py::arg("expert_bytes"), py::arg("expert_types"),
                    py::arg("bias_bytes") = std::vector<std::array<int64_t, 3>>{},
                    py::arg("scale_bytes") = std::vector<std::array<int64_t, 3>>{},
                    "Bytes of one GPU slot for these per-layer (gate, up, down) expert sizes and ggml types and "
                    "(optional) F32 bias row and scale sizes: per kind the largest matrix, rounded up to a multiple "
                    "of 16 and of the kind's block sizes, plus per kind the largest bias row rounded up to 16, plus "
                    "4 bytes per kind some layer scales.")
        .def_static("scale_strides", &Engine::scale_strides, py::arg("scale_bytes"), py::arg("expert_layers"),
                    "Per-slot bytes of the gate, up and down scale regions of the slot pool (4, or 0: no such scale).")
        .def_static("bias_strides", &Engine::bias_strides, py::arg("bias_bytes"), py::arg("expert_layers"),
                    "Per-slot bytes of the gate, up and down bias regions of the slot pool (0: no such bias).")
        .def_static("region_strides", &Engine::region_strides, py::arg("expert_bytes"), py::arg("expert_types"),
                    "Per-slot bytes of the gate, up and down regions of the slot pool (see slot_bytes_for).")
        .def("set_negative_control", &Engine::set_negative_control, py::arg("what"),
             "Negative control for tests: the GPU share leaves one variant's op out ('weight_before', 'gate_up', "
             "'activation', 'scales', 'clamp'; '' for none). ValueError for another name.")
        .def_property_readonly("slot_bytes", &Engine::slot_bytes)
        .def_property_readonly("n_slots", &Engine::n_slots)
        .def("slot_of", &Engine::slot_of, py::arg("layer"), py::arg("expert"),
             "GPU slot of a resident (MoE layer, expert), or -1.")
        .def("take_error", &Engine::take_error,
             "First error since the last call ('' if none); after one, layers run on the CPU until clear_failure().")
        .def_property_readonly("failed", &Engine::failed)
        .def("clear_failure", &Engine::clear_failure)
        .def("reset_stats", &Engine::reset_stats)
        .def("release", &Engine::release, py::call_guard<py::gil_scoped_release>(),
             "Free the slot pool, GPU graphs and device backends now (afterwards every layer runs on the CPU).")
        .def("set_logging", &Engine::set_logging, py::arg("on"),
             "Keep a decision record per (MoE layer, ubatch) from now on (False: stop and drop them).")
        .def("take_log", [](Engine & e) { return hybrimoe_bind::decisions_to_list(e.take_log()); },
             "Decision records kept since the last call, per (MoE layer, ubatch): routing ids [T, k], router scores "
             "[T, E], expert bytes, copy-queue estimate, activated experts / loads / cached, the planned and the "
             "run split, demand loads admitted / declined, fills, prefetches with the predictions shown, evictions.")
        .def("set_drop_gpu_share", &Engine::set_drop_gpu_share, py::arg("on"),
             "Negative control for tests: replace the GPU share's outputs by zeros.")
        .def("set_wrong_bias_rows", &Engine::set_wrong_bias_rows, py::arg("on"),
             "Negative control for tests: later copies into the slot pool take each expert's bias rows from "
             "the next expert ((e + 1) mod n_expert).")
        .def("pinned_count", &Engine::pinned_count, "(layer, expert) keys pinned now.")
        .def("slots_in_use", &Engine::slots_in_use, "GPU slots holding an expert.")
        .def_property_readonly("slot_buffers", &Engine::slot_buffers,
                               "Device buffers the slot pool is split over (the device caps one buffer; 0: no slots).")
        .def_property_readonly("slots_per_buffer", &Engine::slots_per_buffer,
                               "Slots per slot buffer (the last may hold fewer; 0: no slots).")
        .def("layer_stats", [](const Engine & e) {
                py::list out;
                for (const auto & s : e.layer_stats()) {
                    py::dict d;
                    d["runs"] = s.runs; d["tokens"] = s.tokens;
                    d["cpu_experts"] = s.cpu_experts; d["gpu_experts"] = s.gpu_experts;
                    d["cpu_pairs"] = s.cpu_pairs; d["gpu_pairs"] = s.gpu_pairs;
                    d["demand_copies"] = s.demand_copies; d["prefetch_copies"] = s.prefetch_copies;
                    d["fill_copies"] = s.fill_copies; d["declined_loads"] = s.declined_loads;
                    d["gpu_runs"] = s.gpu_runs; d["gpu_launches"] = s.gpu_launches;
                    d["bytes_demand"] = s.bytes_demand; d["bytes_prefetch"] = s.bytes_prefetch;
                    d["bytes_fill"] = s.bytes_fill; d["bytes_act_h2d"] = s.bytes_act_h2d;
                    d["bytes_act_d2h"] = s.bytes_act_d2h; d["plan_s"] = s.plan_s; d["wait_s"] = s.wait_s;
                    d["cpu_share_s"] = s.cpu_share_s; d["cpu_share_cpu_s"] = s.cpu_share_cpu_s;
                    d["layer_s"] = s.layer_s; d["predicted_s"] = s.predicted_s;
                    out.append(d);
                }
                return out; },
             "Per MoE layer counters: runs, tokens, cpu/gpu experts (distinct per run) and pairs ((token, rank) pairs "
             "computed on each side), copies and bytes (demand, prefetch, fill), declined loads, GPU launches and "
             "their activation bytes (bytes_act_h2d: inputs up, bytes_act_d2h: weighted rows back), seconds in plan "
             "/ in the CPU share (plan end to wait start) / waiting for the GPU / per layer, predicted makespan seconds.");

    m.def("cpu_backend_skips_negative_ids", &hybrimoe::cpu_backend_skips_negative_ids,
          "Whether the CPU backend in this process is hybrimoe's ggml-cpu (mul_mat_id skips negative expert ids, "
          "patch 0005); the engine refuses to run otherwise.");
    m.def("cpu_backend_problem", &hybrimoe::cpu_backend_problem,
          "'' when cpu_backend_skips_negative_ids(), else why the engine cannot run (the message it raises).");

    m.def("measure_h2d_s", [](uintptr_t device, size_t bytes, int reps) {
              py::gil_scoped_release nogil;
              return hybrimoe::measure_h2d_s(reinterpret_cast<ggml_backend_dev_t>(device), bytes, reps);
          }, py::arg("device"), py::arg("bytes"), py::arg("reps") = 5,
          "Seconds per host-to-device copy of `bytes` to a ggml device (int pointer): median of `reps` copies, "
          "each synchronised, from the device's pinned host buffer type if it has one. RuntimeError on failure.");

    m.def("measure_copy_overlap", [](uintptr_t device, size_t bytes, int reps) {
              py::gil_scoped_release nogil;
              return hybrimoe::measure_copy_overlap(reinterpret_cast<ggml_backend_dev_t>(device), bytes, reps);
          }, py::arg("device"), py::arg("bytes"), py::arg("reps") = 5,
          "Share (0..1) of a host-to-device copy of `bytes` during which the device still computes (CostModel."
          "copy_overlap): a copy alone, a matrix-product chain of about its time alone, both together; median of "
          "`reps`. RuntimeError on failure.");

    m.def("measure_cpu_copy_overlap", [](uintptr_t device, size_t bytes, int reps, int n_threads) {
              py::gil_scoped_release nogil;
              return hybrimoe::measure_cpu_copy_overlap(reinterpret_cast<ggml_backend_dev_t>(device), bytes, reps,
                                                        n_threads);
          }, py::arg("device"), py::arg("bytes"), py::arg("reps") = 5, py::arg("n_threads") = 1,
          "Share (0..1) of a host-to-device copy of `bytes` during which the host CPU still computes at full speed "
          "(CostModel.cpu_copy_overlap): copies queued as the engine queues them alone, a memory-bound CPU chain "
          "(n_threads threads) of about their time alone, both together; median of `reps`. RuntimeError on failure.");

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
