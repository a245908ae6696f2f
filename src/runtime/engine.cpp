#include "runtime/engine.h"

#include "ggml-alloc.h"
#include "runtime/moe_hook.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>

namespace hybrimoe {

namespace {

constexpr int64_t kAlign = 256;
// ggml-cpu's mul_mat_id hands an expert with this many rows or more to its tiled K-quant kernel
// (ggml/src/ggml-cpu/tiled/tiled.cpp, ggml_tiled_min_batch); below it every row is an independent vec_dot.
constexpr int64_t kTiledMinRows = 8;

int64_t pad(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

template <typename T>
const T * at2(const ggml_tensor * t, int64_t i0, int64_t i1) {
    return (const T *) ((const char *) t->data + i0 * t->nb[0] + i1 * t->nb[1]);
}

// The plan's output I32 [k, T, 2] when every pair runs on the CPU: upstream's ids (ids: [T, k] contiguous), no flags.
void write_all_cpu(ggml_tensor * dst, const std::vector<int32_t> & ids) {
    const int64_t k = dst->ne[0], T = dst->ne[1];
    for (int64_t t = 0; t < T; ++t) {
        int32_t * out_ids = (int32_t *) ((char *) dst->data + t * dst->nb[1]);
        int32_t * out_flag = (int32_t *) ((char *) dst->data + t * dst->nb[1] + dst->nb[2]);
        for (int64_t j = 0; j < k; ++j) {
            out_ids[j] = ids[(size_t) (t * k + j)];
            out_flag[j] = 0;
        }
    }
}

Engine::LayerRun * run_of(void * ud) { return static_cast<Engine::LayerRun *>(ud); }

void plan_trampoline(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith == 0) run_of(ud)->engine->op_plan(dst, *run_of(ud));
}

void wait_trampoline(ggml_tensor * dst, int ith, int nth, void * ud) {
    (void) nth;
    if (ith == 0) run_of(ud)->engine->op_wait(dst, *run_of(ud));
}

// dst[:, t] = sum over slots j < k_sum, in upstream's order, of (flag[j, t] ? gpu : cpu)[:, j, t]
void combine_op(ggml_tensor * dst, int ith, int nth, void * ud) {
    const int64_t k_sum = (int64_t) (intptr_t) ud;
    const ggml_tensor * cpu = dst->src[0];
    const ggml_tensor * gpu = dst->src[1];
    const ggml_tensor * plan = dst->src[2];
    const int64_t n_embd = dst->ne[0];
    const int64_t T = dst->ne[1];
    for (int64_t t = ith; t < T; t += nth) {
        float * out = (float *) ((char *) dst->data + t * dst->nb[1]);
        for (int64_t j = 0; j < k_sum; ++j) {
            const int32_t on_gpu = *(const int32_t *) ((const char *) plan->data + j * plan->nb[0] + t * plan->nb[1] +
                                                       plan->nb[2]);
            const ggml_tensor * src = on_gpu ? gpu : cpu;
            const float * v = (const float *) ((const char *) src->data + j * src->nb[1] + t * src->nb[2]);
            if (j == 0) {
                std::memcpy(out, v, (size_t) n_embd * sizeof(float));
            } else {
                for (int64_t i = 0; i < n_embd; ++i) out[i] = out[i] + v[i];
            }
        }
    }
}

}  // namespace

// One fixed-shape GPU graph: the experts of one layer type signature for one ubatch size.
struct Engine::GpuGraph {
    ggml_context * ctx = nullptr;
    ggml_cgraph * gf = nullptr;
    ggml_gallocr_t galloc = nullptr;
    ggml_tensor * x = nullptr;    // F32 [n_embd, T]
    ggml_tensor * ids = nullptr;  // I32 [k, T] slot per (token, slot)
    ggml_tensor * w = nullptr;    // F32 [1, k, T]
    ggml_tensor * out = nullptr;  // F32 [n_embd, k, T]
    std::vector<int32_t> host_ids;  // each launch has its own ids (its experts' slots, the null slot elsewhere)
    ~GpuGraph() {
        if (galloc) ggml_gallocr_free(galloc);
        if (ctx) ggml_free(ctx);
    }
};

std::array<int64_t, 3> Engine::region_strides(const std::vector<std::array<int64_t, 3>> & eb,
                                              const std::vector<std::array<int32_t, 3>> & et) {
    if (eb.size() != et.size()) throw std::invalid_argument("engine: one (gate, up, down) type triple per MoE layer");
    std::array<int64_t, 3> mx{0, 0, 0}, unit{16, 16, 16};
    for (size_t l = 0; l < eb.size(); ++l) {
        for (int i = 0; i < 3; ++i) {
            if (et[l][(size_t) i] < 0 || et[l][(size_t) i] >= GGML_TYPE_COUNT) {
                throw std::invalid_argument("engine: unknown ggml type " + std::to_string(et[l][(size_t) i]));
            }
            const int64_t ts = (int64_t) ggml_type_size((ggml_type) et[l][(size_t) i]);
            mx[(size_t) i] = std::max(mx[(size_t) i], eb[l][(size_t) i]);
            unit[(size_t) i] = std::lcm(unit[(size_t) i], ts);
        }
    }
    std::array<int64_t, 3> st{};
    for (int i = 0; i < 3; ++i) st[(size_t) i] = (mx[(size_t) i] + unit[(size_t) i] - 1) / unit[(size_t) i] * unit[(size_t) i];
    return st;
}

int64_t Engine::slot_bytes_for(const std::vector<std::array<int64_t, 3>> & eb,
                               const std::vector<std::array<int32_t, 3>> & et) {
    const auto st = region_strides(eb, et);
    return st[0] + st[1] + st[2];
}

Engine::Engine(EngineConfig cfg, std::shared_ptr<ExpertCache> cache, std::shared_ptr<SchedulePolicy> scheduler,
               std::shared_ptr<PrefetchPolicy> prefetcher)
    : cfg_(std::move(cfg)), cache_(std::move(cache)), scheduler_(std::move(scheduler)),
      prefetcher_(std::move(prefetcher)) {
    const int L = (int) cfg_.moe_layers.size();
    if (cfg_.n_layer < 1 || cfg_.n_expert < 1 || cfg_.top_k < 1 || cfg_.n_embd < 1 || L < 1) {
        throw std::invalid_argument("engine: model facts must be positive (layers, experts, top-k, n_embd, MoE layers)");
    }
    if ((int) cfg_.expert_bytes.size() != L) throw std::invalid_argument("engine: one expert size per MoE layer");
    if (!cache_ || !scheduler_ || !prefetcher_) throw std::invalid_argument("engine: cache and policies are required");
    if (cache_->n_layers() != L || cache_->n_experts() != cfg_.n_expert) {
        throw std::invalid_argument("engine: the cache has " + std::to_string(cache_->n_layers()) + " layers x " +
                                    std::to_string(cache_->n_experts()) + " experts, the model " +
                                    std::to_string(L) + " x " + std::to_string(cfg_.n_expert));
    }
    if (cfg_.n_slots < 0) throw std::invalid_argument("engine: negative slot count");
    if (cfg_.prefetch_layers < 0) throw std::invalid_argument("engine: prefetch_layers must be >= 0");
    cfg_.cost.validate();
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
    cfg_.routers.resize((size_t) L);
    cfg_.router_bias.resize((size_t) L);
    for (int i = 0; i < L; ++i) {
        const auto & r = cfg_.routers[(size_t) i];
        if (!r.empty() && r.size() != (size_t) cfg_.n_expert * cfg_.n_embd) {
            throw std::invalid_argument("engine: router of MoE layer " + std::to_string(i) + " must be [n_expert, n_embd]");
        }
        const auto & b = cfg_.router_bias[(size_t) i];
        if (!b.empty() && b.size() != (size_t) cfg_.n_expert) {
            throw std::invalid_argument("engine: router bias of MoE layer " + std::to_string(i) + " must be [n_expert]");
        }
    }

    strides_ = region_strides(cfg_.expert_bytes, cfg_.expert_types);
    slot_bytes_ = strides_[0] + strides_[1] + strides_[2];
    {
        // regions: all gate matrices, then all up, then all down; each region starts 256-aligned
        const int64_t S = cfg_.n_slots + 1;
        bases_ = {0, pad(S * strides_[0]), pad(S * strides_[0]) + pad(S * strides_[1])};
    }
    key_slot_.assign((size_t) L * cfg_.n_expert, -1);
    key_loaded_.assign((size_t) L * cfg_.n_expert, 0);
    key_copy_seq_.assign((size_t) L * cfg_.n_expert, 0);
    cache_->set_record_evicted(true);
    cache_->take_evicted();
    placement_.engine = this;
    DeciderConfig dc;
    dc.has_slots = cfg_.n_slots > 0;
    dc.prefetch_layers = cfg_.prefetch_layers;
    dc.fill_on_miss = cfg_.fill_on_miss;
    decider_.reset(new LayerDecider(cache_, scheduler_, prefetcher_, cfg_.cost, dc));

    if (cfg_.n_slots == 0) return;
    if (!cfg_.device) throw std::invalid_argument("engine: a device is required for a non-empty expert cache");
    const std::string dev_name = ggml_backend_dev_name(cfg_.device);
    compute_ = ggml_backend_dev_init(cfg_.device, nullptr);
    copy_ = ggml_backend_dev_init(cfg_.device, nullptr);
    if (!compute_ || !copy_) {
        release();
        throw std::runtime_error("engine: cannot initialise device " + dev_name);
    }
    // without events (a device that has none) copies are synchronous
    for (int i = 0; i < kEvents; ++i) {
        ggml_backend_event_t ev = ggml_backend_event_new(cfg_.device);
        if (!ev) break;
        events_.push_back(ev);
    }
    if ((int) events_.size() < kEvents) {
        for (auto * ev : events_) ggml_backend_event_free(ev);
        events_.clear();
    }

    const int64_t total = bases_[2] + pad((cfg_.n_slots + 1) * strides_[2]);
    ggml_init_params ip = {ggml_tensor_overhead() * 2, nullptr, true};
    pool_ctx_ = ggml_init(ip);
    pool_ = ggml_new_tensor_1d(pool_ctx_, GGML_TYPE_I8, total);
    ggml_set_name(pool_, "hybrimoe_slots");
    pool_buf_ = ggml_backend_alloc_ctx_tensors(pool_ctx_, compute_);
    if (!pool_buf_) {
        release();
        throw std::runtime_error("engine: cannot allocate " + std::to_string(total) + " bytes of expert slots on " +
                                 dev_name);
    }
    // the null slot (index n_slots) must hold zeros: pairs computed on the CPU point there
    for (int i = 0; i < 3; ++i) {
        std::vector<uint8_t> zeros((size_t) strides_[(size_t) i], 0);
        ggml_backend_tensor_set(pool_, zeros.data(), (size_t) (bases_[(size_t) i] + cfg_.n_slots * strides_[(size_t) i]),
                                zeros.size());
    }
    slot_key_.assign((size_t) cfg_.n_slots, -1);
    for (int64_t s = cfg_.n_slots - 1; s >= 0; --s) free_slots_.push_back((int32_t) s);
    // experts already resident in the cache (an initial fill) get slots now and are copied at first use
    for (int64_t key : cache_->resident_keys()) {
        if (!free_slots_.empty()) {
            const int32_t s = free_slots_.back();
            free_slots_.pop_back();
            slot_key_[(size_t) s] = (int32_t) key;
            key_slot_[(size_t) key] = s;
        }
    }
}

Engine::~Engine() { release(); }

void Engine::release() {
    if (compute_) ggml_backend_synchronize(compute_);
    if (copy_) ggml_backend_synchronize(copy_);
    graphs_.clear();
    for (auto * ev : events_) ggml_backend_event_free(ev);
    events_.clear();
    if (pool_buf_) ggml_backend_buffer_free(pool_buf_);
    if (pool_ctx_) ggml_free(pool_ctx_);
    if (copy_) ggml_backend_free(copy_);
    if (compute_) ggml_backend_free(compute_);
    pool_buf_ = nullptr;
    pool_ctx_ = nullptr;
    pool_ = nullptr;
    copy_ = nullptr;
    compute_ = nullptr;
    if (cfg_.n_slots > 0) {
        cfg_.n_slots = 0;  // from now on every layer runs on the CPU
        if (decider_) decider_->set_has_slots(false);
        std::fill(key_slot_.begin(), key_slot_.end(), -1);
        slot_key_.clear();
        free_slots_.clear();
    }
}

int Engine::slot_of(int layer, int expert) const {
    if (layer < 0 || layer >= (int) tensors_.size() || expert < 0 || expert >= cfg_.n_expert) return -1;
    return key_slot_[(size_t) layer * cfg_.n_expert + expert];
}

int Engine::pinned_count() const {
    int n = 0;
    for (int l = 0; l < cache_->n_layers(); ++l) {
        for (int e = 0; e < cfg_.n_expert; ++e) n += cache_->pinned(l, e) ? 1 : 0;
    }
    return n;
}

int Engine::slots_in_use() const {
    int n = 0;
    for (int32_t k : slot_key_) n += k >= 0 ? 1 : 0;
    return n;
}

std::vector<EngineLayerStats> Engine::layer_stats() const {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return stats_;
}

void Engine::reset_stats() {
    std::lock_guard<std::mutex> lock(stats_mu_);
    for (auto & s : stats_) s = EngineLayerStats{};
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

ggml_tensor * Engine::build(const llama_moe_hook_args & a, void * counters) {
    const int ml = moe_index(a.il);
    if (ml < 0) return nullptr;
    const int64_t per_expert[3] = {(int64_t) a.gate_exps->nb[2], (int64_t) a.up_exps->nb[2],
                                   (int64_t) a.down_exps->nb[2]};
    const auto & want = cfg_.expert_bytes[(size_t) ml];
    const auto & want_t = cfg_.expert_types[(size_t) ml];
    if (a.n_expert != cfg_.n_expert || a.cur->ne[0] != cfg_.n_embd || per_expert[0] != want[0] ||
        per_expert[1] != want[1] || per_expert[2] != want[2] || (int32_t) a.gate_exps->type != want_t[0] ||
        (int32_t) a.up_exps->type != want_t[1] || (int32_t) a.down_exps->type != want_t[2]) {
        return nullptr;  // the engine was told other facts than this layer has: stay on upstream's path
    }
    for (ggml_tensor * t : {a.gate_exps, a.up_exps, a.down_exps}) {
        // the engine copies experts from host memory in the file's layout: no device or repacked buffers
        if (!t->buffer || !ggml_backend_buffer_is_host(t->buffer) || t->extra != nullptr) return nullptr;
    }
    tensors_[(size_t) ml] = {a.gate_exps, a.up_exps, a.down_exps};
    LayerRun & run = *runs_[(size_t) ml];
    run.counters = counters;

    ggml_context * ctx = a.ctx;
    const int64_t n_embd = a.cur->ne[0];
    const int64_t T = a.cur->ne[1];
    const int64_t k = a.n_expert_used;

    // the hidden state goes in as the same reshaped view the CPU mul_mat_id nodes read, so the scheduler copies
    // it to the host once (a second view would be a second device-to-host transfer)
    ggml_tensor * x = ggml_reshape_3d(ctx, a.cur, n_embd, 1, T);
    ggml_tensor * psrc[4] = {a.selected_experts, a.weights, a.probs, x};
    ggml_tensor * plan = ggml_custom_4d(ctx, GGML_TYPE_I32, k, T, 2, 1, psrc, 4, plan_trampoline, 1, &run);
    ggml_format_name(plan, "hybrimoe_plan-%d", a.il);
    ggml_tensor * ids = ggml_view_2d(ctx, plan, k, T, plan->nb[1], 0);

    ggml_tensor * up = ggml_mul_mat_id(ctx, a.up_exps, x, ids);
    ggml_tensor * gate = ggml_mul_mat_id(ctx, a.gate_exps, x, ids);
    ggml_tensor * h = ggml_swiglu_split(ctx, gate, up);
    ggml_tensor * experts = ggml_mul_mat_id(ctx, a.down_exps, h, ids);
    experts = ggml_mul(ctx, experts, a.weights);  // [n_embd, k, T]

    ggml_tensor * wsrc[2] = {plan, experts};  // experts: only to run after the CPU share
    ggml_tensor * gpu = ggml_custom_4d(ctx, GGML_TYPE_F32, n_embd, k, T, 1, wsrc, 2, wait_trampoline, 1, &run);
    ggml_format_name(gpu, "hybrimoe_wait-%d", a.il);

    ggml_tensor * csrc[3] = {experts, gpu, plan};
    ggml_tensor * out = ggml_custom_4d(ctx, GGML_TYPE_F32, n_embd, T, 1, 1, csrc, 3, combine_op, GGML_N_TASKS_MAX,
                                       (void *) (intptr_t) a.n_expert_used_sum);
    ggml_format_name(out, "hybrimoe_combine-%d", a.il);
    return out;
}

Engine::GpuGraph & Engine::gpu_graph(int ml, int64_t k, int64_t T, int part) {
    const LayerTensors & lt = tensors_[(size_t) ml];
    const auto key = std::make_tuple((int) lt.gate->type, (int) lt.up->type, (int) lt.down->type, k, T, part);
    auto it = graphs_.find(key);
    if (it != graphs_.end()) return *it->second;

    std::unique_ptr<GpuGraph> g(new GpuGraph());
    ggml_init_params ip = {ggml_tensor_overhead() * 32 + ggml_graph_overhead(), nullptr, true};
    g->ctx = ggml_init(ip);
    ggml_context * ctx = g->ctx;
    const int64_t n_embd = cfg_.n_embd;
    const int64_t S = cfg_.n_slots + 1;
    auto pool_view = [&](const ggml_tensor * like, int which) {
        ggml_tensor * v = ggml_new_tensor_3d(ctx, like->type, like->ne[0], like->ne[1], S);
        v->nb[2] = (size_t) strides_[(size_t) which];
        v->nb[3] = v->nb[2] * (size_t) S;
        v->data = (char *) pool_->data + bases_[(size_t) which];
        v->buffer = pool_buf_;
        return v;
    };
    ggml_tensor * gate_v = pool_view(lt.gate, 0);
    ggml_tensor * up_v = pool_view(lt.up, 1);
    ggml_tensor * down_v = pool_view(lt.down, 2);
    g->x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, T);
    g->ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, T);
    g->w = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, k, T);
    for (ggml_tensor * t : {g->x, g->ids, g->w}) ggml_set_input(t);
    ggml_tensor * xr = ggml_reshape_3d(ctx, g->x, n_embd, 1, T);
    ggml_tensor * up = ggml_mul_mat_id(ctx, up_v, xr, g->ids);
    ggml_tensor * gate = ggml_mul_mat_id(ctx, gate_v, xr, g->ids);
    ggml_tensor * h = ggml_swiglu_split(ctx, gate, up);
    ggml_tensor * d = ggml_mul_mat_id(ctx, down_v, h, g->ids);
    g->out = ggml_mul(ctx, d, g->w);
    ggml_set_output(g->out);
    g->gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(g->gf, g->out);
    g->galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(compute_));
    if (!ggml_gallocr_alloc_graph(g->galloc, g->gf)) {
        throw std::runtime_error("engine: cannot allocate the GPU share's work buffers on " +
                                 std::string(ggml_backend_dev_name(cfg_.device)));
    }
    g->host_ids.resize((size_t) (k * T));
    GpuGraph & ref = *g;
    graphs_[key] = std::move(g);
    return ref;
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

