#include "runtime/engine.h"

#include "runtime/expert_ffn.h"
#include "runtime/moe_hook.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>
#include <stdexcept>

namespace hybrimoe {

namespace {

// Rows of the routing tensor the plan reads ([2k + n_expert, T], F32): ids as floats, weights, probabilities.
struct RoutingView {
    const ggml_tensor * t;
    int64_t k;
    float id(int64_t j, int64_t tok) const { return at(j, tok); }
    float weight(int64_t j, int64_t tok) const { return at(k + j, tok); }
    float prob(int64_t e, int64_t tok) const { return at(2 * k + e, tok); }
    float at(int64_t r, int64_t tok) const {
        return *(const float *) ((const char *) t->data + r * t->nb[0] + tok * t->nb[1]);
    }
};

// CPU seconds of this process, all threads (CLOCK_PROCESS_CPUTIME_ID): between the plan op and the wait op only the
// CPU share's nodes run in this process, whatever another process (the RPC stand-in's server) does meanwhile
double process_cpu_s() {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

int32_t * plane(ggml_tensor * plan, int p, int64_t tok) {
    return (int32_t *) ((char *) plan->data + tok * plan->nb[1] + p * plan->nb[2]);
}

// The plan's output when every pair runs on the CPU: upstream's ids (ids: [T, k] contiguous), no GPU rows.
void write_all_cpu(ggml_tensor * dst, const std::vector<int32_t> & ids) {
    const int64_t k = dst->ne[0], T = dst->ne[1];
    for (int64_t t = 0; t < T; ++t) {
        int32_t * cpu = plane(dst, 0, t);
        int32_t * gpu = plane(dst, 1, t);
        for (int64_t j = 0; j < k; ++j) {
            cpu[j] = ids[(size_t) (t * k + j)];
            gpu[j] = -1;
        }
    }
}

Engine::LayerRun * run_of(void * ud) { return static_cast<Engine::LayerRun *>(ud); }

void plan_trampoline(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith == 0) run_of(ud)->engine->op_plan(dst, *run_of(ud));
}

void fused_trampoline(ggml_tensor * dst, int ith, int nth, void * ud) {
    run_of(ud)->engine->op_fused(dst, *run_of(ud), ith, nth);
}

void late_trampoline(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith == 0) run_of(ud)->engine->op_late(dst, *run_of(ud));
}

void wait_trampoline(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith == 0) run_of(ud)->engine->op_wait(dst, *run_of(ud));
}

// dst[:, t] = sum over ranks j < k_sum, in upstream's order (build_moe_ffn's "ffn_moe_out": v0 + v1 + ...), of the
// pair's weighted output: a CPU pair's row times its routing weight (upstream's "ffn_moe_weighted" product, rounded
// before the sum: this file is compiled without FP contraction), a GPU pair's row as the GPU weighted it.
void combine_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    const int64_t k_sum = run_of(ud)->k_sum;
    const ggml_tensor * gpu = dst->src[1];
    const ggml_tensor * plan = dst->src[2];
    const RoutingView routing{dst->src[3], plan->ne[0]};
    const int64_t n_embd = dst->ne[0];
    const int64_t T = dst->ne[1];
    // 2, or 1 + the RAM tier's CPU shares (one per slot buffer, and per pass: src[0], src[4..]); plane p >= 2 is
    // the pairs of the share at src[2 + p]
    const int64_t n_planes = plan->ne[2];
    for (int64_t t = ith; t < T; t += nth) {
        float * out = (float *) ((char *) dst->data + t * dst->nb[1]);
        const int32_t * gpu_row = (const int32_t *) ((const char *) plan->data + t * plan->nb[1] + plan->nb[2]);
        for (int64_t j = 0; j < k_sum; ++j) {
            const ggml_tensor * cpu = dst->src[0];
            for (int64_t p = 2; p < n_planes; ++p) {  // the RAM buffer whose share computed this pair
                const int32_t * row = (const int32_t *) ((const char *) plan->data + t * plan->nb[1] + p * plan->nb[2]);
                if (j < plan->ne[0] && row[j] >= 0) cpu = dst->src[2 + p];
            }
            if (gpu_row[j] >= 0) {
                const float * v = (const float *) ((const char *) gpu->data + (size_t) gpu_row[j] * gpu->nb[1]);
                if (j == 0) {
                    std::memcpy(out, v, (size_t) n_embd * sizeof(float));
                } else {
                    for (int64_t i = 0; i < n_embd; ++i) out[i] = out[i] + v[i];
                }
            } else if (run_of(ud)->weight_before) {
                // weighted before the FFN (Llama 4): upstream sums the down projections as they are
                const float * v = (const float *) ((const char *) cpu->data + j * cpu->nb[1] + t * cpu->nb[2]);
                if (j == 0) {
                    std::memcpy(out, v, (size_t) n_embd * sizeof(float));
                } else {
                    for (int64_t i = 0; i < n_embd; ++i) out[i] = out[i] + v[i];
                }
            } else {
                const float w = routing.weight(j, t);
                const float * v = (const float *) ((const char *) cpu->data + j * cpu->nb[1] + t * cpu->nb[2]);
                if (j == 0) {
                    for (int64_t i = 0; i < n_embd; ++i) out[i] = v[i] * w;
                } else {
                    for (int64_t i = 0; i < n_embd; ++i) {
                        const float p = v[i] * w;
                        out[i] = out[i] + p;
                    }
                }
            }
        }
    }
}

}  // namespace

