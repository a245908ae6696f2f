// hybrimoe._engine.Engine: the hybrid CPU+GPU MoE engine (src/runtime/engine.h), and the CPU-backend check it
// runs on.
#include "runtime/engine.h"
#include "policy/cost_model.h"
#include "policy/expert_cache.h"
#include "policy/prefetcher.h"
#include "policy/scheduler.h"
#include "../common/decision_dict.h"
#include "common.h"

using hybrimoe::Engine;
using hybrimoe::EngineConfig;
using hybrimoe::SlotPool;

namespace hybrimoe_bind {

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

}  // namespace

void bind_engine(py::module_ & m) {
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
    ram_slots: RAM expert slots of the RAM tier (0: none; src/runtime/ram_tier.h): routed experts read from the
        model's files into host slots, the CPU share computed over them.
    files, file_sizes, file_mtimes_ns: the model's GGUF files (every shard) with the size (bytes) and modification
        time (ns) each had at load (checked when they are opened). Needed by the RAM tier, which reads the experts
        from them, and by GPU copies of experts whose host tensor is repacked (CPU_REPACK), which read the file's
        bytes of the expert through a mapping of them.
    file_of, offset_of: per MoE layer and matrix (gate or gate_up, up, down): file index (-1: none) and byte offset
        of expert 0's matrix (hybrimoe.runtime.ram_tier.expert_file_ranges).
    ram_io_threads: I/O workers; ram_cache: the RAM tier's ExpertCache (sized in RAM slots of slot_bytes);
    ram_drop_after_read: POSIX_FADV_DONTNEED on what a buffered read read (the page cache keeps no second copy);
    ram_direct_io: O_DIRECT reads through an aligned staging buffer (buffered where the file system refuses them).
    ram_repack: repack each expert matrix after its read where ggml-cpu repacks CPU weights (upstream's default);
        ignored with n_slots > 0 (GPU copies read the RAM slots, in the file's layout).
    ram_exclusive: with n_slots > 0, exclusive tiers: an expert on the GPU gives up its RAM slot, and one the GPU
        cache evicts is copied back into RAM when it ranks at least as high as the RAM cache's victim.
    ram_two_pass: the CPU share over the RAM slots in two passes per layer: the experts in RAM at the plan while the
        others are read, then those (off: all of them once every read ended).
    fused_cpu: compute each layer's CPU share as one fused op where it can (src/runtime/fused_moe.h), else with
        upstream's ops: 0 off, 1 with upstream's kernels and numbers, 2 also with repacked gemm kernels that round
        differently from upstream's gemv (faster prefill of Q4_K experts on x86).
    more_devices: several accelerators: the devices after ``device``, each a tuple (n_slots, device,
        max_buffer_bytes, cost_model) with a slot pool of its own; more_policies: per such device, in the same
        order, (cache, scheduler, prefetcher): an ExpertCache over every MoE layer sized in that device's slots, whose
        other layers have expert bytes 0 (a device caches only the layers it serves); layer_device: per MoE layer, the
        device serving its GPU share (0: ``device``, i: more_devices[i - 1]; llama.cpp's layer split, empty: all 0).
Raises:
    ValueError: inconsistent facts or cost model. RuntimeError: the device cannot hold the slot pool; a model file
    cannot be opened or changed since the load; the RAM slots cannot be allocated.
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
                         std::vector<std::array<int64_t, 3>> scale_bytes, int64_t ram_slots,
                         std::vector<std::string> files, std::vector<int64_t> file_sizes,
                         std::vector<int64_t> file_mtimes_ns, std::vector<std::array<int32_t, 3>> file_of,
                         std::vector<std::array<int64_t, 3>> offset_of, int ram_io_threads,
                         std::shared_ptr<hybrimoe::ExpertCache> ram_cache, bool ram_drop_after_read,
                         bool ram_direct_io, int fused_cpu, bool ram_repack, bool ram_exclusive,
                         bool ram_two_pass,
                         std::vector<std::tuple<int64_t, uintptr_t, int64_t, hybrimoe::CostModel>> more_devices,
                         std::vector<std::tuple<std::shared_ptr<hybrimoe::ExpertCache>,
                                                std::shared_ptr<hybrimoe::SchedulePolicy>,
                                                std::shared_ptr<hybrimoe::PrefetchPolicy>>> more_policies,
                         std::vector<int> layer_device) {
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
                 if (ram_slots < 0) throw py::value_error("ram_slots must be >= 0");
                 if (ram_slots > 0 && !ram_cache) throw py::value_error("ram_slots > 0 needs ram_cache");
                 c.ram.n_slots = ram_slots;
                 c.where.files = std::move(files);
                 c.where.file_sizes = std::move(file_sizes);
                 c.where.file_mtimes_ns = std::move(file_mtimes_ns);
                 c.where.file_of = std::move(file_of);
                 c.where.offset_of = std::move(offset_of);
                 c.ram.io_threads = ram_io_threads;
                 c.ram.drop_after_read = ram_drop_after_read;
                 c.ram.direct_io = ram_direct_io;
                 c.fused_cpu = fused_cpu;
                 c.ram.repack = ram_repack;
                 c.ram.exclusive = ram_exclusive;
                 c.ram.two_pass = ram_two_pass;
                 for (const auto & md : more_devices) {
                     hybrimoe::EngineDevice d;
                     d.n_slots = std::get<0>(md);
                     d.device = reinterpret_cast<ggml_backend_dev_t>(std::get<1>(md));
                     d.max_buffer_bytes = std::get<2>(md);
                     d.cost = std::get<3>(md);
                     c.more_devices.push_back(d);
                 }
                 c.layer_device = std::move(layer_device);
                 std::vector<hybrimoe::EnginePolicies> more;
                 for (const auto & mp : more_policies) {
                     more.push_back({std::get<0>(mp), std::get<1>(mp), std::get<2>(mp)});
                 }
                 // The arguments keep the policies (and a Python subclass's object) alive while the GIL is
                 // released: nothing Python is freed without it.
                 py::gil_scoped_release nogil;
                 return std::shared_ptr<Engine>(
                     new Engine(std::move(c), cache, scheduler, prefetcher, ram_cache, std::move(more)), delete_engine);
             }),
             py::arg("n_layer"), py::arg("n_expert"), py::arg("top_k"), py::arg("n_embd"), py::arg("moe_layers"),
             py::arg("expert_bytes"), py::arg("expert_types"), py::arg("n_slots"), py::arg("device"), py::arg("cost_model"),
             py::arg("prefetch_layers"), py::arg("fill_on_miss"), py::arg("routers"), py::arg("router_bias"),
             py::arg("sigmoid_gating"), py::arg("cache"), py::arg("scheduler"), py::arg("prefetcher"),
             py::arg("max_buffer_bytes") = 0, py::arg("bias_bytes") = std::vector<std::array<int64_t, 3>>{},
             py::arg("scale_bytes") = std::vector<std::array<int64_t, 3>>{}, py::arg("ram_slots") = 0,
             py::arg("files") = std::vector<std::string>{}, py::arg("file_sizes") = std::vector<int64_t>{},
             py::arg("file_mtimes_ns") = std::vector<int64_t>{},
             py::arg("file_of") = std::vector<std::array<int32_t, 3>>{},
             py::arg("offset_of") = std::vector<std::array<int64_t, 3>>{}, py::arg("ram_io_threads") = 4,
             py::arg("ram_cache") = std::shared_ptr<hybrimoe::ExpertCache>(), py::arg("ram_drop_after_read") = true,
             py::arg("ram_direct_io") = true, py::arg("fused_cpu") = 0, py::arg("ram_repack") = false,
             py::arg("ram_exclusive") = false, py::arg("ram_two_pass") = true,
             py::arg("more_devices") = std::vector<std::tuple<int64_t, uintptr_t, int64_t, hybrimoe::CostModel>>{},
             py::arg("more_policies") = py::list(),
             py::arg("layer_device") = std::vector<int>{})
        .def_static("slot_bytes_for", &SlotPool::slot_bytes_for, py::arg("expert_bytes"), py::arg("expert_types"),
                    py::arg("bias_bytes") = std::vector<std::array<int64_t, 3>>{},
                    py::arg("scale_bytes") = std::vector<std::array<int64_t, 3>>{}, py::arg("direct_align") = 0,
                    "Bytes of one GPU slot for these per-layer (gate, up, down) expert sizes and ggml types and "
                    "(optional) F32 bias row and scale sizes: per kind the largest matrix, rounded up to a multiple "
                    "of 16 and of the kind's block sizes, plus per kind the largest bias row rounded up to 16, plus "
                    "4 bytes per kind some layer scales. direct_align > 0 (a RAM slot: ram_direct_align): per kind "
                    "the largest matrix plus direct_align, rounded up to a multiple of it, instead.")
        .def_property_readonly_static("ram_direct_align", [](py::object) { return hybrimoe::RamTier::kDirectAlign; },
                                      "The RAM tier's direct-read alignment (bytes): slot_bytes_for's direct_align "
                                      "for a RAM slot.")
        .def_static("scale_strides", &SlotPool::scale_strides, py::arg("scale_bytes"), py::arg("expert_layers"),
                    "Per-slot bytes of the gate, up and down scale regions of the slot pool (4, or 0: no such scale).")
        .def_static("bias_strides", &SlotPool::bias_strides, py::arg("bias_bytes"), py::arg("expert_layers"),
                    "Per-slot bytes of the gate, up and down bias regions of the slot pool (0: no such bias).")
        .def_static("region_strides", &SlotPool::region_strides, py::arg("expert_bytes"), py::arg("expert_types"),
                    py::arg("direct_align") = 0,
                    "Per-slot bytes of the gate, up and down regions of the slot pool (see slot_bytes_for).")
        .def("set_negative_control", &Engine::set_negative_control, py::arg("what"),
             "Negative control for tests: the GPU share leaves one variant's op out ('weight_before', 'gate_up', "
             "'activation', 'scales', 'clamp'; '' for none). ValueError for another name.")
        .def_property_readonly("slot_bytes", [](const Engine & e) { return e.pool().slot_bytes(); })
        .def_property_readonly("n_slots", [](const Engine & e) { return e.n_slots(); },
                               "GPU expert slots of every device (0 after release()).")
        .def_property_readonly("n_devices", &Engine::n_devices, "Devices with a slot pool (1 + len(more_devices)).")
        .def("device_slots", [](const Engine & e, int d) { return e.n_slots(d); }, py::arg("device"),
             "GPU expert slots of one device (IndexError outside range(n_devices)).")
        .def("device_of", &Engine::device_of, py::arg("layer"),
             "The device (index) whose slots serve MoE layer `layer`'s GPU share (IndexError outside the layers).")
        .def("device_slots_in_use", [](const Engine & e, int d) { return e.pool(d).slots_in_use(); },
             py::arg("device"), "Slots of one device holding an expert.")
        .def("device_bytes_copied", [](const Engine & e, int d) { return e.bytes_copied(d); }, py::arg("device"),
             "Bytes queued for copies to one device since the last reset_stats (demand, prefetch, fill).")
        .def("device_slot_of", [](const Engine & e, int d, int layer, int expert) {
                 return e.pool(d).slot_of(layer, expert); },
             py::arg("device"), py::arg("layer"), py::arg("expert"),
             "Slot of (layer, expert) on one device, or -1.")
        .def("slot_of", [](const Engine & e, int layer, int expert) { return e.pool().slot_of(layer, expert); },
             py::arg("layer"), py::arg("expert"),
             "GPU slot of a resident (MoE layer, expert), or -1.")
        .def("take_error", &Engine::take_error,
             "First error since the last call ('' if none); after one, layers run on the CPU until clear_failure().")
        .def_property_readonly("failed", &Engine::failed)
        .def("clear_failure", &Engine::clear_failure)
        .def("reset_stats", [](Engine & e) {
                 e.reset_stats();
                 if (e.ram()) e.ram()->reset_stats(); })
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
        .def("set_fused_swap", &Engine::set_fused_swap, py::arg("on"),
             "Negative control for tests: the fused CPU share computes silu(up) * gate instead of silu(gate) * up.")
        .def("set_routing_replay", [](Engine & e, std::shared_ptr<hybrimoe::RoutingReplay> r) {
                 e.set_routing_replay(std::move(r)); }, py::arg("replay"),
             "The context's RoutingReplay (or None): where it has router scores, the cache policies see those for "
             "the rows it replays instead of the model's own router's.")
        .def("set_repacked_copies", &Engine::set_repacked_copies, py::arg("on"),
             "Negative control for tests: later copies of repacked experts into the slot pool take the repacked "
             "host bytes instead of the file's.")
        .def("repacked", &Engine::repacked,
             "Per MoE layer: whether its (gate or gate_up, up, down) matrices are read repacked by the CPU share "
             "(upstream's CPU_REPACK layout; all False until the layer's graph is built).")
        .def("fused_max_tokens", &Engine::fused_max_tokens,
             "Per MoE layer: the largest ubatch (tokens) whose CPU share runs as one fused op, -1 where none does "
             "(fused_cpu off, or experts of a kind it does not compute); set as the layer's graph is built.")
        .def("pinned_count", &Engine::pinned_count, "(layer, expert) keys pinned now.")
        .def_property_readonly("ram_slots", [](const Engine & e) { return e.ram() ? e.ram()->n_slots() : 0; },
                               "RAM expert slots of the RAM tier (0: no RAM tier).")
        .def_property_readonly("ram_slot_bytes", [](const Engine & e) { return e.ram() ? e.ram()->slot_bytes() : 0; },
                               "Bytes of one RAM expert slot (the GPU slot's layout; 0: no RAM tier).")
        .def("ram_slot_of", [](const Engine & e, int layer, int expert) {
                 return e.ram() ? e.ram()->slot_of(layer, expert) : -1; },
             py::arg("layer"), py::arg("expert"), "RAM slot of (MoE layer, expert), or -1.")
        .def("in_both_tiers", &Engine::in_both_tiers,
             "Experts whose weights are in a GPU slot (copied there, not a streamed load on probation) and in a RAM "
             "slot too: 0 between ubatches with moe_ram_exclusive.")
        .def("ram_resident_keys", [](const Engine & e) {
                 return e.ram() ? e.ram()->cache().resident_keys() : std::vector<int64_t>{}; },
             "Keys (layer * n_expert + expert) the RAM tier holds or is reading.")
        .def("ram_stats", [](const Engine & e) {
                py::dict d;
                if (!e.ram()) return d;
                const hybrimoe::RamTierStats s = e.ram()->stats();
                d["accesses"] = s.accesses; d["hits"] = s.hits; d["misses"] = s.misses; d["late"] = s.late;
                d["demand_reads"] = s.demand_reads; d["prefetch_reads"] = s.prefetch_reads;
                d["prefetch_used"] = s.prefetch_used; d["preads"] = s.preads; d["evictions"] = s.evictions;
                d["direct_matrices"] = s.direct_matrices; d["in_place_matrices"] = s.in_place_matrices;
                d["given_up"] = s.given_up; d["demotions"] = s.demotions;
                d["bytes_demand"] = s.bytes_demand; d["bytes_prefetch"] = s.bytes_prefetch; d["wait_s"] = s.wait_s;
                d["reads_in_flight"] = e.ram()->reads_in_flight();
                d["pinned"] = e.ram()->pinned();
                d["buffers"] = e.ram()->pool().n_buffers();
                py::list cells;
                for (const auto & c : e.ram()->ahead_counts()) cells.append(py::make_tuple(c[0], c[1]));
                d["ahead_cells"] = cells;
                return d; },
             "RAM tier counters since the last reset_stats(): accesses, hits, misses, late (hits still being read), "
             "demand_reads / prefetch_reads (experts read from the file) and their bytes (bytes_demand, "
             "bytes_prefetch), prefetch_used (prefetched experts used at their layer), preads (system calls), "
             "direct_matrices (expert matrices read with O_DIRECT), in_place_matrices (of those, read straight into "
             "their RAM slot, no copy), evictions, given_up and demotions (exclusive "
             "tiers: RAM slots given up by experts on the GPU, GPU evictions copied back into RAM), wait_s (seconds "
             "the plan waited for reads), reads_in_flight and pinned (RAM slots in use by a read, a "
             "layer, a read ahead or a GPU copy) now; buffers (host buffers the slots lie in); ahead_cells ((judged, "
             "used) reads ahead per share cell of RamTier::prefetch, windowed, the tier's state: not cleared by "
             "reset_stats); {} without a RAM tier.")
        .def("ram_inject_read_error", [](Engine & e, int err, int count) {
                 if (!e.ram()) throw py::value_error("no RAM tier");
                 e.ram()->inject_read_error(err, count); },
             py::arg("errno"), py::arg("count") = 1,
             "Fault injection for tests: the RAM tier's next `count` reads fail with this errno (0: off).")
        .def("slots_in_use", [](const Engine & e) { return e.pool().slots_in_use(); }, "GPU slots holding an expert.")
        .def_property_readonly("slot_buffers", [](const Engine & e) { return e.pool().n_buffers(); },
                               "Device buffers the slot pool is split over (the device caps one buffer; 0: no slots).")
        .def_property_readonly("slots_per_buffer",
                               [](const Engine & e) { return e.pool().is_open() ? e.pool().slots_per_buffer() : 0; },
                               "Slots per slot buffer (the last may hold fewer; 0: no slots).")
        .def("layer_stats", [](const Engine & e) {
                py::list out;
                for (const auto & s : e.layer_stats()) {
                    py::dict d;
                    d["runs"] = s.runs; d["tokens"] = s.tokens;
                    d["cpu_experts"] = s.cpu_experts; d["gpu_experts"] = s.gpu_experts;
                    d["cpu_late_experts"] = s.cpu_late_experts;
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
    m.def("cpu_repacks", [](int type, int64_t ne0, int64_t ne1) {
              if (type < 0 || type >= GGML_TYPE_COUNT) throw py::value_error("unknown ggml type id " + std::to_string(type));
              return hybrimoe::cpu_repacks((ggml_type) type, ne0, ne1);
          }, py::arg("type"), py::arg("ne0"), py::arg("ne1"),
          "Whether ggml-cpu here repacks a weight matrix of ggml type id `type` ([ne0, ne1]: ne1 rows of ne0 values) "
          "placed in its CPU_REPACK buffer, as upstream does with CPU weights by default (asks the buffer type; "
          "depends on the type, the row count and this CPU's features). ValueError for an unknown type id.");
}

}  // namespace hybrimoe_bind