void Engine::Placement::evicted(const std::vector<int64_t> & keys) {
    Engine & en = *engine;
    for (int64_t key : keys) {
        const int32_t s = en.key_slot_[(size_t) key];
        if (s >= 0) {
            en.key_slot_[(size_t) key] = -1;
            en.key_loaded_[(size_t) key] = 0;
            en.slot_key_[(size_t) s] = -1;
            en.free_slots_.push_back(s);
        }
    }
}

bool Engine::Placement::holds(int layer) const {
    return layer >= 0 && layer < (int) engine->tensors_.size() && engine->tensors_[(size_t) layer].gate != nullptr;
}

double Engine::Placement::load(int layer, int expert, Kind kind) {
    Engine & en = *engine;
    if (!en.assign_slot(layer, expert)) {
        // the cache's budget is a whole number of slots: an admitted expert always finds one
        throw std::runtime_error("no free GPU slot for MoE layer " + std::to_string(layer) + " expert " +
                                 std::to_string(expert) + " although the cache admitted it (slot bookkeeping)");
    }
    const size_t key = (size_t) layer * en.cfg_.n_expert + expert;
    if (en.key_loaded_[key]) return 0.0;
    const double bytes = en.copy_expert(layer, expert);
    en.copies_[(size_t) kind] += 1;
    en.copy_bytes_[(size_t) kind] += bytes;
    return bytes;
}