bool cpu_backend_skips_negative_ids() {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
    if (!reg) return false;
    auto fn = (int (*)(void)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_skips_negative_expert_ids");
    return fn && fn() >= 1;
}

bool cpu_backend_skips_negative_ids_repacked() {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
    if (!reg) return false;
    auto fn = (int (*)(void)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_skips_negative_expert_ids");
    return fn && fn() >= 2;
}

std::string cpu_backend_problem() {
    if (cpu_backend_skips_negative_ids()) return "";
    return "the CPU backend in this process is not hybrimoe's ggml-cpu (hybrimoe/lib/libggml-cpu.so.0, which skips "
           "the (token, expert) pairs the GPU computes): llama-cpp-python's was loaded first. Import hybrimoe before "
           "llama_cpp, in a fresh process, and do not build llama-cpp-python with GGML_BACKEND_DL";
}

Engine::Dev::Dev(int index_, const EngineConfig & cfg, const EngineDevice & d, EnginePolicies p)
    : index(index_), n_slots(d.n_slots), device(d.device), max_buffer_bytes(d.max_buffer_bytes), cost(d.cost),
      cache(std::move(p.cache)), scheduler(std::move(p.scheduler)), prefetcher(std::move(p.prefetcher)),
      pool((int) cfg.moe_layers.size(), cfg.n_expert, cfg.expert_bytes, cfg.expert_types, cfg.bias_bytes,
           cfg.scale_bytes) {}

int64_t Engine::n_slots() const {
    int64_t n = 0;
    for (const auto & d : devs_) n += d->n_slots;
    return n;
}

Engine::Engine(EngineConfig cfg, std::shared_ptr<ExpertCache> cache, std::shared_ptr<SchedulePolicy> scheduler,
               std::shared_ptr<PrefetchPolicy> prefetcher, std::shared_ptr<ExpertCache> ram_cache,
               std::vector<EnginePolicies> more)
    : cfg_(std::move(cfg)) {
    const int L = (int) cfg_.moe_layers.size();
    if (cfg_.n_layer < 1 || cfg_.n_expert < 1 || cfg_.top_k < 1 || cfg_.n_embd < 1 || L < 1) {
        throw std::invalid_argument("engine: model facts must be positive (layers, experts, top-k, n_embd, MoE layers)");
    }
    if ((int) cfg_.expert_bytes.size() != L) throw std::invalid_argument("engine: one expert size per MoE layer");
    if (more.size() != cfg_.more_devices.size()) {
        throw std::invalid_argument("engine: " + std::to_string(cfg_.more_devices.size() + 1) + " devices need " +
                                    std::to_string(cfg_.more_devices.size() + 1) + " sets of policies, got " +
                                    std::to_string(more.size() + 1));
    }
    more.insert(more.begin(), EnginePolicies{std::move(cache), std::move(scheduler), std::move(prefetcher)});
    EngineDevice first;
    first.n_slots = cfg_.n_slots;
    first.device = cfg_.device;
    first.max_buffer_bytes = cfg_.max_buffer_bytes;
    first.cost = cfg_.cost;
    for (size_t d = 0; d <= cfg_.more_devices.size(); ++d) {
        const EngineDevice & ed = d == 0 ? first : cfg_.more_devices[d - 1];
        const std::string which = "engine: device " + std::to_string(d) + ": ";
        if (!more[d].cache || !more[d].scheduler || !more[d].prefetcher) {
            throw std::invalid_argument(which + "cache and policies are required");
        }
        const ExpertCache * c = more[d].cache.get();
        if (c->n_layers() != L || c->n_experts() != cfg_.n_expert) {
            throw std::invalid_argument(which + "the cache has " + std::to_string(c->n_layers()) + " layers x " +
                                        std::to_string(c->n_experts()) + " experts, the model " +
                                        std::to_string(L) + " x " + std::to_string(cfg_.n_expert));
        }
        if (ed.n_slots < 0) throw std::invalid_argument(which + "negative slot count");
        ed.cost.validate();
        devs_.emplace_back(new Dev((int) d, cfg_, ed, std::move(more[d])));
    }
    if (cfg_.layer_device.empty()) cfg_.layer_device.assign((size_t) L, 0);
    if ((int) cfg_.layer_device.size() != L) {
        throw std::invalid_argument("engine: layer_device has " + std::to_string(cfg_.layer_device.size()) +
                                    " entries for " + std::to_string(L) + " MoE layers");
    }
    for (int d : cfg_.layer_device) {
        if (d < 0 || d >= (int) devs_.size()) {
            throw std::invalid_argument("engine: layer_device entry " + std::to_string(d) + " is not one of the " +
                                        std::to_string(devs_.size()) + " devices");
        }
    }
    dev_of_ = cfg_.layer_device;
    if (cfg_.prefetch_layers < 0) throw std::invalid_argument("engine: prefetch_layers must be >= 0");
    const std::string cpu_problem = cpu_backend_problem();
    if (!cpu_problem.empty()) throw std::runtime_error("engine: " + cpu_problem);
    moe_index_.assign((size_t) cfg_.n_layer, -1);
    for (int i = 0; i < L; ++i) {
        const int il = cfg_.moe_layers[(size_t) i];
        if (il < 0 || il >= cfg_.n_layer) throw std::invalid_argument("engine: MoE layer index out of range");
        moe_index_[(size_t) il] = i;
    }
    tensors_.resize((size_t) L);
    runs_.resize((size_t) L);
    for (int i = 0; i < L; ++i) {
        runs_[(size_t) i].reset(new LayerRun());
        runs_[(size_t) i]->engine = this;
        runs_[(size_t) i]->ml = i;
        runs_[(size_t) i]->il = cfg_.moe_layers[(size_t) i];
    }
    stats_.resize((size_t) L);
    std::vector<double> eb((size_t) L);
    for (int i = 0; i < L; ++i) {
        const auto & b = cfg_.expert_bytes[(size_t) i];
        eb[(size_t) i] = (double) (b[0] + b[1] + b[2]);
    }
    cfg_.routers.resize((size_t) L);
    cfg_.router_bias.resize((size_t) L);
    predictor_.reset(new RouterPredictor(cfg_.n_expert, cfg_.top_k, cfg_.n_embd, cfg_.routers, cfg_.router_bias,
                                         cfg_.sigmoid_gating, cfg_.confidence, eb));
    for (auto & dp : devs_) {
        Dev & d = *dp;
        d.cache->set_record_evicted(true);
        d.cache->take_evicted();
        d.placement.engine = this;
        d.placement.dev = &d;
        DeciderConfig dc;
        dc.has_slots = d.n_slots > 0;
        dc.prefetch_layers = cfg_.prefetch_layers;
        dc.fill_on_miss = cfg_.fill_on_miss;
        d.decider.reset(new LayerDecider(d.cache, d.scheduler, d.prefetcher, d.cost, dc));
        if (d.n_slots <= 0) continue;
        if (!d.device) {
            throw std::invalid_argument("engine: a device is required for a non-empty expert cache (device " +
                                        std::to_string(d.index) + ")");
        }
        d.pool.open(d.device, d.n_slots, d.max_buffer_bytes);
        d.gpu.reset(new GpuShare(d.pool, cfg_.n_embd));
        // experts already resident in the cache (an initial fill) get slots now and are copied at first use; a
        // device only holds the layers it serves
        for (int64_t key : d.cache->resident_keys()) {
            const int l = (int) (key / cfg_.n_expert);
            if (dev_of_[(size_t) l] != d.index) continue;
            if (!d.pool.assign(l, (int) (key % cfg_.n_expert))) break;
        }
    }
    gpu_pool_of_.resize((size_t) L);
    for (int l = 0; l < L; ++l) gpu_pool_of_[(size_t) l] = &dev(l).pool;
    if (any_slots()) cfg_.ram.repack = false;  // GPU copies read the RAM slots: the file's layout there
    if (cfg_.ram.n_slots > 0) {
        // GPU loads copy from the RAM slots: pinned host memory (the device's host buffer type) makes them DMA
        // copies; where that type caps a buffer (Vulkan), the slots are split over several, and the CPU share runs
        // once per buffer (build)
        if (cfg_.ram.max_buffer_bytes <= 0) cfg_.ram.max_buffer_bytes = cfg_.max_buffer_bytes;
        // the RAM pool's geometry: its slots hold room for direct reads (RamTier::kDirectAlign)
        const SlotPool ram_geometry(L, cfg_.n_expert, cfg_.expert_bytes, cfg_.expert_types, cfg_.bias_bytes,
                                    cfg_.scale_bytes, RamTier::kDirectAlign);
        auto buffers_with = [&](ggml_backend_buffer_type_t buft) {
            return ram_geometry.host_buffers_for(buft, cfg_.ram.n_slots, cfg_.ram.max_buffer_bytes);
        };
        // the combine op takes one CPU share per buffer as a source: past that, pageable memory in one buffer
        ggml_backend_buffer_type_t host = devs_[0]->pool.host_buffer_type();
        if (host && buffers_with(host) > kMaxRamBuffers) host = nullptr;
        if (buffers_with(nullptr) > kMaxRamBuffers) {
            throw std::invalid_argument("engine: the RAM expert slots would need " +
                                        std::to_string(buffers_with(nullptr)) + " buffers of at most " +
                                        std::to_string(cfg_.ram.max_buffer_bytes) + " bytes; at most " +
                                        std::to_string(kMaxRamBuffers) + " (raise HYBRIMOE_MAX_BUFFER_BYTES)");
        }
        ram_.reset(new RamTier(L, cfg_.n_expert, cfg_.expert_bytes, cfg_.expert_types, cfg_.bias_bytes,
                               cfg_.scale_bytes, cfg_.where, cfg_.ram, std::move(ram_cache), host));
    }
    repacked_.assign((size_t) L, {false, false, false});
    fused_max_T_.assign((size_t) L, -1);
    if (cfg_.fused_cpu < 0 || cfg_.fused_cpu > 2) throw std::invalid_argument("engine: fused_cpu must be 0, 1 or 2");
    if (cfg_.fused_cpu > 0) fused_.reset(new FusedCpuShare(cfg_.fused_cpu == 2));
}

Engine::~Engine() {
    release();
    ram_.reset();
}

void Engine::write_fallback(ggml_tensor * dst) {
    if (!ram_) {
        write_all_cpu(dst, ids_);
        return;
    }
    const int64_t k = dst->ne[0], T = dst->ne[1];
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t p = 0; p < dst->ne[2]; ++p) {
            int32_t * row = plane(dst, (int) p, t);
            for (int64_t j = 0; j < k; ++j) row[j] = -1;
        }
    }
}