bool Engine::assign_slot(int ml, int e) {
    const size_t key = (size_t) ml * cfg_.n_expert + e;
    if (key_slot_[key] >= 0) return true;
    if (free_slots_.empty()) return false;
    const int32_t s = free_slots_.back();
    free_slots_.pop_back();
    slot_key_[(size_t) s] = (int32_t) key;
    key_slot_[key] = s;
    key_loaded_[key] = 0;
    return true;
}

// Queues the copy of (ml, e)'s weights into its slot on the copy queue; returns the bytes copied.
double Engine::copy_expert(int ml, int e) {
    const size_t key = (size_t) ml * cfg_.n_expert + e;
    const int32_t s = key_slot_[key];
    if (s < 0 || key_loaded_[key]) return 0.0;
    const LayerTensors & lt = tensors_[(size_t) ml];
    const ggml_tensor * parts[3] = {lt.gate, lt.up, lt.down};
    double bytes = 0;
    for (int i = 0; i < 3; ++i) {
        const size_t n = parts[i]->nb[2];
        const char * src = (const char *) parts[i]->data + (size_t) e * n;
        const size_t off = (size_t) (bases_[(size_t) i] + (int64_t) s * strides_[(size_t) i]);
        if (!events_.empty()) {
            ggml_backend_tensor_set_async(copy_, pool_, src, off, n);
        } else {
            ggml_backend_tensor_set(pool_, src, off, n);
        }
        bytes += (double) n;
    }
    key_loaded_[key] = 1;
    if (!events_.empty()) {
        ++copy_seq_;
        ggml_backend_event_record(events_[(size_t) (copy_seq_ % kEvents)], copy_);
        key_copy_seq_[key] = copy_seq_;
    }
    const double t = now();
    link_free_ = std::max(link_free_, t) + cfg_.cost.h2d(bytes);
    return bytes;
}