void Engine::release() {
    // the RAM slots stay (graphs built over them may still run, on no device); their reads stop
    if (ram_) {
        release_ram_holds(true);
        ram_->stop_io();
    }
    for (auto & dp : devs_) {
        Dev & d = *dp;
        d.gpu.reset();
        d.pool.release();
        if (d.n_slots > 0) {
            d.n_slots = 0;  // from now on every layer runs on the CPU
            if (d.decider) d.decider->set_has_slots(false);
        }
    }
    cfg_.n_slots = 0;
}

int Engine::pinned_count() const {
    int n = 0;
    for (const auto & d : devs_) {
        for (int l = 0; l < d->cache->n_layers(); ++l) {
            for (int e = 0; e < cfg_.n_expert; ++e) n += d->cache->pinned(l, e) ? 1 : 0;
        }
    }
    return n;
}

std::vector<EngineLayerStats> Engine::layer_stats() const {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return stats_;
}

void Engine::reset_stats() {
    std::lock_guard<std::mutex> lock(stats_mu_);
    for (auto & s : stats_) s = EngineLayerStats{};
    for (auto & d : devs_) d->bytes_copied = 0.0;
}

std::string Engine::take_error() {
    std::lock_guard<std::mutex> lock(stats_mu_);
    std::string e;
    e.swap(error_);
    return e;
}

void Engine::clear_failure() {
    std::lock_guard<std::mutex> lock(stats_mu_);
    failed_ = false;
    error_.clear();
}

void Engine::fail(const std::string & msg) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    if (error_.empty()) error_ = msg;
    failed_ = true;
}

void Engine::set_logging(bool on) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    logging_ = on;
    if (!on) log_.clear();
}

std::vector<DecisionRecord> Engine::take_log() {
    std::lock_guard<std::mutex> lock(stats_mu_);
    std::vector<DecisionRecord> out;
    out.swap(log_);
    return out;
}

ggml_tensor * Engine::build(const llama_moe_hook_args & a, void * counters) {
    const int ml = moe_index(a.il);
    if (ml < 0) return nullptr;
    const ExpertMatrices m = expert_matrices(a);
    if (a.n_expert != cfg_.n_expert || a.cur->ne[0] != cfg_.n_embd) return nullptr;
    // the slot pool's regions were sized from the facts the engine was given: each of the layer's matrices (by
    // nb[2] and type), bias rows (F32 [n_out]) and scales (F32) must be what they say, else upstream's path
    const auto mats = m.slot_matrices(), biases = m.slot_biases(), scales = m.slot_scales();
    const auto & want = cfg_.expert_bytes[(size_t) ml];
    const auto & want_t = cfg_.expert_types[(size_t) ml];
    for (size_t i = 0; i < 3; ++i) {
        const int64_t has = mats[i] ? (int64_t) mats[i]->nb[2] : 0;
        if (has != want[i] || (mats[i] && (int32_t) mats[i]->type != want_t[i])) return nullptr;
        const int64_t told_b = cfg_.bias_bytes.empty() ? 0 : cfg_.bias_bytes[(size_t) ml][i];
        const int64_t has_b = biases[i] ? biases[i]->ne[0] * (int64_t) sizeof(float) : 0;
        if (told_b != has_b || (biases[i] && biases[i]->type != GGML_TYPE_F32)) return nullptr;
        const int64_t told_s = cfg_.scale_bytes.empty() ? 0 : cfg_.scale_bytes[(size_t) ml][i];
        const int64_t has_s = scales[i] ? (int64_t) sizeof(float) : 0;
        if (told_s != has_s || (scales[i] && scales[i]->type != GGML_TYPE_F32)) return nullptr;
    }
    // the CPU share reads the matrices where llama put them: host memory in the file's layout, or upstream's
    // repacked CPU buffer (its repacked mul_mat_id skips the GPU's pairs only with patch 0005 version 2; the GPU
    // copies then take the file's bytes, mapped, and a RAM tier reads the file into slots of its own); biases and
    // scales are read as they are
    std::array<bool, 3> repacked{false, false, false};
    for (size_t i = 0; i < 3; ++i) repacked[i] = !ram_ && is_repacked(mats[i]);
    const bool any_repacked = repacked[0] || repacked[1] || repacked[2];
    if (any_repacked && !cpu_backend_skips_negative_ids_repacked()) return nullptr;
    if (any_repacked && any_slots() && !originals_) {
        if (cfg_.where.empty()) return nullptr;  // no way to the file's layout for the GPU copies
        originals_.reset(new MappedExperts(cfg_.where, cfg_.expert_bytes, cfg_.n_expert));
    }
    const std::array<std::array<ggml_tensor *, 3>, 3> parts = {mats, biases, scales};
    for (size_t p = 0; p < parts.size(); ++p) {
        for (size_t i = 0; i < 3; ++i) {
            const ggml_tensor * t = parts[p][i];
            if (!t || (p == 0 && repacked[i])) continue;
            if (!t->buffer || !ggml_backend_buffer_is_host(t->buffer) || t->extra != nullptr) return nullptr;
        }
    }
    repacked_[(size_t) ml] = repacked;
    tensors_[(size_t) ml] = m;
    LayerRun & run = *runs_[(size_t) ml];
    run.counters = counters;
    run.k_sum = a.n_expert_used_sum;
    run.weight_before = m.weight_before;

    ggml_context * ctx = a.ctx;
    const int64_t n_embd = a.cur->ne[0];
    const int64_t T = a.cur->ne[1];
    const int64_t k = a.n_expert_used;

    // routing ids, weights and probabilities in one tensor where they are computed: one transfer to the host
    // with a RAM tier over several slot buffers, one CPU share per buffer: plane 0 the ids of buffer 0's pairs,
    // plane 1 the GPU rows, plane 1 + b those of buffer b >= 1 (local slots; -1 where another computes the pair)
    const int n_ram_bufs = ram_ ? std::max(1, ram_->pool().n_buffers()) : 1;  // at most kMaxRamBuffers
    // with the RAM tier the CPU share runs in two passes where the sources allow (up to kMaxLateBuffers slot
    // buffers): the experts already in RAM at the plan while the reads of the others end, then those (op_late);
    // planes n_ram_bufs + 1 .. 2 * n_ram_bufs hold the second pass's pairs, per buffer
    const bool late = ram_ && cfg_.ram.two_pass && n_ram_bufs <= kMaxLateBuffers;
    run.late_pass = late;
    const int n_shares = n_ram_bufs * (late ? 2 : 1);
    ggml_tensor * ids_f = ggml_cast(ctx, a.selected_experts, GGML_TYPE_F32);  // [k, T], exact below 2^24
    ggml_tensor * w = ggml_is_contiguous(a.weights) ? a.weights : ggml_cont(ctx, a.weights);
    ggml_tensor * routing = ggml_concat(ctx, ggml_concat(ctx, ids_f, ggml_reshape_2d(ctx, w, k, T), 0), a.probs, 0);
    ggml_format_name(routing, "hybrimoe_routing-%d", a.il);  // [2k + n_expert, T]
    // the hidden state goes in as the same reshaped view the CPU share reads, so the scheduler copies it once
    ggml_tensor * x = ggml_reshape_3d(ctx, a.cur, n_embd, 1, T);
    ggml_tensor * psrc[2] = {routing, x};
    ggml_tensor * plan = ggml_custom_4d(ctx, GGML_TYPE_I32, k, T, 1 + n_shares, 1, psrc, 2, plan_trampoline, 1,
                                        &run);
    ggml_format_name(plan, "hybrimoe_plan-%d", a.il);

    // the CPU share, unweighted (the combine weights each CPU pair) unless weighted before the FFN (Llama 4); scales
    // are gathered by the routing's own ids (ggml_get_rows has no "skip" for the GPU pairs' -1: it would abort)
    // with the RAM tier the CPU share reads the RAM slots (its planes then hold slot numbers), else the file's tensors
    if (ram_) {
        ram_->set_layer(ml, m);
        for (int i = 0; i < 3; ++i) repacked_[(size_t) ml][(size_t) i] = ram_->repacked(ml, i);  // the slots' layout
    }
    ggml_tensor * shares[GGML_MAX_SRC];
    std::vector<ExpertMatrices> buf_m;
    for (int b = 0; b < n_ram_bufs; ++b) {
        ggml_tensor * cpu_ids = ggml_view_2d(ctx, plan, k, T, plan->nb[1], (size_t) (b == 0 ? 0 : 1 + b) * plan->nb[2]);
        buf_m.push_back(ram_ ? ram_->views(ctx, ml, m, b) : m);
        const ExpertMatrices & cpu_m = buf_m.back();
        shares[b] = nullptr;
        if (fused_ && !ram_ && FusedCpuShare::unsupported(cpu_m, T) == nullptr) {
            try {
                fused_->prepare(ml, cpu_m, n_embd, k, T);
                // the plan op's predicate at every ubatch size: unsupported() depends on the ubatch only from 8
                // tokens on (upstream's tiled kernel)
                fused_max_T_[(size_t) ml] = FusedCpuShare::unsupported(cpu_m, 8) ? 7 : INT64_MAX;
                ggml_tensor * fsrc[2] = {x, cpu_ids};
                shares[b] = ggml_custom_4d(ctx, GGML_TYPE_F32, n_embd, k, T, 1, fsrc, 2, fused_trampoline,
                                           GGML_N_TASKS_MAX, &run);
                ggml_format_name(shares[b], "hybrimoe_cpu_fused-%d", a.il);
            } catch (const std::exception &) {
                fused_max_T_[(size_t) ml] = -1;  // upstream's ops for this layer
            }
        }
        if (!shares[b]) {
            shares[b] = build_expert_ffn(ctx, cpu_m, x, cpu_ids, m.weight_before ? a.weights : nullptr,
                                         b == 0 ? "hybrimoe_cpu" : "hybrimoe_cpu_b", a.il, a.selected_experts);
        }
    }
    if (late) {
        // the second pass's ids come out of op_late, which runs after the first pass (its sources) and waits for
        // the reads: the second pass cannot start before them
        ggml_tensor * lsrc[GGML_MAX_SRC] = {plan};
        for (int b = 0; b < n_ram_bufs; ++b) lsrc[1 + b] = shares[b];
        ggml_tensor * late_ids = ggml_custom_4d(ctx, GGML_TYPE_I32, k, T, n_ram_bufs, 1, lsrc, 1 + n_ram_bufs,
                                                late_trampoline, 1, &run);
        ggml_format_name(late_ids, "hybrimoe_late-%d", a.il);
        for (int b = 0; b < n_ram_bufs; ++b) {
            ggml_tensor * ids_b = ggml_view_2d(ctx, late_ids, k, T, late_ids->nb[1], (size_t) b * late_ids->nb[2]);
            shares[n_ram_bufs + b] = build_expert_ffn(ctx, buf_m[(size_t) b], x, ids_b,
                                                      m.weight_before ? a.weights : nullptr, "hybrimoe_cpu_late", a.il,
                                                      a.selected_experts);
        }
    }
    ggml_tensor * experts = shares[0];

    ggml_tensor * wsrc[GGML_MAX_SRC] = {plan};  // the CPU shares: only to run after them
    for (int b = 0; b < n_shares; ++b) wsrc[1 + b] = shares[b];
    ggml_tensor * gpu = ggml_custom_4d(ctx, GGML_TYPE_F32, n_embd, k * T, 1, 1, wsrc, 1 + n_shares, wait_trampoline,
                                       1, &run);
    ggml_format_name(gpu, "hybrimoe_wait-%d", a.il);

    ggml_tensor * csrc[GGML_MAX_SRC] = {experts, gpu, plan, routing};
    for (int b = 1; b < n_shares; ++b) csrc[3 + b] = shares[b];
    ggml_tensor * out = ggml_custom_4d(ctx, GGML_TYPE_F32, n_embd, T, 1, 1, csrc, 3 + n_shares, combine_op,
                                       GGML_N_TASKS_MAX, &run);
    ggml_format_name(out, "hybrimoe_combine-%d", a.il);
    return out;
}

void Engine::Placement::evicted(const std::vector<int64_t> & keys) {
    for (int64_t key : keys) {
        if (engine->ram_ && engine->cfg_.ram.exclusive && !engine->large_ubatch_) engine->demote(key);
        dev->pool.evict(key);
    }
}

void Engine::demote(int64_t key) {
    const int l = (int) (key / cfg_.n_expert), e = (int) (key % cfg_.n_expert);
    SlotPool & pool = dev(l).pool;
    if (!pool.loaded(key)) return;  // never copied to its GPU slot (an initial fill not used yet)
    const std::array<uint8_t *, 3> dst = ram_->demote(l, e, now());
    if (!dst[0] && !dst[1] && !dst[2]) return;  // in RAM already, or ranked below the RAM tier's victim
    pool.copy_out(l, e, ram_->expert_bytes(l), dst);
    ram_->demoted(l, e);
}