void Engine::wait_for_copy(uint64_t seq) {
    if (seq == 0 || events_.empty()) return;
    // a ring slot holds its copy or a later one of the same in-order queue: waiting on it covers seq
    // (the oldest record still in the ring that is not older than seq: waits no longer than needed)
    const uint64_t oldest = copy_seq_ >= (uint64_t) kEvents ? copy_seq_ - kEvents + 1 : 1;
    ggml_backend_event_wait(compute_, events_[(size_t) (std::max(seq, oldest) % kEvents)]);
}

// Predicted routing of the MoE layers after `ml`: their routers applied to this layer's hidden state
// (HybriMoE §IV.C). At most 8 tokens of the ubatch are scored; loads are scaled to the ubatch.
void Engine::predict(int ml, int T, const float * cur, size_t row_stride, double makespan_s, double layer_est,
                     std::vector<Prediction> & out) {
    const int L = (int) tensors_.size();
    const int E = cfg_.n_expert, K = cfg_.top_k, D = cfg_.n_embd;
    const int depth = std::min(cfg_.prefetch_layers, L - 1 - ml);
    out.clear();
    const int n_sample = std::min(T, 8);
    logits_.resize((size_t) E);
    std::vector<int32_t> order((size_t) E);
    std::vector<int32_t> counts((size_t) E);
    for (int d = 1; d <= depth; ++d) {
        const int j = ml + d;
        const auto & W = cfg_.routers[(size_t) j];
        if (W.empty()) continue;
        const auto & bias = cfg_.router_bias[(size_t) j];
        std::fill(counts.begin(), counts.end(), 0);
        for (int s = 0; s < n_sample; ++s) {
            const int t = n_sample == T ? s : (int) ((int64_t) s * T / n_sample);
            const float * x = (const float *) ((const char *) cur + (size_t) t * row_stride);
            for (int e = 0; e < E; ++e) {
                const float * w = W.data() + (size_t) e * D;
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // independent partial sums: the compiler vectorises
                int i = 0;
                for (; i + 8 <= D; i += 8) {
                    for (int u = 0; u < 8; ++u) acc[u] += w[i + u] * x[i + u];
                }
                for (; i < D; ++i) acc[0] += w[i] * x[i];
                float v = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
                if (cfg_.sigmoid_gating) v = 1.0f / (1.0f + std::exp(-v));
                if (!bias.empty()) v += bias[(size_t) e];
                logits_[(size_t) e] = v;  // softmax is monotonic: ranking by logits is enough
            }
            std::iota(order.begin(), order.end(), 0);
            std::partial_sort(order.begin(), order.begin() + std::min(K, E), order.end(),
                              [&](int32_t a, int32_t b) { return logits_[(size_t) a] > logits_[(size_t) b] ||
                                                                 (logits_[(size_t) a] == logits_[(size_t) b] && a < b); });
            for (int i = 0; i < std::min(K, E); ++i) counts[(size_t) order[(size_t) i]] += 1;
        }
        Prediction p;
        p.layer = j;
        p.distance = d;
        p.confidence = cfg_.confidence.empty() ? 1.0
                       : cfg_.confidence[(size_t) std::min<int>(d, (int) cfg_.confidence.size()) - 1];
        p.expert_bytes = (double) (cfg_.expert_bytes[(size_t) j][0] + cfg_.expert_bytes[(size_t) j][1] +
                                   cfg_.expert_bytes[(size_t) j][2]);
        p.start_s = makespan_s + (double(d) - 1.0) * layer_est + cfg_.cost.layer(T);
        for (int e = 0; e < E; ++e) {
            if (counts[(size_t) e] == 0) continue;
            p.experts.push_back(e);
            const int64_t load = ((int64_t) counts[(size_t) e] * T + n_sample - 1) / n_sample;
            p.loads.push_back((int32_t) std::max<int64_t>(1, std::min<int64_t>(load, T)));
        }
        out.push_back(std::move(p));
    }
}