bool Engine::kept_on_gpu(int l, int e) const {
    const int64_t key = (int64_t) l * cfg_.n_expert + e;
    // not a streamed load on probation: it leaves the GPU at the next load (its RAM slot stays)
    const Dev & d = dev(l);
    return d.pool.slot_of_key(key) >= 0 && d.pool.loaded(key) && !d.cache->on_probation(l, e);
}

int64_t Engine::in_both_tiers() const {
    if (!ram_) return 0;
    int64_t n = 0;
    for (int l = 0; l < (int) tensors_.size(); ++l) {
        for (int e = 0; e < cfg_.n_expert; ++e) {
            const int64_t key = (int64_t) l * cfg_.n_expert + e;
            n += kept_on_gpu(l, e) && ram_->slot_of(l, e) >= 0;
        }
    }
    return n;
}

void Engine::give_up_ram(int ml) {
    for (int e = 0; e < cfg_.n_expert; ++e) {
        if (kept_on_gpu(ml, e) && ram_->slot_of(ml, e) >= 0) ram_->give_up(ml, e);
    }
}

bool Engine::Placement::holds(int layer) const {
    return layer >= 0 && layer < (int) engine->tensors_.size() && engine->tensors_[(size_t) layer].down != nullptr &&
           engine->dev_of_[(size_t) layer] == dev->index;
}

double Engine::copy_from_ram(int layer, int expert, int bias_expert) {
    Dev & d = dev(layer);
    const std::array<const uint8_t *, 3> src = ram_->matrices(layer, expert);
    const double bytes = d.pool.copy(layer, expert, tensors_[(size_t) layer], bias_expert, &src);
    if (bytes > 0.0) ram_->note_used(layer, expert);  // a read ahead that reached the GPU was used
    if (bytes > 0.0 && d.pool.async_copies()) {
        const int64_t key = (int64_t) layer * cfg_.n_expert + expert;
        ram_->hold(layer, expert);
        d.ram_holds.emplace_back(key, d.pool.copy_seq(key));
    }
    return bytes;
}

size_t Engine::ram_holds() const {
    size_t n = 0;
    for (const auto & d : devs_) n += d->ram_holds.size();
    return n;
}

void Engine::release_ram_holds(bool all) {
    if (!ram_) return;
    for (auto & dp : devs_) {
        Dev & d = *dp;
        if (d.ram_holds.empty()) continue;
        if (all) d.copies_done = d.pool.sync_copies();
        // the ended copies leave the list before their holds are dropped: a throw leaves no hold to drop twice
        std::vector<int64_t> ended;
        size_t kept = 0;
        for (const auto & h : d.ram_holds) {
            if (h.second <= d.copies_done) {
                ended.push_back(h.first);
            } else {
                d.ram_holds[kept++] = h;
            }
        }
        d.ram_holds.resize(kept);
        for (int64_t key : ended) ram_->unhold((int) (key / cfg_.n_expert), (int) (key % cfg_.n_expert));
    }
}

double Engine::Placement::read_s(int layer, int & slots) const {
    // the RAM tier's measured time per expert read, the disk shared by its reads: one read at a time in the
    // planner's timeline (LayerInput::reads_s)
    slots = 1;
    return engine->ram_ ? engine->ram_->read_estimate_s(layer) : 0.0;
}

bool Engine::Placement::on_disk(int layer, int expert) const {
    return engine->ram_ && !engine->ram_->ready(layer, expert);
}

double Engine::Placement::load(int layer, int expert, Kind kind) {
    Engine & en = *engine;
    Dev & d = *dev;
    if (!d.pool.assign(layer, expert)) {
        // the cache's budget is a whole number of slots: an admitted expert always finds one
        throw std::runtime_error("no free GPU slot for MoE layer " + std::to_string(layer) + " expert " +
                                 std::to_string(expert) + " although the cache admitted it (slot bookkeeping)");
    }
    const ExpertMatrices & lt = en.tensors_[(size_t) layer];
    const int bias_expert = en.controls_.bias_expert(expert, en.cfg_.n_expert);
    double bytes = 0.0;
    if (!en.ram_) {
        // a repacked matrix is copied from the file's bytes (a device kernel reads the file's layout)
        const auto & rp = en.repacked_[(size_t) layer];
        if ((rp[0] || rp[1] || rp[2]) && !en.controls_.repacked_copies) {
            const auto mats = lt.slot_matrices();
            std::array<const uint8_t *, 3> src{};
            for (int i = 0; i < 3; ++i) {
                src[(size_t) i] = !mats[(size_t) i] ? nullptr
                                  : rp[(size_t) i]  ? en.originals_->matrix(layer, i, expert)
                                                    : (const uint8_t *) mats[(size_t) i]->data +
                                                          (size_t) expert * mats[(size_t) i]->nb[2];
            }
            bytes = d.pool.copy(layer, expert, lt, bias_expert, &src);
        } else {
            bytes = d.pool.copy(layer, expert, lt, bias_expert);
        }
    } else if (d.pool.loaded((int64_t) layer * en.cfg_.n_expert + expert)) {
        return 0.0;
    } else if (en.ram_->ready(layer, expert)) {
        bytes = en.copy_from_ram(layer, expert, bias_expert);
        // a load the layer needs is a lookup of the RAM tier (a hit): its policy and counters see it with the
        // layer's CPU experts (op_plan)
        if (bytes > 0.0 && (kind == kDemand || kind == kFirstUse)) en.ram_hits_.push_back(expert);
    } else if (kind == kDemand || kind == kFirstUse) {
        // on disk: the plan op reads it with the layer's CPU experts, then copies it from RAM (op_plan); the copy
        // queue estimate counts it now, the copy counters when it is queued
        const auto & eb = en.cfg_.expert_bytes[(size_t) layer];
        bytes = (double) (eb[0] + eb[1] + eb[2]);
        for (const auto * extra : {&en.cfg_.bias_bytes, &en.cfg_.scale_bytes}) {
            if (!extra->empty()) bytes += (double) ((*extra)[(size_t) layer][0] + (*extra)[(size_t) layer][1] +
                                                    (*extra)[(size_t) layer][2]);
        }
        en.deferred_.emplace_back((int64_t) layer * en.cfg_.n_expert + expert, (int) kind);
        d.pcie_free_at = std::max(d.pcie_free_at, en.now()) + d.cost.h2d(bytes);
        d.bytes_copied += bytes;
        return bytes;
    } else {
        return 0.0;  // a prefetch or fill of an expert not in RAM: copied at its first use, after its read
    }
    if (bytes <= 0.0) return 0.0;
    d.bytes_copied += bytes;
    en.copies_[(size_t) kind] += 1;
    en.copy_bytes_[(size_t) kind] += bytes;
    // an asynchronous copy ends by the estimate; a blocking one (a device without events) has ended
    d.pcie_free_at = d.pool.async_copies() ? std::max(d.pcie_free_at, en.now()) + d.cost.h2d(bytes) : en.now();
    return bytes;
}

void Engine::launch_gpu_share(ggml_tensor * dst, LayerRun & run, const std::vector<uint8_t> & on_gpu, int64_t k,
                              int64_t T, const ggml_tensor * x, uint64_t & launches) {
    const int ml = run.ml;
    Dev & d = dev(ml);
    SlotPool & pool = d.pool;
    GpuShare & gpu_share = *d.gpu;
    const LayerInput & in = d.decider->input();
    const int E = cfg_.n_expert;
    // part per activated expert: 1 = resident and copied before this layer (launch 0), 2 = loaded now or still
    // in flight by the estimate (launch 1, which waits only for its own copies); each part makes one launch per slot
    // buffer its experts lie in
    const int n_bufs = pool.n_buffers();
    std::vector<uint8_t> part(in.size(), 0);
    uint64_t seq[2] = {0, 0};
    std::vector<int64_t> n_pairs((size_t) (2 * n_bufs), 0);  // [part][slot buffer]
    for (size_t i = 0; i < in.size(); ++i) {
        if (!on_gpu[i]) continue;
        part[i] = in.cached[i] && in.ready_s[i] <= 0.0 ? 1 : 2;
        seq[part[i] - 1] = std::max(seq[part[i] - 1], pool.copy_seq((int64_t) ml * E + in.experts[i]));
        const int b = pool.buffer_of(pool.slot_of(ml, in.experts[i]));
        n_pairs[(size_t) ((part[i] - 1) * n_bufs + b)] += in.loads[i];
    }
    const ExpertMatrices lt = controls_.gpu_share_matrices(tensors_[(size_t) ml]);
    token_row_.resize((size_t) T);
    int32_t out_row = 0;  // row of the wait op's output: the launches' pairs in launch order
    for (int li = 0; li < 2; ++li) {
        bool waited = false;
        for (int b = 0; b < n_bufs; ++b) {
            const int64_t np = n_pairs[(size_t) (li * n_bufs + b)];
            if (np == 0) continue;
            GpuShare::Launch & l = gpu_share.prepare(lt, np, li, b);
            std::fill(token_row_.begin(), token_row_.end(), -1);
            // pairs in (token, rank) order: every GPU expert gets its rows in upstream's order
            for (int64_t t = 0; t < T; ++t) {
                int32_t * cpu = plane(dst, 0, t);
                int32_t * gpu = plane(dst, 1, t);
                for (int64_t j = 0; j < k; ++j) {
                    const int32_t e = ids_[(size_t) (t * k + j)];
                    if (part[(size_t) expert_pos_[(size_t) e]] != li + 1) continue;
                    const int32_t slot = pool.slot_of(ml, e);
                    if (pool.buffer_of(slot) != b) continue;
                    if (token_row_[(size_t) t] < 0) {
                        token_row_[(size_t) t] =
                            gpu_share.add_row(l, (const float *) ((const char *) x->data + t * x->nb[2]));
                    }
                    gpu_share.add_pair(l, token_row_[(size_t) t], pool.local_slot(slot), weights_[(size_t) (t * k + j)]);
                    cpu[j] = -1;  // not computed by the CPU share (hybrimoe's ggml-cpu skips it)
                    gpu[j] = out_row++;
                }
            }
            if (!waited) pool.wait_for_copy(seq[li]);  // a part waits only for the copies of its own experts
            waited = true;
            const size_t up = gpu_share.run(l);
            run.launches.push_back(&l);
            ++launches;
            std::lock_guard<std::mutex> lock(stats_mu_);
            stats_[(size_t) ml].bytes_act_h2d += (double) up;
        }
    }
}

void Engine::op_plan(ggml_tensor * dst, LayerRun & run) {
    plan_layer(dst, run);
    const int64_t T = dst->ne[1];
    if (fused_ && T > 0 && fused_max_T_[(size_t) run.ml] >= T && fused_->prepared(run.ml)) {
        // the fused CPU share's part (counted in the CPU share's time): its pairs from plane 0 as written, a
        // decode's activations quantized
        const ggml_tensor * x = dst->src[1];
        fused_->plan(run.ml, (const int32_t *) dst->data, dst->nb[1], dst->ne[0], T, (const float *) x->data,
                     x->nb[2]);
    }
}

void Engine::op_fused(ggml_tensor * dst, LayerRun & run, int ith, int nth) {
    const ggml_tensor * x = dst->src[0];  // F32 [n_embd, 1, T]
    fused_->run(run.ml, dst, (const float *) x->data, x->nb[2], ith, nth);
}