void Engine::op_plan(ggml_tensor * dst, LayerRun & run) {
    const double t_start = now();
    run.t_start = t_start;
    run.gpu_launched = false;
    run.graph[0] = run.graph[1] = nullptr;
    const ggml_tensor * ids_t = dst->src[0];
    const ggml_tensor * w_t = dst->src[1];
    const ggml_tensor * probs_t = dst->src[2];
    const ggml_tensor * cur_t = dst->src[3];
    const int64_t k = ids_t->ne[0];
    const int64_t T = ids_t->ne[1];
    const int ml = run.ml;
    const int E = cfg_.n_expert;

    // contiguous ids; the plan's output starts as upstream's routing, nothing on the GPU
    ids_.resize((size_t) (k * T));
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < k; ++j) ids_[(size_t) (t * k + j)] = *at2<int32_t>(ids_t, j, t);
    }
    write_all_cpu(dst, ids_);
    if (run.counters) note_plan_run(*static_cast<LayerCounters *>(run.counters), ids_.data(), k, T);
    if (T == 0) return;
    // warm-up graphs route every token to every expert: not a real ubatch, leave it to the CPU
    if (k != cfg_.top_k) return;
    // a new ubatch starts when the MoE layers start over (the first layer the engine handles need not be 0)
    if (ml <= last_ml_) ++ubatch_;
    last_ml_ = ml;

    try {
        if (failed_) return;
        // many ubatch sizes: start over rather than grow without bound (here, before this layer launches
        // anything; earlier layers' graphs are done: their wait ops synchronised)
        if (graphs_.size() >= 64) graphs_.clear();
        // ---- observe, look up, pin, split, demand loads (policy/decision.h: the rules the replay shares) ----
        copies_.fill(0);
        copy_bytes_.fill(0.0);
        const auto & eb = cfg_.expert_bytes[(size_t) ml];
        const double expert_bytes = (double) (eb[0] + eb[1] + eb[2]);
        scores_.resize((size_t) (T * E));
        for (int64_t t = 0; t < T; ++t) {
            for (int e = 0; e < E; ++e) scores_[(size_t) (t * E + e)] = *at2<float>(probs_t, e, t);
        }
        DecisionRecord rec;
        DecisionRecord * rp = logging_ ? &rec : nullptr;
        const double t_split = now();
        const std::vector<uint8_t> & on_gpu =
            decider_->split(ubatch_, ml, ids_.data(), (int) T, (int) k, scores_, expert_bytes, t_split,
                            std::max(0.0, link_free_ - t_split), placement_, rp);
        const LayerInput & in = decider_->input();
        const SchedulePlan & plan = decider_->plan();
        uint64_t declined = 0;
        if (cfg_.n_slots > 0) {
            for (size_t i = 0; i < in.size(); ++i) declined += plan.on_gpu[i] && !on_gpu[i] ? 1 : 0;
        }
        expert_pos_.assign((size_t) E, -1);
        for (size_t i = 0; i < in.size(); ++i) expert_pos_[(size_t) in.experts[i]] = (int32_t) i;

        // ---- rewrite the CPU ids; launch the GPU share ----
        uint64_t n_gpu = 0, launches = 0;
        for (uint8_t g : on_gpu) n_gpu += g;
        if (n_gpu > 0) {
            // part per activated expert: 1 = resident before this layer (launch 0), 2 = loaded now (launch 1)
            std::vector<uint8_t> part(in.size(), 0);
            uint64_t seq[2] = {0, 0};
            for (size_t i = 0; i < in.size(); ++i) {
                if (!on_gpu[i]) continue;
                // a resident expert whose copy is still in flight (estimate) goes with this layer's loads: the
                // first launch does not wait for it
                part[i] = in.cached[i] && in.ready_s[i] <= 0.0 ? 1 : 2;
                const size_t key = (size_t) ml * E + in.experts[i];
                seq[part[i] - 1] = std::max(seq[part[i] - 1], key_copy_seq_[key]);
            }
            // CPU row counts per expert as upstream has them
            std::vector<int64_t> rows((size_t) E, 0), added((size_t) E, 0);
            int32_t dummy = -1;
            for (size_t i = 0; i < in.size(); ++i) {
                if (on_gpu[i]) {
                    if (dummy < 0) dummy = in.experts[i];
                } else {
                    rows[(size_t) in.experts[i]] = in.loads[i];
                }
            }
            const int32_t null_slot = (int32_t) cfg_.n_slots;
            run.pair_part.assign((size_t) (k * T), 0);
            for (int64_t t = 0; t < T; ++t) {
                int32_t * out_ids = (int32_t *) ((char *) dst->data + t * dst->nb[1]);
                int32_t * out_flag = (int32_t *) ((char *) dst->data + t * dst->nb[1] + dst->nb[2]);
                for (int64_t j = 0; j < k; ++j) {
                    const int32_t e = ids_[(size_t) (t * k + j)];
                    const uint8_t p = part[(size_t) expert_pos_[(size_t) e]];
                    run.pair_part[(size_t) (t * k + j)] = p;
                    if (!p) continue;
                    out_flag[j] = 1;
                    // the CPU computes something for this pair and the result is discarded: reuse an expert of
                    // this token that stays on ggml's per-row kernel (fewer rows than the tiled threshold before
                    // and after), else the dummy (an expert the CPU does not compute otherwise)
                    int32_t target = dummy;
                    for (int64_t jj = 0; jj < k; ++jj) {
                        const int32_t c = ids_[(size_t) (t * k + jj)];
                        if (rows[(size_t) c] > 0 && rows[(size_t) c] + added[(size_t) c] + 1 < kTiledMinRows) {
                            target = c;
                            break;
                        }
                    }
                    if (target != dummy) added[(size_t) target] += 1;
                    out_ids[j] = target;
                }
            }
            // hidden state and routing weights, staged once for both launches (the CPU split's buffers may be
            // reused by later nodes before an asynchronous copy has read them)
            stage_x_.resize((size_t) (T * cfg_.n_embd));
            stage_w_.resize((size_t) (T * k));
            for (int64_t t = 0; t < T; ++t) {
                const float * row = (const float *) ((const char *) cur_t->data + t * cur_t->nb[2]);
                std::memcpy(stage_x_.data() + t * cfg_.n_embd, row, sizeof(float) * (size_t) cfg_.n_embd);
                for (int64_t j = 0; j < k; ++j) {
                    stage_w_[(size_t) (t * k + j)] =
                        *(const float *) ((const char *) w_t->data + j * w_t->nb[1] + t * w_t->nb[2]);
                }
            }
            for (int launch = 0; launch < 2; ++launch) {
                bool any = false;
                for (uint8_t p : part) any = any || p == launch + 1;
                if (!any) continue;
                GpuGraph & g = gpu_graph(ml, k, T, launch);
                for (size_t pi = 0; pi < run.pair_part.size(); ++pi) {
                    g.host_ids[pi] = run.pair_part[pi] == launch + 1 ? key_slot_[(size_t) ml * E + ids_[pi]] : null_slot;
                }
                wait_for_copy(seq[launch]);  // a launch waits only for the copies of its own experts
                ggml_backend_tensor_set_async(compute_, g.x, stage_x_.data(), 0, ggml_nbytes(g.x));
                ggml_backend_tensor_set_async(compute_, g.ids, g.host_ids.data(), 0, ggml_nbytes(g.ids));
                ggml_backend_tensor_set_async(compute_, g.w, stage_w_.data(), 0, ggml_nbytes(g.w));
                if (ggml_backend_graph_compute_async(compute_, g.gf) != GGML_STATUS_SUCCESS) {
                    throw std::runtime_error("the GPU share of layer " + std::to_string(run.il) + " failed on " +
                                             ggml_backend_dev_name(cfg_.device));
                }
                run.gpu_launched = true;
                run.graph[launch] = &g;
                ++launches;
            }
        }

        // ---- prefetch for the next layers, then fills ----
        if (decider_->wants_prefetch((int) tensors_.size())) {
            if (layer_est_ < 0.0) layer_est_ = cfg_.cost.layer((int) T) + plan.makespan_s;
            predict(ml, (int) T, (const float *) cur_t->data, cur_t->nb[2], plan.makespan_s, layer_est_, predictions_);
            decider_->prefetch(std::move(predictions_), (int) tensors_.size(), placement_, rp);
        }
        decider_->fills(placement_, rp);

        const double t_end = now();
        run.plan_s = t_end - t_start;
        std::lock_guard<std::mutex> lock(stats_mu_);
        if (rp) log_.push_back(std::move(rec));
        using K = ExpertPlacement;
        EngineLayerStats & s = stats_[(size_t) ml];
        s.runs += 1;
        s.tokens += (uint64_t) T;
        s.gpu_experts += n_gpu;
        s.gpu_runs += launches > 0 ? 1 : 0;
        s.gpu_launches += launches;
        s.cpu_experts += in.size() - n_gpu;
        s.demand_copies += copies_[K::kDemand];
        s.declined_loads += declined;
        s.prefetch_copies += copies_[K::kPrefetch];
        s.fill_copies += copies_[K::kFill] + copies_[K::kFirstUse];
        s.bytes_demand += copy_bytes_[K::kDemand];
        s.bytes_prefetch += copy_bytes_[K::kPrefetch];
        s.bytes_fill += copy_bytes_[K::kFill] + copy_bytes_[K::kFirstUse];
        s.plan_s += run.plan_s;
        s.predicted_s += plan.makespan_s;
    } catch (const std::exception & e) {
        // numbers stay right: every pair goes to the CPU (its nodes have not run yet); a launched GPU share is waited for and ignored
        write_all_cpu(dst, ids_);
        run.pair_part.clear();
        fail(std::string("MoE layer ") + std::to_string(run.il) + ": " + e.what());
    } catch (...) {
        fail(std::string("MoE layer ") + std::to_string(run.il) + ": unknown error");
    }
}