void Engine::plan_layer(ggml_tensor * dst, LayerRun & run) {
    const double t_start = now();
    run.t_start = t_start;
    run.plan_s = 0.0;
    run.log_pos = -1;
    run.launches.clear();
    const RoutingView routing{dst->src[0], dst->ne[0]};
    const ggml_tensor * x = dst->src[1];
    const int64_t k = dst->ne[0];
    const int64_t T = dst->ne[1];
    const int ml = run.ml;
    const int E = cfg_.n_expert;
    large_ubatch_ = expert_use_prior((int) k, E, T) >= 0.5;  // a prefill ubatch: every expert likely used

    ids_.resize((size_t) (k * T));
    weights_.resize((size_t) (k * T));
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            ids_[(size_t) (t * k + j)] = (int32_t) routing.id(j, t);
            weights_[(size_t) (t * k + j)] = routing.weight(j, t);
        }
    }
    // the plan's output starts as upstream's routing, nothing on the GPU (and no pair for the other RAM buffers)
    write_all_cpu(dst, ids_);
    for (int64_t p = 2; p < dst->ne[2]; ++p) {
        for (int64_t t = 0; t < T; ++t) {
            int32_t * row = plane(dst, (int) p, t);
            for (int64_t j = 0; j < k; ++j) row[j] = -1;
        }
    }
    if (run.counters) note_plan_run(*static_cast<LayerCounters *>(run.counters), ids_.data(), k, T);
    if (T == 0) return;
    // warm-up graphs route every token to every expert: not a real ubatch, leave it to the CPU (with the RAM
    // tier: compute nothing, its output is thrown away)
    if (k != cfg_.top_k) {
        if (ram_) write_fallback(dst);
        return;
    }
    // a new ubatch starts when the MoE layers start over (the first layer the engine handles need not be 0)
    if (ml <= last_ml_) ++ubatch_;
    last_ml_ = ml;

    try {
        if (failed_) {
            write_fallback(dst);
            return;
        }
        // many ubatch sizes: start over rather than grow without bound (here, before this layer launches
        // anything; earlier layers' launches are done: their wait ops synchronised)
        Dev & d = dev(ml);
        if (d.gpu && d.gpu->n_graphs() >= 64) d.gpu->clear();
        // ---- observe, look up, pin, split, demand loads (policy/decision.h: the rules the replay shares) ----
        deferred_.clear();
        ram_hits_.clear();
        copies_.fill(0);
        copy_bytes_.fill(0.0);
        const auto & eb = cfg_.expert_bytes[(size_t) ml];
        const double expert_bytes = (double) (eb[0] + eb[1] + eb[2]);
        scores_.resize((size_t) (T * E));
        // replayed routing with the trace's scores: the policies rank by those, as on the model's own routing
        const float * replayed = replay_ ? replay_->current_scores(run.il, (int) T) : nullptr;
        for (int64_t t = 0; t < T; ++t) {
            for (int e = 0; e < E; ++e) {
                scores_[(size_t) (t * E + e)] = replayed ? replayed[t * E + e] : routing.prob(e, t);
            }
        }
        for (int32_t id : ids_) {
            if (id < 0 || id >= E) throw std::invalid_argument("routing id " + std::to_string(id) + " out of range");
        }
        DecisionRecord rec;
        DecisionRecord * rp = logging_ ? &rec : nullptr;
        const double t_split = now();
        const std::vector<uint8_t> & on_gpu =
            d.decider->split(ubatch_, ml, ids_.data(), (int) T, (int) k, scores_, expert_bytes, t_split,
                             std::max(0.0, d.pcie_free_at - t_split), d.placement, rp);
        const LayerInput & in = d.decider->input();
        const SchedulePlan & plan = d.decider->plan();
        const SchedulePlan & run_plan = d.decider->run_plan();
        uint64_t declined = 0;
        if (d.n_slots > 0) {
            for (size_t i = 0; i < in.size(); ++i) declined += plan.on_gpu[i] && !on_gpu[i] ? 1 : 0;
        }
        expert_pos_.assign((size_t) E, -1);
        for (size_t i = 0; i < in.size(); ++i) expert_pos_[(size_t) in.experts[i]] = (int32_t) i;

        // ---- launch the GPU share; its pairs leave the CPU share ----
        uint64_t n_gpu = 0, gpu_pairs = 0, launches = 0;
        for (size_t i = 0; i < in.size(); ++i) {
            n_gpu += on_gpu[i];
            gpu_pairs += on_gpu[i] ? (uint64_t) in.loads[i] : 0;
        }
        // ---- the RAM tier: the GPU loads not in RAM yet and the CPU share's experts read into RAM slots ----
        if (ram_) {
            // the reads the GPU share waits for first (demand reads run in the order issued), then the CPU's
            std::vector<int32_t> need;
            for (const auto & d : deferred_) need.push_back((int32_t) (d.first % E));
            const size_t wait_first = need.size();
            need.insert(need.end(), ram_hits_.begin(), ram_hits_.end());
            ram_hits_.clear();
            for (size_t i = 0; i < in.size(); ++i) {
                if (!on_gpu[i]) need.push_back(in.experts[i]);
            }
            // GPU copies still reading RAM slots give them back first when the layer could not fit otherwise
            release_ram_holds(false);
            int64_t unpinned = 0;
            for (int32_t e : need) unpinned += ram_->is_pinned(ml, e) ? 0 : 1;
            if (ram_->pinned() + unpinned > ram_->n_slots()) release_ram_holds(true);
            ram_->acquire(d.decider->observation(), need, now(), wait_first);
            // the GPU loads that waited for their reads, copied from RAM now that they are there
            for (const auto & d : deferred_) {
                const int32_t e = (int32_t) (d.first % E);
                const double bytes = copy_from_ram(ml, e, controls_.bias_expert(e, E));
                copies_[(size_t) d.second] += bytes > 0.0 ? 1 : 0;
                copy_bytes_[(size_t) d.second] += bytes;
            }
            if (!deferred_.empty() && !d.pool.async_copies()) d.pcie_free_at = now();  // blocking copies have ended
            deferred_.clear();
        }
        // the GPU share starts while the CPU share's experts are still being read
        if (n_gpu > 0) launch_gpu_share(dst, run, on_gpu, k, T, x, launches);

        // ---- the CPU share's ids remapped to RAM slots; read-ahead; the CPU share's reads waited for ----
        uint64_t n_late = 0;
        if (ram_) {
            const SlotPool & rp = ram_->pool();
            // two passes (run.late_pass): an expert whose read has not ended goes to the second, with all of its
            // pairs (each expert's rows then run through the same kernels as in one pass: the same numbers)
            const int n_bufs = (int) (dst->ne[2] - 1) / (run.late_pass ? 2 : 1);
            late_of_.assign((size_t) E, -1);
            for (int64_t t = 0; t < T; ++t) {
                int32_t * cpu = plane(dst, 0, t);
                for (int64_t j = 0; j < k; ++j) {
                    if (cpu[j] < 0) continue;
                    int8_t & is_late = late_of_[(size_t) cpu[j]];
                    if (is_late < 0) {
                        is_late = run.late_pass && !ram_->ready(ml, cpu[j]) ? 1 : 0;
                        n_late += (uint64_t) is_late;
                    }
                    const int32_t slot = ram_->slot_of(ml, cpu[j]);
                    const int b = rp.buffer_of(slot);
                    const int p = is_late ? 1 + n_bufs + b : (b == 0 ? 0 : 1 + b);
                    cpu[j] = -1;
                    plane(dst, p, t)[j] = rp.local_slot(slot);
                }
            }
            if (cfg_.prefetch_layers > 0) {
                if (layer_est_ < 0.0) layer_est_ = d.cost.layer((int) T) + run_plan.makespan_s;
                predictor_->predict(ml, cfg_.prefetch_layers, (int) T, (const float *) x->data, x->nb[2],
                                    run_plan.makespan_s, layer_est_, d.cost.layer((int) T), predictions_);
                // queued behind this layer's demand reads: the disk stays busy while they end
                // exclusive tiers: what the GPU holds gave up its RAM slot, and the GPU serves it; reading it back
                // into RAM ahead of use would be a wasted read
                const bool skip_gpu = cfg_.ram.exclusive && any_slots() && !large_ubatch_;
                ram_->prefetch(predictions_, std::min<int64_t>(E, T * k), now(), (int) T, (int) k,
                               skip_gpu ? &gpu_pool_of_ : nullptr);
            }
            if (!run.late_pass) ram_->wait_rest();  // else op_late waits, after the first pass
        }

        // ---- prefetch for the next layers, then fills ----
        const int L = (int) tensors_.size();
        bool ahead = false;  // another device prefetches its layers predicted from this one
        for (const auto & op : devs_) ahead = ahead || (op.get() != &d && op->decider->prefetches() && ml + 1 < L);
        cross_log_.clear();
        if (d.decider->wants_prefetch(L) || ahead) {
            if (layer_est_ < 0.0) layer_est_ = d.cost.layer((int) T) + run_plan.makespan_s;
            if (!ram_) {
                predictor_->predict(ml, cfg_.prefetch_layers, (int) T, (const float *) x->data, x->nb[2],
                                    run_plan.makespan_s, layer_est_, d.cost.layer((int) T), predictions_);
            } else {
                // the predictions the RAM tier read ahead with (above): only experts already in RAM are copied
                // ahead to the GPU (one still on disk, or being read, is copied at its first use)
                for (Prediction & p : predictions_) {
                    size_t kept = 0;
                    for (size_t i = 0; i < p.experts.size(); ++i) {
                        if (!ram_->ready(p.layer, p.experts[i])) continue;
                        p.experts[kept] = p.experts[i];
                        if (i < p.loads.size()) p.loads[kept] = p.loads[i];
                        ++kept;
                    }
                    p.experts.resize(kept);
                    if (p.loads.size() > kept) p.loads.resize(kept);
                }
            }
            if (devs_.size() == 1) {
                d.decider->prefetch(predictions_, L, d.placement, rp);
            } else {
                // each prediction goes to the device of its layer: this device's to its own rules, the next
                // device's first layers to that device's (prefetch_ahead: its own cache, copy queue and record)
                for (auto & v : preds_by_dev_) v.clear();
                preds_by_dev_.resize(devs_.size());
                for (Prediction & p : predictions_) {
                    if (p.layer >= 0 && p.layer < L) preds_by_dev_[(size_t) dev_of_[(size_t) p.layer]].push_back(p);
                }
                if (d.decider->wants_prefetch(L)) d.decider->prefetch(preds_by_dev_[(size_t) d.index], L, d.placement, rp);
                for (auto & op : devs_) {
                    Dev & o = *op;
                    if (&o == &d || preds_by_dev_[(size_t) o.index].empty() || !o.decider->prefetches()) continue;
                    DecisionRecord cross;
                    o.decider->prefetch_ahead(ubatch_, ml, (int) T, (int) k, t_split,
                                              std::max(0.0, o.pcie_free_at - t_split),
                                              preds_by_dev_[(size_t) o.index], L, o.placement,
                                              logging_ ? &cross : nullptr);
                    if (logging_) cross_log_.push_back(std::move(cross));
                }
            }
        }
        d.decider->fills(d.placement, rp);

        const double t_end = now();
        run.plan_s = t_end - t_start;
        run.cpu_at_plan_end = process_cpu_s();
        std::lock_guard<std::mutex> lock(stats_mu_);
        if (rp) {
            run.log_pos = (int64_t) log_.size();
            run.log_ubatch = ubatch_;
            log_.push_back(std::move(rec));
            for (DecisionRecord & c : cross_log_) log_.push_back(std::move(c));
            cross_log_.clear();
        }
        using K = ExpertPlacement;
        EngineLayerStats & s = stats_[(size_t) ml];
        s.runs += 1;
        s.tokens += (uint64_t) T;
        s.gpu_experts += n_gpu;
        s.cpu_experts += in.size() - n_gpu;
        s.cpu_late_experts += n_late;
        s.gpu_pairs += gpu_pairs;
        s.cpu_pairs += (uint64_t) (k * T) - gpu_pairs;
        s.gpu_runs += launches > 0 ? 1 : 0;
        s.gpu_launches += launches;
        s.demand_copies += copies_[K::kDemand];
        s.declined_loads += declined;
        s.prefetch_copies += copies_[K::kPrefetch];
        s.fill_copies += copies_[K::kFill] + copies_[K::kFirstUse];
        s.bytes_demand += copy_bytes_[K::kDemand];
        s.bytes_prefetch += copy_bytes_[K::kPrefetch];
        s.bytes_fill += copy_bytes_[K::kFill] + copy_bytes_[K::kFirstUse];
        s.plan_s += run.plan_s;
        s.predicted_s += run_plan.makespan_s;
    } catch (const std::exception & e) {
        // numbers stay right: every pair goes to the CPU (its nodes have not run yet); a launched GPU share is
        // waited for and ignored. With the RAM tier nothing is computed and the decode reports the error.
        write_fallback(dst);
        fail(std::string("MoE layer ") + std::to_string(run.il) + ": " + e.what());
    } catch (...) {
        write_fallback(dst);
        fail(std::string("MoE layer ") + std::to_string(run.il) + ": unknown error");
    }
}