void Engine::op_wait(ggml_tensor * dst, LayerRun & run) {
    const double t0 = now();
    if (run.gpu_launched) {
        ggml_backend_synchronize(compute_);
        const int64_t n_embd = dst->ne[0];
        const size_t row = sizeof(float) * (size_t) n_embd;
        if (run.graph[0] && !run.graph[1]) {
            ggml_backend_tensor_get(run.graph[0]->out, dst->data, 0, ggml_nbytes(run.graph[0]->out));
        } else if (run.graph[1] && !run.graph[0]) {
            ggml_backend_tensor_get(run.graph[1]->out, dst->data, 0, ggml_nbytes(run.graph[1]->out));
        } else {
            // both launches: each pair's row comes from the launch that computed it (dst is [n_embd, k, T])
            ggml_backend_tensor_get(run.graph[0]->out, dst->data, 0, ggml_nbytes(run.graph[0]->out));
            scratch_.resize((size_t) ggml_nelements(run.graph[1]->out));
            ggml_backend_tensor_get(run.graph[1]->out, scratch_.data(), 0, ggml_nbytes(run.graph[1]->out));
            for (size_t pi = 0; pi < run.pair_part.size(); ++pi) {
                if (run.pair_part[pi] == 2) {
                    std::memcpy((char *) dst->data + pi * row, scratch_.data() + pi * (size_t) n_embd, row);
                }
            }
        }
        if (drop_gpu_) std::memset(dst->data, 0, ggml_nbytes(dst));
    }
    run.gpu_launched = false;
    run.graph[0] = run.graph[1] = nullptr;
    try {
        decider_->release(run.ml);
    } catch (const std::exception & e) {
        fail(std::string("cache bookkeeping: ") + e.what());
    }
    const double t1 = now();
    if (layer_est_ >= 0.0) layer_est_ = 0.8 * layer_est_ + 0.2 * (t1 - run.t_start);
    std::lock_guard<std::mutex> lock(stats_mu_);
    EngineLayerStats & s = stats_[(size_t) run.ml];
    s.wait_s += t1 - t0;
    s.layer_s += t1 - run.t_start;
}