void Engine::op_late(ggml_tensor * dst, LayerRun & run) {
    // dst [k, T, buffers]: the plan's second-pass planes, once their reads ended; on a failed read nothing more is
    // computed (the decode reports the error)
    const ggml_tensor * plan = dst->src[0];
    const int64_t n_bufs = dst->ne[2];
    bool ok = true;
    try {
        if (ram_) ram_->wait_rest();
    } catch (const std::exception & e) {
        ok = false;
        fail(std::string("MoE layer ") + std::to_string(run.il) + ": " + e.what());
    }
    for (int64_t b = 0; b < n_bufs; ++b) {
        for (int64_t t = 0; t < dst->ne[1]; ++t) {
            const int32_t * src = (const int32_t *) ((const char *) plan->data + t * plan->nb[1] +
                                                     (1 + n_bufs + b) * plan->nb[2]);
            int32_t * out = (int32_t *) ((char *) dst->data + t * dst->nb[1] + b * dst->nb[2]);
            for (int64_t j = 0; j < dst->ne[0]; ++j) out[j] = ok ? src[j] : -1;
        }
    }
}

void Engine::op_wait(ggml_tensor * dst, LayerRun & run) {
    const double t0 = now();
    const double cpu0 = process_cpu_s();
    if (!run.launches.empty()) {
        // dst [n_embd, k * T]: the launches' rows in launch order, as the plan numbered them
        size_t down = 0;
        float * rows = (float *) dst->data;
        Dev & d = dev(run.ml);
        for (GpuShare::Launch * l : run.launches) {
            down += d.gpu->read(*l, rows);
            rows += d.gpu->pairs(*l) * dst->ne[0];
        }
        ggml_backend_synchronize(d.pool.compute());
        d.copies_done = std::max(d.copies_done, d.pool.waited_seq());
        // the launches waited for every copy queued so far: the copy queue is empty now, whatever the estimate
        // (a bandwidth below the real one would otherwise let the estimate run ahead without bound)
        if (d.pool.all_copies_waited()) d.pcie_free_at = std::min(d.pcie_free_at, now());
        if (controls_.drop_gpu_share) std::memset(dst->data, 0, down);
        std::lock_guard<std::mutex> lock(stats_mu_);
        stats_[(size_t) run.ml].bytes_act_d2h += (double) down;
    }
    run.launches.clear();
    try {
        if (ram_) {
            if (ram_holds() > 0) {
                // the synchronised compute queue waited for every copy up to waited_seq: those holds end; the
                // others' at the ubatch's last MoE layer, or sooner when they hold an eighth of the RAM slots
                release_ram_holds(false);
                if (run.ml + 1 == (int) tensors_.size() ||
                    (int64_t) ram_holds() > std::max<int64_t>(1, ram_->n_slots() / 8)) {
                    release_ram_holds(true);
                }
            }
            ram_->release(run.ml);
            if (cfg_.ram.exclusive && any_slots() && !large_ubatch_) {
                // what the GPU holds leaves RAM; at the ubatch's last MoE layer every hold has ended: all layers
                if (run.ml + 1 == (int) tensors_.size()) {
                    for (int l = 0; l < (int) tensors_.size(); ++l) give_up_ram(l);
                } else {
                    give_up_ram(run.ml);
                }
            }
        }
        dev(run.ml).decider->release(run.ml);
    } catch (const std::exception & e) {
        fail(std::string("cache bookkeeping: ") + e.what());
    }
    const double t1 = now();
    if (layer_est_ >= 0.0) layer_est_ = 0.8 * layer_est_ + 0.2 * (t1 - run.t_start);
    std::lock_guard<std::mutex> lock(stats_mu_);
    EngineLayerStats & s = stats_[(size_t) run.ml];
    s.cpu_share_s += std::max(0.0, t0 - (run.t_start + run.plan_s));
    if (run.cpu_at_plan_end > 0.0) s.cpu_share_cpu_s += std::max(0.0, cpu0 - run.cpu_at_plan_end);
    run.cpu_at_plan_end = 0.0;
    s.wait_s += t1 - t0;
    s.layer_s += t1 - run.t_start;
    if (run.log_pos >= 0 && run.log_pos < (int64_t) log_.size()) {
        DecisionRecord & r = log_[(size_t) run.log_pos];
        if (r.layer == run.ml && r.ubatch == run.log_ubatch) r.measured_s = t1 - run.t_start;
    }
    run.log_pos = -1;
}

}  // namespace hybrimoe