double measure_h2d_s(ggml_backend_dev_t device, size_t bytes, int reps) {
    if (!device || bytes == 0 || reps < 1) throw std::invalid_argument("measure_h2d_s: device, bytes and reps needed");
    ggml_backend_t be = ggml_backend_dev_init(device, nullptr);
    if (!be) throw std::runtime_error(std::string("cannot initialise device ") + ggml_backend_dev_name(device));
    ggml_init_params ip = {ggml_tensor_overhead() * 2, nullptr, true};
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * t = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) bytes);
    ggml_backend_buffer_t dbuf = ggml_backend_alloc_ctx_tensors(ctx, be);
    ggml_backend_buffer_type_t hbt = ggml_backend_dev_host_buffer_type(device);
    ggml_backend_buffer_t hbuf = hbt ? ggml_backend_buft_alloc_buffer(hbt, bytes) : nullptr;
    std::vector<uint8_t> pageable;
    uint8_t * src = nullptr;
    if (hbuf) {
        src = (uint8_t *) ggml_backend_buffer_get_base(hbuf);
    } else {
        pageable.assign(bytes, 1);
        src = pageable.data();
    }
    std::vector<double> times;
    if (dbuf) {
        std::memset(src, 1, bytes);
        for (int i = 0; i < reps + 1; ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            ggml_backend_tensor_set(t, src, 0, bytes);
            ggml_backend_synchronize(be);
            const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (i > 0) times.push_back(dt);  // the first copy pays one-time costs
        }
    }
    if (hbuf) ggml_backend_buffer_free(hbuf);
    if (dbuf) ggml_backend_buffer_free(dbuf);
    ggml_free(ctx);
    ggml_backend_free(be);
    if (times.empty()) throw std::runtime_error("cannot allocate " + std::to_string(bytes) + " bytes on the device");
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
}

}  // namespace hybrimoe
