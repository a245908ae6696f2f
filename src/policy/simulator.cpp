#include "policy/simulator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

namespace hybrimoe {

namespace {

// Mean-one log-normal factors from one seeded generator (reproducible runs).
struct Noise {
    explicit Noise(uint64_t seed) : rng(seed) {}
    double factor(double sigma) {
        if (sigma <= 0.0) return 1.0;
        return std::exp(sigma * normal(rng) - 0.5 * sigma * sigma);
    }
    std::mt19937_64 rng;
    std::normal_distribution<double> normal{0.0, 1.0};
};

void check_finite_nonneg(const char * what, double v) {
    if (!std::isfinite(v) || v < 0.0) {
        throw std::invalid_argument(std::string(what) + " must be finite and >= 0, got " + std::to_string(v));
    }
}

void check_prompt_range(const Trace & trace, int first_prompt, int end_prompt) {
    if (first_prompt < 0 || end_prompt > trace.n_prompts() || first_prompt >= end_prompt) {
        throw std::invalid_argument("prompt range [" + std::to_string(first_prompt) + ", " +
                                    std::to_string(end_prompt) + ") is empty or outside 0.." +
                                    std::to_string(trace.n_prompts()));
    }
}

}  // namespace

void TruthModel::validate() const {
    check_finite_nonneg("TruthModel.cpu_noise", cpu_noise);
    check_finite_nonneg("TruthModel.gpu_noise", gpu_noise);
    check_finite_nonneg("TruthModel.h2d_noise", h2d_noise);
    check_finite_nonneg("TruthModel.act_noise", act_noise);
    check_finite_nonneg("TruthModel.layer_noise", layer_noise);
    check_finite_nonneg("TruthModel.cpu_startup_extra_s", cpu_startup_extra_s);
    check_finite_nonneg("TruthModel.contention", contention);
    check_finite_nonneg("TruthModel.cpu_scale", cpu_scale);
    check_finite_nonneg("TruthModel.gpu_scale", gpu_scale);
    check_finite_nonneg("TruthModel.h2d_scale", h2d_scale);
}

void SimConfig::validate() const {
    if (stage != "decode" && stage != "prefill") {
        throw std::invalid_argument("SimConfig.stage must be 'decode' or 'prefill', got '" + stage + "'");
    }
    if (ubatch < 1) throw std::invalid_argument("SimConfig.ubatch must be >= 1");
    if (prompt_tokens < 0) throw std::invalid_argument("SimConfig.prompt_tokens must be >= 0");
    if (prefetch_depth < 0) throw std::invalid_argument("SimConfig.prefetch_depth must be >= 0");
    if (static_cast<int>(recall.size()) < prefetch_depth) {
        throw std::invalid_argument("SimConfig.recall needs one value per distance up to prefetch_depth (" +
                                    std::to_string(prefetch_depth) + "), got " + std::to_string(recall.size()));
    }
    for (double r : recall) {
        if (!(r >= 0.0 && r <= 1.0)) throw std::invalid_argument("SimConfig.recall values must be in [0, 1]");
    }
    if (max_tokens < 0) throw std::invalid_argument("SimConfig.max_tokens must be >= 0");
    if (timeline_layers < 0) throw std::invalid_argument("SimConfig.timeline_layers must be >= 0");
    ram.validate();
}

void RamTierConfig::validate() const {
    if (reads != "queued" && reads != "faulting") {
        throw std::invalid_argument("RamTierConfig.reads must be 'queued' or 'faulting', got '" + reads + "'");
    }
    if (lookahead < 0) throw std::invalid_argument("RamTierConfig.lookahead must be >= 0");
    if (exclusive && reads != "queued") {
        throw std::invalid_argument("RamTierConfig.exclusive needs queued reads (a page cache is not told what the "
                                    "GPU holds)");
    }
    if (lookahead > 0 && reads != "queued") {
        throw std::invalid_argument("RamTierConfig.lookahead needs queued reads (a faulting read happens at use)");
    }
    if (static_cast<int>(recall.size()) < lookahead) {
        throw std::invalid_argument("RamTierConfig.recall needs one value per distance up to lookahead (" +
                                    std::to_string(lookahead) + "), got " + std::to_string(recall.size()));
    }
    for (double r : recall) {
        if (!(r >= 0.0 && r <= 1.0)) throw std::invalid_argument("RamTierConfig.recall values must be in [0, 1]");
    }
    if (!(fault_bytes >= 4096.0) || !std::isfinite(fault_bytes)) {
        throw std::invalid_argument("RamTierConfig.fault_bytes must be a finite number >= 4096 (one page)");
    }
    if (!(other_bytes >= 0.0) || !std::isfinite(other_bytes)) {
        throw std::invalid_argument("RamTierConfig.other_bytes must be a finite number >= 0 (bytes per MoE layer)");
    }
    if (!(read_around >= 1.0) || !std::isfinite(read_around)) {
        throw std::invalid_argument("RamTierConfig.read_around must be a finite number >= 1 (bytes read per byte "
                                    "faulted)");
    }
    if (!(fault_bandwidth_Bps >= 0.0) || !std::isfinite(fault_bandwidth_Bps)) {
        throw std::invalid_argument("RamTierConfig.fault_bandwidth_Bps must be a finite number >= 0 (0: faults "
                                    "move at the disk's queued bandwidth, each paying its latency)");
    }
    if (!(read_bandwidth_Bps >= 0.0) || !std::isfinite(read_bandwidth_Bps)) {
        throw std::invalid_argument("RamTierConfig.read_bandwidth_Bps must be a finite number >= 0 (0: the disk's "
                                    "bandwidth)");
    }
    if (!(read_cpu_s_per_byte >= 0.0) || !std::isfinite(read_cpu_s_per_byte)) {
        throw std::invalid_argument("RamTierConfig.read_cpu_s_per_byte must be a finite number >= 0");
    }
}

TracePredictor::TracePredictor(std::vector<double> recall, uint64_t seed) : recall_(std::move(recall)), rng_(seed) {
    for (double r : recall_) {
        if (!(r >= 0.0 && r <= 1.0)) throw std::invalid_argument("TracePredictor: recall values must be in [0, 1]");
    }
}

void TracePredictor::predict(const int16_t * ids_base, int64_t token_stride, int n_tokens, int top_k, int n_experts,
                             int distance, Prediction & out) {
    if (distance < 1 || distance > static_cast<int>(recall_.size())) {
        throw std::invalid_argument("TracePredictor: no recall given for distance " + std::to_string(distance));
    }
    const double r = recall_[distance - 1];
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    std::uniform_int_distribution<int> any(0, n_experts - 1);
    pos_.assign(static_cast<size_t>(n_experts), -1);
    out.experts.clear();
    out.loads.clear();
    out.distance = distance;
    out.confidence = r;
    for (int t = 0; t < n_tokens; ++t) {
        const int16_t * row = ids_base + t * token_stride;
        for (int j = 0; j < top_k; ++j) {
            int e = row[j];
            if (r < 1.0 && unit(rng_) >= r && top_k < n_experts) {
                bool in_row;
                do {
                    e = any(rng_);
                    in_row = false;
                    for (int i = 0; i < top_k; ++i) in_row |= row[i] == e;
                } while (in_row);
            }
            if (pos_[e] < 0) {
                pos_[e] = static_cast<int32_t>(out.experts.size());
                out.experts.push_back(e);
                out.loads.push_back(0);
            }
            out.loads[pos_[e]] += 1;
        }
    }
}

std::vector<Step> make_steps(const Trace & trace, int first_prompt, int end_prompt, const SimConfig & cfg) {
    check_prompt_range(trace, first_prompt, end_prompt);
    std::vector<Step> steps;
    int64_t tokens = 0;
    for (int p = first_prompt; p < end_prompt; ++p) {
        if (cfg.max_tokens > 0 && tokens >= cfg.max_tokens) break;
        const int64_t b = trace.prompt_offsets[p], e = trace.prompt_offsets[p + 1];
        const int64_t chunk = cfg.stage == "decode" ? 1 : cfg.ubatch;
        int64_t s = b;
        if (cfg.stage == "decode" && cfg.prompt_tokens > 0) {  // the prompt's prefill first, in ubatches
            const int64_t pe = std::min(e, b + cfg.prompt_tokens);
            while (s < pe) {
                const int64_t end = std::min(pe, s + cfg.ubatch);
                steps.push_back({s, end, p});
                tokens += end - s;
                s = end;
            }
        }
        for (; s < e; s += chunk) {
            if (cfg.stage == "decode" && cfg.max_tokens > 0 && tokens >= cfg.max_tokens) break;
            const int64_t end = std::min(e, s + chunk);
            steps.push_back({s, end, p});
            tokens += end - s;
        }
    }
    return steps;
}

FutureAccesses build_future(const Trace & trace, const std::vector<Step> & steps) {
    FutureAccesses f;
    f.n_layers = trace.n_layers;
    f.n_experts = trace.n_experts;
    f.uses.assign(static_cast<size_t>(trace.n_layers) * trace.n_experts, {});
    std::vector<int64_t> stamp(f.uses.size(), -1);
    for (size_t si = 0; si < steps.size(); ++si) {
        for (int l = 0; l < trace.n_layers; ++l) {
            const int64_t tick = static_cast<int64_t>(si) * trace.n_layers + l;
            for (int64_t t = steps[si].begin; t < steps[si].end; ++t) {
                const int16_t * row = trace.row(t, l);
                for (int j = 0; j < trace.top_k; ++j) {
                    const size_t key = static_cast<size_t>(l) * trace.n_experts + row[j];
                    if (stamp[key] != tick) {
                        stamp[key] = tick;
                        f.uses[key].push_back(tick);
                    }
                }
            }
        }
    }
    return f;
}

namespace {

void check_cache_matches(const Trace & trace, const ExpertCache & cache) {
    if (cache.n_layers() != trace.n_layers || cache.n_experts() != trace.n_experts) {
        throw std::invalid_argument("cache shape (" + std::to_string(cache.n_layers()) + " layers x " +
                                    std::to_string(cache.n_experts()) + " experts) does not match the trace (" +
                                    std::to_string(trace.n_layers) + " x " + std::to_string(trace.n_experts) + ")");
    }
}

// Routed ids [n, top_k] and router scores [n, E] (empty when the trace has none) of MoE layer l of a step.
void load_routing(const Trace & trace, const Step & st, int l, std::vector<int32_t> & ids32,
                  std::vector<float> & scores) {
    const int n = static_cast<int>(st.end - st.begin);
    const int K = trace.top_k;
    ids32.resize(static_cast<size_t>(n) * K);
    for (int t = 0; t < n; ++t) {
        const int16_t * row = trace.row(st.begin + t, l);
        for (int j = 0; j < K; ++j) ids32[static_cast<size_t>(t) * K + j] = row[j];
    }
    scores.clear();
    if (!trace.scores.empty()) {
        const int E = trace.n_experts;
        scores.resize(static_cast<size_t>(n) * E);
        for (int t = 0; t < n; ++t) {
            const float * src = trace.scores.data() + ((st.begin + t) * trace.n_layers + l) * static_cast<size_t>(E);
            std::copy(src, src + E, scores.begin() + static_cast<size_t>(t) * E);
        }
    }
}

// Fills `in` and `obs` for MoE layer l of a step.
void load_layer(const Trace & trace, const Step & st, int l, int64_t si, std::vector<int32_t> & ids32, LayerInput & in,
                LayerObservation & obs) {
    const int n = static_cast<int>(st.end - st.begin);
    const int K = trace.top_k;
    load_routing(trace, st, l, ids32, obs.scores);
    in.layer = l;
    in.set_routing(ids32.data(), n, K, trace.n_experts);
    in.expert_bytes = trace.expert_bytes[l];
    obs.step = si;
    obs.set_routed(l, n, K, trace.n_experts, in.experts, in.loads);
}

}  // namespace

CacheStats replay_cache(const Trace & trace, ExpertCache & cache, int first_prompt, int end_prompt,
                        const SimConfig & cfg) {
    cfg.validate();
    check_cache_matches(trace, cache);
    const std::vector<Step> steps = make_steps(trace, first_prompt, end_prompt, cfg);
    if (cache.policy().clairvoyant()) cache.policy().prepare(build_future(trace, steps));
    cache.reset_stats();
    std::vector<int32_t> ids32;
    std::vector<int32_t> misses;
    LayerInput in;
    LayerObservation obs;
    for (size_t si = 0; si < steps.size(); ++si) {
        for (int l = 0; l < trace.n_layers; ++l) {
            load_layer(trace, steps[si], l, static_cast<int64_t>(si), ids32, in, obs);
            cache.observe(obs);
            for (int32_t e : in.experts) {
                cache.access(l, e);
                cache.pin(l, e);
            }
            // Offer the misses together, most valuable first (admit_batch), so one admission does not pin out a
            // better one of the same ubatch.
            misses.clear();
            for (int32_t e : in.experts) {
                if (!cache.resident(l, e)) misses.push_back(e);
            }
            cache.admit_batch(l, misses, {}, false);
            for (int32_t e : in.experts) cache.unpin(l, e);
        }
    }
    return cache.stats();
}

namespace {

// One simulate() run: the three true timelines (CPU, GPU, copy engine), the truth model's draws and the counters,
// with one member function per step of a MoE layer. It is also the placement the decision rules (LayerDecider)
// queue copies on: each copy is charged on the true link under the truth model. The initial fill is resident from
// the start (no first-use copies here). Draws come from one generator in a fixed order (non-expert part, the copies
// as they are queued, the GPU share's activations and experts, the CPU share's experts), so a run is reproducible.
class SimRun final : public ExpertPlacement {
public:
    using clock = std::chrono::steady_clock;

    SimRun(const Trace & trace, const std::vector<SimDevice> & devices, const std::vector<int> & layer_device,
           bool shared_link, const TruthModel & truth, const SimConfig & cfg, ExpertCache * ram)
        : trace_(trace), ram_(ram), planner_(devices.at(0).planner), truth_cost_(devices.at(0).truth), truth_(truth),
          cfg_(cfg), L_(trace.n_layers), K_(trace.top_k), E_(trace.n_experts),
          predictor_(cfg.recall, cfg.predictor_seed), noise_(truth.seed), dev_of_(layer_device),
          truth_ready_((size_t) L_ * E_, 0.0), deferred_((size_t) L_ * E_, 0), pos_(E_, -1),
          ram_predictor_(cfg.ram.recall, cfg.predictor_seed + 1) {
        for (size_t d = 0; d < devices.size(); ++d) {
            const SimDevice & sd = devices[d];
            Dev dv;
            dv.cache = sd.cache;
            // the caller owns the policies: non-owning handles for the rules
            dv.decider.reset(new LayerDecider(std::shared_ptr<ExpertCache>(sd.cache, [](ExpertCache *) {}),
                                              std::shared_ptr<SchedulePolicy>(sd.scheduler, [](SchedulePolicy *) {}),
                                              std::shared_ptr<PrefetchPolicy>(sd.prefetcher, [](PrefetchPolicy *) {}),
                                              sd.planner, decider_config(*sd.cache, cfg)));
            dv.planner = sd.planner;
            dv.truth = sd.truth;
            dv.link = shared_link ? 0 : (int) d;
            devs_.push_back(std::move(dv));
        }
        links_.resize(shared_link ? 1 : devices.size());
        res_.device_cache.resize(devices.size());
        res_.device_bytes_h2d.assign(devices.size(), 0.0);
        res_.device_link_busy_s.assign(devices.size(), 0.0);
        res_.stage = cfg.stage;
        res_.layer_moe_s.assign(L_, 0.0);
        if (ram_) {
            faulting_ = cfg.ram.reads == "faulting";
            other_touch_.assign((size_t) L_, 0.0);  // in RAM at the start (the loader read them)
            disk_places_.assign((size_t) std::max(1.0, std::floor(truth_cost_.disk_queue_depth)), 0.0);
            transient_tick_.assign((size_t) L_ * E_, -1);
            transient_ready_.assign((size_t) L_ * E_, 0.0);
            ram_unpin_.assign((size_t) L_, {});
            if (cfg.ram.exclusive) {  // the GPU caches' evictions reach evicted(): demotions
                for (Dev & dv : devs_) {
                    dv.cache->set_record_evicted(true);
                    dv.cache->take_evicted();
                }
            }
        }
    }

    /// Runs every step, then fills in the result's totals and means.
    SimResult run(const std::vector<Step> & steps);

    // ExpertPlacement: the decision rules queued a copy of (layer, expert); charge it on the true link.
    double load(int layer, int expert, Kind kind) override;
    bool holds(int) const override { return true; }
    // ExpertPlacement: the GPU cache evicted these keys; with exclusive tiers each is offered back to the RAM tier.
    void evicted(const std::vector<int64_t> & keys) override;
    /// Exclusive tiers: whether (l, e), in both tiers, gives up its RAM slot: the GPU cache keeps it, not on
    /// probation (a streamed demand load of a large ubatch enters the GPU cache at the lowest rank and leaves it at
    /// the next load: its RAM slot stays, so that the stream does not churn the RAM tier), nor filled while it was on
    /// disk (its copy waits for its first use: the RAM copy is its only one, Engine::kept_on_gpu).
    bool gives_up_ram(int l, int e) const {
        const ExpertCache & c = *devs_[(size_t) dev_of_[(size_t) l]].cache;
        return c.resident(l, e) && !c.on_probation(l, e) && !deferred_[(size_t) l * E_ + e] && ram_->resident(l, e);
    }

private:
    static DeciderConfig decider_config(const ExpertCache & cache, const SimConfig & cfg) {
        DeciderConfig d;
        d.has_slots = cache.budget_bytes() > 0.0;
        d.prefetch_layers = cfg.prefetch_depth;
        d.fill_on_miss = cfg.fill_on_miss;
        return d;
    }
    void record(int64_t si, int l, int resource, int expert, int kind, double a, double b) {
        if (si == cfg_.timeline_step && l < cfg_.timeline_layers) {
            res_.timeline.push_back({si, l, resource, expert, kind, a, b});
        }
    }
    void run_step(int64_t si, const Step & st);
    /// One MoE layer: non-expert part, decision, the true GPU and CPU shares, prefetches and fills.
    void run_layer(int64_t si, const Step & st, int l);
    /// The engine's decisions for layer l (timed): split, demand loads; fills gpu_order_ / cpu_order_ with the
    /// execution order (a load the cache refused runs on the CPU, after the planned CPU experts). Returns the
    /// planner's predicted makespan of the split run.
    double decide(int64_t si, const Step & st, int l, int n);
    /// True end of the GPU share started at t_moe_ (t_moe_ if it has no experts).
    double charge_gpu(int64_t si, int l, int n);
    /// True end of the CPU share started at t_moe_ (t_moe_ if it has no experts).
    double charge_cpu(int64_t si, int l);
    /// Prefetches for the next prefetch_depth layers (planned after this layer's router, timed), then fills.
    void prefetch_and_fill(const Step & st, int l, int n, double predicted_s);

    // ---- the RAM tier (ram_ not null) ----
    int64_t tick() const { return cur_step_ * L_ + cur_layer_; }
    /// `bytes` issued at t on the true disk (expert e, -1: not an expert's): returns its end; counts the bytes.
    double disk_move(double bytes, double t, int e, double fault_Bps = 0.0);
    /// The measured fault throughput for this step's faulting reads: a decode's (one token's experts, faulted by the
    /// compute threads); 0 for a ubatch that sweeps whole layers in file order, which the kernel reads ahead as
    /// queued reads, or without a measured figure.
    double step_fault_Bps() const { return large_ubatch_ ? 0.0 : cfg_.ram.fault_bandwidth_Bps; }
    /// A queued read of expert e's `bytes` issued at t on the true disk; returns its end.
    double disk_read(double bytes, double t, int e);
    /// Faulting reads: (l, e) touched at t through the mapping, not in RAM. Its read-around window is read on the
    /// disk and its neighbours join the RAM cache as read-ahead; returns when e's own pages are in.
    double fault_in(int l, int e, double t);
    /// Faulting reads: the first use of a read-ahead expert (l, n) at t starts the kernel's asynchronous
    /// read-ahead of the next window.
    void read_ahead_after(int l, int n, double t);
    /// Faulting reads: when layer l's weights outside the routed experts (RamTierConfig.other_bytes) are in RAM
    /// for the layer starting at t (faulted in again if the page cache dropped them since its last run).
    double other_in(int l, double t);
    /// When (l, e)'s weights are in RAM for a use now: resident (or read for this layer) -> its read end; else, with
    /// queued reads, a read is issued at t and kept; -1: faulting reads, the user must fault it in (fault_in).
    double ram_ready(int l, int e, double t);
    /// ram_ready for a use of this layer's activated expert: counts the RAM lookup and pins it for the layer.
    double ram_use(int l, int e, double t);
    /// The read of (l, e) ended (or ends) at `end`: offers it to the RAM cache, else keeps it for this layer only.
    void ram_keep(int l, int e, double end, bool by_prefetch);
    /// Router look-ahead reads for the next cfg.ram.lookahead layers (after layer l's router and its own
    /// reads; predicted_s: the planner's makespan of its split).
    void ram_lookahead(const Step & st, int l, int n, double predicted_s);
    /// After layer l: unpins its RAM experts and those read ahead for it.
    void ram_release(int l);

    /// One device that caches experts: its cache and decision rules, its cost models (GPU-side figures: copies,
    /// compute, the layer's non-expert part), the link it copies over.
    struct Dev {
        ExpertCache * cache = nullptr;
        std::unique_ptr<LayerDecider> decider;
        CostModel planner, truth;
        int link = 0;
    };
    /// A host-to-device link (one per device, or one that every device shares: GPUs behind one switch's lanes).
    struct Link {
        double true_free_at = 0.0;   // the true copy engine is busy until then
        double est_free_at = 0.0;    // the planner's estimate of the same
        double d2h_free_at = 0.0;    // exclusive tiers: the link's device-to-host direction
    };
    Dev & dv(int l) { return devs_[(size_t) dev_of_[(size_t) l]]; }
    Link & lk(int l) { return links_[(size_t) dv(l).link]; }

    const Trace & trace_;
    ExpertCache * ram_;
    const CostModel & planner_;      // the host's figures (CPU, disk): device 0's models
    const CostModel & truth_cost_;
    const TruthModel & truth_;
    const SimConfig & cfg_;
    const int L_, K_, E_;
    TracePredictor predictor_;
    Noise noise_;
    std::vector<Dev> devs_;
    std::vector<Link> links_;
    std::vector<int> dev_of_;        // per MoE layer: its device
    SimResult res_;

    std::vector<int32_t> ids32_;
    std::vector<float> scores_;
    std::vector<double> truth_ready_;                  // key -> true end of its last copy (0: from the start)
    std::vector<uint8_t> deferred_;                    // key -> in the GPU cache, its copy waiting for its first use
    std::vector<std::pair<double, double>> link_busy_; // copy intervals on every link, in start order
    std::vector<Prediction> preds_;
    std::vector<std::vector<Prediction>> preds_by_dev_;  // several devices: preds_ by the device of their layer
    std::vector<int32_t> gpu_order_, cpu_order_, pos_;
    double t_ = 0.0;                   // the true clock: end of the last layer
    double layer_est_ = -1.0;          // smoothed true seconds per MoE layer (prediction start times)
    double t_moe_ = 0.0;               // when the current layer's routed experts may start
    int64_t cur_step_ = 0;
    int cur_layer_ = 0;
    double layer_copy_s_ = 0.0;        // true copy time queued for the current layer (loads, prefetches, fills)
    double charge_ns_ = 0.0;           // time spent charging copies inside a timed decision (not part of deciding)
    double decision_ns_ = 0.0, prefetch_ns_ = 0.0;
    int64_t layers_run_ = 0;
    int current_prompt_ = -1;
    double prompt_start_ = 0.0, ttft_sum_ = 0.0;

    // the RAM tier
    TracePredictor ram_predictor_;
    bool faulting_ = false;
    bool large_ubatch_ = false;               // this step likely uses every expert of a layer (exclusive tiers idle)
    int last_ram_access_ = 0;                // ExpertCache::access's answer to the last ram_use
    std::vector<uint8_t> cpu_ahead_;         // per cpu_order_ entry: its lookup found a read-ahead expert
    std::vector<double> other_touch_;        // per MoE layer: res_.bytes_disk when its other weights last ran
    double read_cpu_debt_s_ = 0.0;           // CPU seconds of queued reads not yet charged (read_cpu_s_per_byte)
    std::vector<double> disk_places_;        // when each of the disk's queue places frees (true)
    double disk_bytes_free_at_ = 0.0;        // the true disk has moved the bytes of every read issued by then
    double disk_est_free_at_ = 0.0;          // the planner's estimate of the same
    double layer_disk_est_ = 0.0;            // that estimate once the current layer's own reads were queued
    std::vector<int64_t> transient_tick_;    // key -> layer tick a read not kept in RAM serves (-1: none)
    std::vector<double> transient_ready_;    // its end
    std::vector<int32_t> ram_pinned_;        // this layer's experts pinned in RAM
    std::vector<std::vector<int32_t>> ram_unpin_;  // per MoE layer: experts read ahead for it, pinned until it ran
    std::vector<double> cpu_ready_;          // per cpu_order_ entry: when its weights are in RAM (-1: fault)
    std::vector<int32_t> ram_order_, ram_ids_;   // scratch: an order, and cpu_order_ in it
    std::vector<double> ram_ready_;              // scratch: cpu_ready_ in that order
    LayerInput ram_in_;
    LayerObservation ram_obs_;
    Prediction ram_pred_;
};

double SimRun::load(int layer, int e, Kind kind) {
    const size_t key = (size_t) layer * E_ + e;
    bool first_use = false;  // the first use of an expert filled while it was on disk: its read, then its copy
    if (kind == kFirstUse) {
        // an expert filled while it was on disk: the engine gave it a slot and copies it at its first use, after
        // the read its use makes (Engine::Placement::load), counted as a fill's copy; a resident one needs nothing
        if (!ram_ || !deferred_[key]) return 0.0;
        first_use = true;
    }
    const auto c0 = clock::now();
    const double bytes = trace_.expert_bytes[(size_t) layer];
    deferred_[key] = 0;
    if (ram_ && !faulting_ && kind != kDemand && !first_use &&
        !(ram_->resident(layer, e) && ram_->ready_s(layer, e) <= t_moe_)) {
        // a fill (or a prefetch, which the predictions' filter leaves none of) of an expert whose weights are not
        // in RAM yet (on disk, or its read in flight) copies nothing now: its slot waits for the expert's first
        // use (the engine's rule: RamTier::ready, else the copy at first use after the read)
        deferred_[key] = 1;
        truth_ready_[key] = t_moe_;
        charge_ns_ += std::chrono::duration<double, std::nano>(clock::now() - c0).count();
        return 0.0;
    }
    // with a RAM tier the copy reads the expert from RAM: it starts after the expert's read, or (faulting reads)
    // the copy's own touch faults it in first
    double ready = 0.0;
    bool fault = false;
    if (ram_) {
        ready = kind == kDemand || first_use ? ram_use(layer, e, t_moe_) : ram_ready(layer, e, t_moe_);
        fault = ready < 0.0;
        if (fault) ready = 0.0;
    }
    Link & link = lk(layer);
    double start = std::max(std::max(link.true_free_at, t_moe_), ready);
    if (fault) {
        start = fault_in(layer, e, start);
        ram_keep(layer, e, start, kind != kDemand && !first_use);
    } else if (ram_ && faulting_ && kind == kDemand && (last_ram_access_ == 2 || last_ram_access_ == 3)) {
        read_ahead_after(layer, e, start);
    }
    const double end = start + dv(layer).truth.h2d(bytes) * truth_.h2d_scale * noise_.factor(truth_.h2d_noise);
    res_.link_busy_s += end - start;
    res_.device_link_busy_s[(size_t) dev_of_[(size_t) layer]] += end - start;
    res_.device_bytes_h2d[(size_t) dev_of_[(size_t) layer]] += bytes;
    layer_copy_s_ += end - start;
    link.true_free_at = end;
    link_busy_.emplace_back(start, end);
    truth_ready_[key] = end;
    // exclusive tiers: the expert now lives on the GPU; its RAM slot goes (a slot this layer's lookups pinned goes
    // at ram_release)
    if (ram_ && cfg_.ram.exclusive && !large_ubatch_ && gives_up_ram(layer, e) && !ram_->pinned(layer, e)) {
        ram_->evict(layer, e);
    }
    int tl_kind = 1;
    if (kind == kDemand) {
        res_.bytes_demand += bytes;
    } else if (kind == kPrefetch) {
        res_.bytes_prefetch += bytes;
        ++res_.prefetch_issued;
        tl_kind = 2;
    } else {
        res_.bytes_fill += bytes;
        tl_kind = 3;
    }
    record(cur_step_, cur_layer_, 2, e, tl_kind, start, end);
    charge_ns_ += std::chrono::duration<double, std::nano>(clock::now() - c0).count();
    return bytes;
}

double SimRun::decide(int64_t si, const Step & st, int l, int n) {
    const auto d0 = clock::now();
    charge_ns_ = 0.0;
    layer_copy_s_ = 0.0;
    load_routing(trace_, st, l, ids32_, scores_);
    if (ram_) {
        // the RAM cache's policy sees the router as the GPU cache's does (split() takes the scores buffer)
        ram_in_.layer = l;
        ram_in_.set_routing(ids32_.data(), n, K_, E_);
        ram_obs_.step = si;
        ram_obs_.scores = scores_;
        ram_obs_.set_routed(l, n, K_, E_, ram_in_.experts, ram_in_.loads);
        ram_->observe(ram_obs_);
    }
    LayerDecider & decider = *dv(l).decider;
    const std::vector<uint8_t> & on_gpu =
        decider.split(si, l, ids32_.data(), n, K_, scores_, trace_.expert_bytes[(size_t) l], t_moe_,
                      std::max(0.0, lk(l).est_free_at - t_moe_), *this, nullptr);
    decision_ns_ += std::chrono::duration<double, std::nano>(clock::now() - d0).count() - charge_ns_;
    const LayerInput & din = decider.input();
    const SchedulePlan & plan = decider.plan();
    for (size_t i = 0; i < din.size(); ++i) pos_[din.experts[i]] = static_cast<int32_t>(i);
    // execution order: the plan's; a load the cache refused runs on the CPU, after the planned CPU experts
    gpu_order_.clear();
    cpu_order_.assign(plan.cpu_experts.begin(), plan.cpu_experts.end());
    for (int32_t e : plan.gpu_experts) (on_gpu[pos_[e]] ? gpu_order_ : cpu_order_).push_back(e);
    if (ram_ && faulting_) {
        // upstream's CPU share (ggml_compute_forward_mul_mat_id) runs its experts in index order: a prefill's
        // share sweeps each ffn_*_exps tensor, which the kernel's read-ahead follows
        std::sort(cpu_order_.begin(), cpu_order_.end());
    }
    if (ram_) {
        // the CPU share's experts must be in RAM: queued reads are issued now, in execution order
        cpu_ready_.resize(cpu_order_.size());
        cpu_ahead_.assign(cpu_order_.size(), 0);
        for (size_t i = 0; i < cpu_order_.size(); ++i) {
            cpu_ready_[i] = ram_use(l, cpu_order_[i], t_moe_);
            cpu_ahead_[i] = faulting_ && (last_ram_access_ == 2 || last_ram_access_ == 3);  // a read-ahead hit
        }
        layer_disk_est_ = disk_est_free_at_;
        if (cfg_.ram.ready_first && !faulting_) {
            ram_order_.resize(cpu_order_.size());
            for (size_t i = 0; i < ram_order_.size(); ++i) ram_order_[i] = static_cast<int32_t>(i);
            std::stable_sort(ram_order_.begin(), ram_order_.end(),
                             [&](int32_t a, int32_t b) { return cpu_ready_[a] < cpu_ready_[b]; });
            ram_ids_.resize(cpu_order_.size());
            ram_ready_.resize(cpu_order_.size());
            for (size_t i = 0; i < ram_order_.size(); ++i) {
                ram_ids_[i] = cpu_order_[ram_order_[i]];
                ram_ready_[i] = cpu_ready_[ram_order_[i]];
            }
            cpu_order_.swap(ram_ids_);
            cpu_ready_.swap(ram_ready_);
        }
    }
    return decider.run_plan().makespan_s;
}

double SimRun::charge_gpu(int64_t si, int l, int n) {
    if (gpu_order_.empty()) return t_moe_;
    const LayerInput & din = dv(l).decider->input();
    const CostModel & tc = dv(l).truth;
    // a device that cannot compute while it copies works through the queued copies first
    const double blocked = tc.copy_blocking(std::max(0.0, lk(l).true_free_at - t_moe_));
    double tg = t_moe_ + blocked + tc.act(n) * noise_.factor(truth_.act_noise);
    record(si, l, 1, -1, 5, t_moe_, tg);
    for (int32_t e : gpu_order_) {
        const double s0 = std::max(tg, truth_ready_[(size_t) l * E_ + e]);
        const double dur = tc.gpu(din.loads[pos_[e]]) * truth_.gpu_scale * noise_.factor(truth_.gpu_noise);
        tg = s0 + dur;
        res_.gpu_busy_s += dur;
        record(si, l, 1, e, 0, s0, tg);
    }
    return tg;
}

double SimRun::charge_cpu(int64_t si, int l) {
    if (cpu_order_.empty()) {
        read_cpu_debt_s_ = 0.0;  // the cores were free for the reads' CPU work
        return t_moe_;
    }
    const LayerInput & din = dv(l).decider->input();
    // the layer's loads, queued before its CPU share runs, delay it on a host that pays for copies
    double tc = t_moe_ + truth_cost_.cpu_copy_blocking(layer_copy_s_) + truth_cost_.cpu_startup_s +
                truth_.cpu_startup_extra_s;
    for (size_t i = 0; i < cpu_order_.size(); ++i) {
        const int32_t e = cpu_order_[i];
        if (ram_) {
            // its weights in RAM first: wait for the read, or fault them in on this thread (unless an earlier
            // fault's read-around brought them: the lookup counted a miss, the pages are there now, a prefetch hit)
            if (cpu_ready_[i] < 0.0 && ram_->resident(l, e)) {
                cpu_ready_[i] = ram_->ready_s(l, e);
                cpu_ahead_[i] = 1;
                ram_->found_read_ahead(l, e);
            }
            if (cpu_ready_[i] < 0.0) {
                const double f_end = fault_in(l, e, tc);
                record(si, l, 0, e, 6, tc, f_end);
                tc = f_end;
                ram_keep(l, e, tc, false);
            } else {
                if (faulting_ && cpu_ahead_[i]) read_ahead_after(l, e, tc);
                if (cpu_ready_[i] > tc) {
                    // the reads' CPU work runs while the share waits for them
                    read_cpu_debt_s_ = std::max(0.0, read_cpu_debt_s_ - (cpu_ready_[i] - tc));
                    tc = cpu_ready_[i];
                }
            }
        }
        double dur = truth_cost_.cpu(din.loads[pos_[e]]) * truth_.cpu_scale * noise_.factor(truth_.cpu_noise);
        if (truth_.contention > 0.0) {
            double overlap = 0.0;
            for (const auto & iv : link_busy_) {
                overlap += std::max(0.0, std::min(tc + dur, iv.second) - std::max(tc, iv.first));
            }
            dur += truth_.contention * overlap;
        }
        record(si, l, 0, e, 0, tc, tc + dur);
        tc += dur;
    }
    // what the waits did not absorb took the compute threads' cores
    tc += read_cpu_debt_s_;
    read_cpu_debt_s_ = 0.0;
    res_.cpu_busy_s += tc - t_moe_;
    return tc;
}

void SimRun::prefetch_and_fill(const Step & st, int l, int n, double predicted_s) {
    LayerDecider & decider = *dv(l).decider;
    const CostModel & planner = dv(l).planner;
    bool ahead = false;  // another device prefetches its layers predicted from this one (the engine's rule)
    for (const Dev & o : devs_) ahead = ahead || (&o != &dv(l) && o.decider->prefetches() && l + 1 < L_);
    if (decider.wants_prefetch(L_) || ahead) {
        const auto p0 = clock::now();
        if (layer_est_ < 0.0) layer_est_ = planner.layer(n) + predicted_s;
        const int depth = std::min(cfg_.prefetch_depth, L_ - 1 - l);
        preds_.resize(static_cast<size_t>(depth));
        for (int d = 1; d <= depth; ++d) {
            Prediction & p = preds_[static_cast<size_t>(d - 1)];
            const int j = l + d;
            predictor_.predict(trace_.row(st.begin, j), static_cast<int64_t>(L_) * K_, n, K_, E_, d, p);
            p.layer = j;
            p.expert_bytes = trace_.expert_bytes[j];
            p.start_s = predicted_s + (double(d) - 1.0) * layer_est_ + planner.layer(n);
            if (ram_ && !faulting_) {
                // the engine's rule: only experts already in RAM are copied ahead to the GPU (one on disk, or
                // being read, is copied at its first use): the others leave the prediction
                size_t kept = 0;
                for (size_t i = 0; i < p.experts.size(); ++i) {
                    const int32_t e = p.experts[i];
                    if (!ram_->resident(j, e) || ram_->ready_s(j, e) > t_moe_) continue;
                    p.experts[kept] = e;
                    if (i < p.loads.size()) p.loads[kept] = p.loads[i];
                    ++kept;
                }
                p.experts.resize(kept);
                if (p.loads.size() > kept) p.loads.resize(kept);
            }
        }
        if (devs_.size() == 1) {
            decider.prefetch(preds_, L_, *this, nullptr);
            res_.prefetch_declined += decider.prefetch_declined();
        } else {
            // each prediction goes to the device of its layer: this device's to its own rules, the next device's
            // first layers to that device's (LayerDecider::prefetch_ahead), as the engine does
            preds_by_dev_.resize(devs_.size());
            for (auto & v : preds_by_dev_) v.clear();
            for (const Prediction & p : preds_) preds_by_dev_[(size_t) dev_of_[(size_t) p.layer]].push_back(p);
            const int own = dev_of_[(size_t) l];
            if (decider.wants_prefetch(L_)) {
                decider.prefetch(preds_by_dev_[(size_t) own], L_, *this, nullptr);
                res_.prefetch_declined += decider.prefetch_declined();
            }
            for (size_t o = 0; o < devs_.size(); ++o) {
                if ((int) o == own || preds_by_dev_[o].empty() || !devs_[o].decider->prefetches()) continue;
                Link & link = links_[(size_t) devs_[o].link];
                devs_[o].decider->prefetch_ahead(cur_step_, l, n, K_, t_moe_, std::max(0.0, link.est_free_at - t_moe_),
                                                 preds_by_dev_[o], L_, *this, nullptr);
                res_.prefetch_declined += devs_[o].decider->prefetch_declined();
                link.est_free_at = t_moe_ + devs_[o].decider->pcie_free_s();
            }
        }
        prefetch_ns_ += std::chrono::duration<double, std::nano>(clock::now() - p0).count();
    }
    decider.fills(*this, nullptr);
}

void SimRun::run_layer(int64_t si, const Step & st, int l) {
    const int n = static_cast<int>(st.end - st.begin);
    const double t_layer0 = t_;
    cur_step_ = si;
    cur_layer_ = l;
    if (ram_ && faulting_ && cfg_.ram.other_bytes > 0.0) t_ = other_in(l, t_);
    const double ne = dv(l).truth.layer(n) * truth_.gpu_scale * noise_.factor(truth_.layer_noise);
    res_.gpu_busy_s += ne;
    record(si, l, 1, -1, 4, t_, t_ + ne);
    t_moe_ = t_ + ne;
    cur_step_ = si;
    cur_layer_ = l;
    // Drop copy intervals that can no longer overlap CPU work.
    size_t keep = 0;
    while (keep < link_busy_.size() && link_busy_[keep].second < t_moe_) ++keep;
    link_busy_.erase(link_busy_.begin(), link_busy_.begin() + keep);

    const double predicted_s = decide(si, st, l, n);
    double t_gpu_end = charge_gpu(si, l, n);
    double t_cpu_end = charge_cpu(si, l);
    const double demand_copy_s = layer_copy_s_;
    prefetch_and_fill(st, l, n, predicted_s);
    if (ram_) ram_lookahead(st, l, n, predicted_s);
    LayerDecider & decider = *dv(l).decider;
    lk(l).est_free_at = t_moe_ + decider.pcie_free_s();
    res_.predicted_moe_s += decider.run_plan().makespan_s;  // with the copies queued after the plan
    // the prefetches and fills are queued before the CPU share runs too (the engine's order): on a host that pays
    // for copies they delay it as well (0 when copies cost the CPU nothing: the order of the draws and the
    // contention above stay as without the term)
    if (!cpu_order_.empty()) {
        const double late = truth_cost_.cpu_copy_blocking(layer_copy_s_ - demand_copy_s);
        res_.cpu_busy_s += late;
        t_cpu_end += late;
    }
    // and they are queued after the GPU share's launch: a device that cannot compute while it copies returns the
    // share's outputs after them
    if (!gpu_order_.empty()) t_gpu_end += dv(l).truth.copy_blocking(layer_copy_s_ - demand_copy_s);

    const double t_end = std::max(t_moe_, std::max(t_cpu_end, t_gpu_end));
    res_.charged_moe_s += t_end - t_moe_;
    res_.layer_moe_s[l] += t_end - t_moe_;
    decider.release(l);
    if (ram_) ram_release(l);
    const double layer_dur = t_end - t_layer0;
    layer_est_ = layer_est_ < 0.0 ? layer_dur : 0.8 * layer_est_ + 0.2 * layer_dur;
    t_ = t_end;
    ++layers_run_;
}

double SimRun::disk_move(double bytes, double t, int e, double fault_Bps) {
    // a free queue place (the earliest to free), the latency, then the bytes after every earlier read's bytes; a
    // fault's bytes at the measured fault throughput, which holds its latency already
    auto place = std::min_element(disk_places_.begin(), disk_places_.end());
    const double start = std::max(t, *place);
    const double bw = fault_Bps > 0.0 ? fault_Bps
                      : cfg_.ram.read_bandwidth_Bps > 0.0 ? cfg_.ram.read_bandwidth_Bps : truth_cost_.disk_bandwidth_Bps;
    const double move = bytes / bw;
    const double latency = fault_Bps > 0.0 ? 0.0 : truth_cost_.disk_latency_s;
    const double end = std::max(start + latency, disk_bytes_free_at_) + move;
    *place = end;
    disk_bytes_free_at_ = end;
    disk_est_free_at_ = std::max(disk_est_free_at_, t) + bytes / planner_.disk_bandwidth_Bps;
    res_.bytes_disk += bytes;
    res_.disk_busy_s += move;
    record(cur_step_, cur_layer_, 3, e, 6, start, end);
    return end;
}

double SimRun::disk_read(double bytes, double t, int e) {
    const double end = disk_move(bytes, t, e);
    read_cpu_debt_s_ += bytes * cfg_.ram.read_cpu_s_per_byte;
    ++res_.disk_reads;
    return end;
}

double SimRun::fault_in(int l, int e, double t) {
    // The read-around of a fault (filemap_fault, Linux mm/filemap.c): one request for a window of read_around x
    // the expert's bytes centred on it, over its neighbours in the file (the experts next to it in each
    // ffn_*_exps tensor), read in file order. The touching thread waits for its own expert's pages only, one
    // fault of fault_bytes after another (each paying the latency); the rest of the window arrives on the disk's
    // timeline. The neighbours mostly inside the window that are not in RAM join the page cache as read-ahead;
    // the window's part-experts, and what runs past the tensor's ends, are waste.
    const double bytes = trace_.expert_bytes[(size_t) l];
    const double fbw = step_fault_Bps();
    const double side = 0.5 * (cfg_.ram.read_around - 1.0);
    const int whole = static_cast<int>(std::lround(side));  // a neighbour mostly inside the window is read whole
    const double own = bytes * std::max(0.0, 1.0 + 2.0 * (side - whole));
    double window = 0.0, own_end = t;
    for (int n = e - whole; n <= e + whole; ++n) {
        if (n == e) {
            own_end = disk_move(own, t, e, fbw);
            window += own;
        } else if (n < 0 || n >= E_) {
            disk_move(bytes, t, -1, fbw);  // the window runs into the next tensor's bytes
            window += bytes;
        } else if (!ram_->resident(l, n) && transient_tick_[(size_t) l * E_ + n] != tick()) {
            const double end = disk_move(bytes, t, n, fbw);
            window += bytes;
            if (cfg_.ram.keep) ram_->admit_read_ahead(l, n, end);
        }
    }
    const double own_faults = std::max(1.0, std::ceil(bytes / cfg_.ram.fault_bytes));
    res_.page_faults += static_cast<int64_t>(std::max(own_faults, std::ceil(window / cfg_.ram.fault_bytes)));
    ++res_.disk_reads;
    return own_end + (fbw > 0.0 ? 0.0 : (own_faults - 1.0) * truth_cost_.disk_latency_s);
}

void SimRun::read_ahead_after(int l, int n, double t) {
    // The kernel's asynchronous read-ahead (page_cache_async_ra, Linux mm/readahead.c): touching a page that an
    // earlier read brought ahead of use reads the next window after it, and nobody waits for it. Here the window
    // of read_around experts after the run of RAM-resident experts that follows n, when that run is shorter than
    // a window (beyond, the marked page is not reached yet). A sweep through a tensor (a prefill's CPU share)
    // keeps the disk reading ahead of the compute; in decode it mostly reads experts no token uses. A decode's
    // measured fault throughput counts these bytes too (all the kernel read over the time faulting), so in a
    // decode step they move at it; a prefill's move as queued reads.
    if (!cfg_.ram.keep) return;
    const int win = 2 * static_cast<int>(std::lround(0.5 * (cfg_.ram.read_around - 1.0))) + 1;
    if (win <= 1) return;
    int j = n + 1;
    while (j < E_ && j - n <= win && ram_->resident(l, j)) ++j;
    if (j >= E_ || j - n > win) return;
    const double bytes = trace_.expert_bytes[(size_t) l];
    bool read = false;
    for (int k = j; k < std::min(E_, j + win); ++k) {
        if (ram_->resident(l, k) || transient_tick_[(size_t) l * E_ + k] == tick()) continue;
        ram_->admit_read_ahead(l, k, disk_move(bytes, t, k, step_fault_Bps()));
        read = true;
    }
    if (read) ++res_.disk_reads;
}

double SimRun::other_in(int l, double t) {
    // An LRU page cache still holds the layer's other weights while fewer bytes entered it since the layer last
    // ran than it holds (their reuse distance); else they are read again, sequentially, before the layer runs.
    const double other = cfg_.ram.other_bytes;
    double & last = other_touch_[(size_t) l];
    double ready = t;
    if (res_.bytes_disk - last > ram_->budget_bytes() + static_cast<double>(L_) * other) {
        ready = disk_move(other, t, -1, step_fault_Bps());
        res_.page_faults += static_cast<int64_t>(std::ceil(other / cfg_.ram.fault_bytes));
        ++res_.disk_reads;
    }
    last = res_.bytes_disk;
    return ready;
}

double SimRun::ram_ready(int l, int e, double t) {
    const size_t key = (size_t) l * E_ + e;
    if (ram_->resident(l, e)) return ram_->ready_s(l, e);
    if (transient_tick_[key] == tick()) return transient_ready_[key];
    if (faulting_) return -1.0;
    const double end = disk_read(trace_.expert_bytes[(size_t) l], t, e);
    ram_keep(l, e, end, l != cur_layer_);
    return end;
}

double SimRun::ram_use(int l, int e, double t) {
    last_ram_access_ = ram_->access(l, e, t);
    const double ready = ram_ready(l, e, t);
    if (ram_->resident(l, e)) {
        ram_->pin(l, e);
        ram_pinned_.push_back(e);
    }
    return ready;
}

void SimRun::ram_keep(int l, int e, double end, bool by_prefetch) {
    // a bypassing policy (Belady) may refuse a read for this use: refusing costs nothing here (the read serves
    // the use either way), unlike a GPU demand load, which a refusal moves to the CPU
    const bool demand = !by_prefetch && !ram_->policy().bypass();
    if (cfg_.ram.keep && ram_->admit(l, e, end, by_prefetch, demand)) {
        ram_->set_ready(l, e, end);
        return;
    }
    const size_t key = (size_t) l * E_ + e;
    transient_tick_[key] = tick();
    transient_ready_[key] = end;
}

void SimRun::ram_lookahead(const Step & st, int l, int n, double predicted_s) {
    const int depth = std::min(cfg_.ram.lookahead, L_ - 1 - l);
    if (depth <= 0 || faulting_) return;
    // Reads ahead use the disk's idle time only: one is queued when the planner expects it to end before this
    // layer's work does (its plan, or its own reads when they end later) and the next layer's experts start,
    // so it never delays the next layer's reads, which are queued behind it.
    const double horizon = std::max(t_moe_ + predicted_s, layer_disk_est_) + planner_.layer(n);
    // the engine's rule (RamTier::prefetch): a read its layer needs anyway passes admission as a demand read
    const bool certain = expert_use_prior(K_, E_, n) >= kCertainUse;
    for (int d = 1; d <= depth; ++d) {
        const int j = l + d;
        ram_predictor_.predict(trace_.row(st.begin, j), static_cast<int64_t>(L_) * K_, n, K_, E_, d, ram_pred_);
        ram_order_.resize(ram_pred_.experts.size());
        for (size_t i = 0; i < ram_order_.size(); ++i) ram_order_[i] = static_cast<int32_t>(i);
        std::sort(ram_order_.begin(), ram_order_.end(), [&](int32_t a, int32_t b) {
            if (ram_pred_.loads[a] != ram_pred_.loads[b]) return ram_pred_.loads[a] > ram_pred_.loads[b];
            return ram_pred_.experts[a] < ram_pred_.experts[b];
        });
        const double bytes = trace_.expert_bytes[(size_t) j];
        for (int32_t i : ram_order_) {
            const int32_t e = ram_pred_.experts[i];
            // a GPU resident needs no RAM, unless its copy waits for its first use (a fill while it was on disk)
            if ((dv(j).cache->resident(j, e) && !deferred_[(size_t) j * E_ + e]) || ram_->resident(j, e)) continue;
            if (std::max(disk_est_free_at_, t_moe_) + planner_.disk_read(bytes) > horizon) break;
            if (!ram_->admit(j, e, t_moe_, true, certain)) continue;
            const double end = disk_read(bytes, t_moe_, e);
            ram_->set_ready(j, e, end);
            ram_->pin(j, e);
            ram_unpin_[(size_t) j].push_back(e);
            res_.bytes_disk_prefetch += bytes;
            ++res_.ram_prefetch_issued;
        }
    }
}

void SimRun::ram_release(int l) {
    for (int32_t e : ram_pinned_) ram_->unpin(l, e);
    for (int32_t e : ram_unpin_[(size_t) l]) ram_->unpin(l, e);
    if (cfg_.ram.exclusive && !large_ubatch_) {  // what the GPU holds now gives up its RAM slot (exclusive tiers)
        for (const auto * list : {&ram_pinned_, &ram_unpin_[(size_t) l]}) {
            for (int32_t e : *list) {
                if (gives_up_ram(l, e) && !ram_->pinned(l, e)) ram_->evict(l, e);
            }
        }
    }
    ram_pinned_.clear();
    ram_unpin_[(size_t) l].clear();
}

void SimRun::evicted(const std::vector<int64_t> & keys) {
    if (!ram_ || !cfg_.ram.exclusive || large_ubatch_) return;
    for (int64_t key : keys) {
        const int l = static_cast<int>(key / E_), e = static_cast<int>(key % E_);
        if (deferred_[(size_t) key]) {  // never copied to the GPU: nothing to copy back
            deferred_[(size_t) key] = 0;
            continue;
        }
        if (ram_->resident(l, e)) continue;
        // demotion: the copy back runs on the link's device-to-host direction, its own queue (PCIe is full
        // duplex; a GPU with two copy engines copies both ways at once), from the layer's start
        const double bytes = trace_.expert_bytes[(size_t) l];
        Link & link = lk(l);
        const double start = std::max(link.d2h_free_at, t_moe_);
        const double end = start + dv(l).truth.h2d(bytes) * truth_.h2d_scale;
        if (!ram_->admit_demoted(l, e, end)) continue;  // ranks below the RAM tier's victim: dropped
        link.d2h_free_at = end;
        res_.bytes_demoted += bytes;
        ++res_.demotions;
        record(cur_step_, cur_layer_, 2, e, 7, start, end);
    }
}

void SimRun::run_step(int64_t si, const Step & st) {
    const int n = static_cast<int>(st.end - st.begin);
    large_ubatch_ = expert_use_prior(K_, E_, n) >= 0.5;  // a prefill ubatch: every expert likely used
    if (st.prompt != current_prompt_) {
        if (current_prompt_ >= 0) ttft_sum_ += t_ - prompt_start_;
        current_prompt_ = st.prompt;
        prompt_start_ = t_;
        ++res_.prompts;
    }
    for (int d = 0; d < trace_.n_dense_layers; ++d) {
        const double dur = truth_cost_.dense(n) * truth_.gpu_scale * noise_.factor(truth_.layer_noise);
        res_.gpu_busy_s += dur;
        t_ += dur;
    }
    for (int l = 0; l < L_; ++l) run_layer(si, st, l);
    res_.tokens += n;
    ++res_.steps;
}

SimResult SimRun::run(const std::vector<Step> & steps) {
    for (size_t si = 0; si < steps.size(); ++si) run_step(static_cast<int64_t>(si), steps[si]);
    if (current_prompt_ >= 0) ttft_sum_ += t_ - prompt_start_;
    SimResult res = std::move(res_);
    const double t = t_;
    res.total_s = t;
    res.cache = CacheStats{};
    for (size_t d = 0; d < devs_.size(); ++d) {
        const CacheStats & c = devs_[d].cache->stats();
        res.device_cache[d] = c;
        res.cache.accesses += c.accesses;
        res.cache.demand_hits += c.demand_hits;
        res.cache.prefetch_hits += c.prefetch_hits;
        res.cache.misses += c.misses;
        res.cache.late += c.late;
        res.cache.admissions += c.admissions;
        res.cache.evictions += c.evictions;
        res.cache.declined += c.declined;
    }
    if (ram_) res.ram_cache = ram_->stats();
    res.prefetch_used = res.cache.prefetch_hits;
    res.bytes_h2d = res.bytes_demand + res.bytes_prefetch + res.bytes_fill;
    res.tokens_per_s = t > 0.0 ? double(res.tokens) / t : 0.0;
    if (cfg_.stage == "decode") {
        res.tpot_s = res.tokens ? t / double(res.tokens) : 0.0;
    } else {
        res.ttft_s = res.prompts ? ttft_sum_ / double(res.prompts) : 0.0;
    }
    if (res.steps > 0) {
        for (double & v : res.layer_moe_s) v /= double(res.steps);
    }
    if (layers_run_ > 0) {
        res.decision_us_mean = decision_ns_ / 1e3 / double(layers_run_);
        res.prefetch_us_mean = prefetch_ns_ / 1e3 / double(layers_run_);
    }
    return res;
}

}  // namespace

SimResult simulate(const Trace & trace, ExpertCache & cache, SchedulePolicy & scheduler, PrefetchPolicy & prefetcher,
                   const CostModel & planner, const CostModel & truth_cost, const TruthModel & truth,
                   const SimConfig & cfg, int first_prompt, int end_prompt, ExpertCache * ram) {
    SimDevice d;
    d.cache = &cache;
    d.scheduler = &scheduler;
    d.prefetcher = &prefetcher;
    d.planner = planner;
    d.truth = truth_cost;
    return simulate_devices(trace, {d}, {}, false, truth, cfg, first_prompt, end_prompt, ram);
}

SimResult simulate_devices(const Trace & trace, const std::vector<SimDevice> & devices,
                           const std::vector<int> & layer_device, bool shared_link, const TruthModel & truth,
                           const SimConfig & cfg, int first_prompt, int end_prompt, ExpertCache * ram) {
    cfg.validate();
    truth.validate();
    if (devices.empty()) throw std::invalid_argument("simulate: at least one device");
    for (size_t i = 0; i < devices.size(); ++i) {
        const SimDevice & d = devices[i];
        if (!d.cache || !d.scheduler || !d.prefetcher) {
            throw std::invalid_argument("simulate: device " + std::to_string(i) + " lacks a cache or a policy");
        }
        d.planner.validate();
        d.truth.validate();
        check_cache_matches(trace, *d.cache);
        for (size_t j = 0; j < i; ++j) {
            if (devices[j].cache == d.cache) {
                throw std::invalid_argument("simulate: devices " + std::to_string(j) + " and " + std::to_string(i) +
                                            " share one ExpertCache; each device needs its own");
            }
        }
        if (ram == d.cache) throw std::invalid_argument("the RAM cache must be another ExpertCache than the GPU's");
    }
    std::vector<int> dev_of = layer_device;
    if (dev_of.empty()) dev_of.assign((size_t) trace.n_layers, 0);
    if ((int) dev_of.size() != trace.n_layers) {
        throw std::invalid_argument("simulate: layer_device has " + std::to_string(dev_of.size()) + " entries for " +
                                    std::to_string(trace.n_layers) + " MoE layers");
    }
    for (int d : dev_of) {
        if (d < 0 || d >= (int) devices.size()) {
            throw std::invalid_argument("simulate: layer_device entry " + std::to_string(d) + " is not one of the " +
                                        std::to_string(devices.size()) + " devices");
        }
    }
    const CostModel & planner = devices[0].planner;
    const CostModel & truth_cost = devices[0].truth;
    if (ram) {
        check_cache_matches(trace, *ram);
        if (!planner.has_disk() || !truth_cost.has_disk()) {
            throw std::invalid_argument("a RAM tier needs disk figures (disk_bandwidth_Bps > 0) in both the planner's "
                                        "and the truth's cost model");
        }
    }
    const std::vector<Step> steps = make_steps(trace, first_prompt, end_prompt, cfg);
    bool gpu_future = false;
    for (const SimDevice & d : devices) gpu_future = gpu_future || d.cache->policy().clairvoyant();
    const bool ram_future = ram && ram->policy().clairvoyant();
    if (gpu_future || ram_future) {
        const FutureAccesses future = build_future(trace, steps);
        for (const SimDevice & d : devices) {
            if (d.cache->policy().clairvoyant()) d.cache->policy().prepare(future);
        }
        if (ram_future) ram->policy().prepare(future);
    }
    for (const SimDevice & d : devices) d.cache->reset_stats();
    if (ram) ram->reset_stats();
    SimRun run(trace, devices, dev_of, shared_link, truth, cfg, ram);
    return run.run(steps);
}

namespace {

// The replay's side of the placement: slots are the cache's business only; first-use copies are the record's.
struct ReplayPlacement : ExpertPlacement {
    const DecisionRecord * rec = nullptr;
    std::vector<uint8_t> layer_runs;    // MoE layers the engine ran (it holds experts only for those)
    std::vector<double> layer_bytes;    // bytes of one expert per MoE layer (from the records)
    double load(int layer, int expert, Kind kind) override {
        if (kind == kFirstUse &&
            std::find(rec->first_use.begin(), rec->first_use.end(), expert) == rec->first_use.end()) {
            return 0.0;
        }
        return layer_bytes[(size_t) layer];
    }
    bool holds(int layer) const override {
        return layer >= 0 && layer < (int) layer_runs.size() && layer_runs[(size_t) layer];
    }
    // the record's view of the RAM tier
    double read_s(int, int & slots) const override {
        slots = rec->read_slots;
        return rec->on_disk.empty() ? 0.0 : rec->read_s;
    }
    bool on_disk(int, int expert) const override {
        for (size_t i = 0; i < rec->experts.size() && i < rec->on_disk.size(); ++i) {
            if (rec->experts[i] == expert) return rec->on_disk[i] != 0;
        }
        return false;
    }
};

template <typename T>
std::string list_str(const std::vector<T> & v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
}

std::string pairs_str(const std::vector<std::pair<int, int>> & v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) {
        s += (i ? ", (" : "(") + std::to_string(v[i].first) + ", " + std::to_string(v[i].second) + ")";
    }
    return s + "]";
}

}  // namespace

std::vector<DecisionRecord> replay_decisions(const std::vector<DecisionRecord> & log,
                                             std::shared_ptr<ExpertCache> cache,
                                             std::shared_ptr<SchedulePolicy> scheduler,
                                             std::shared_ptr<PrefetchPolicy> prefetcher, const CostModel & cost,
                                             const DeciderConfig & cfg) {
    if (!cache) throw std::invalid_argument("replay_decisions: a cache is required");
    const int L = cache->n_layers(), E = cache->n_experts();
    ReplayPlacement place;
    place.layer_runs.assign((size_t) L, 0);
    place.layer_bytes.assign((size_t) L, 0.0);
    for (size_t i = 0; i < log.size(); ++i) {
        const DecisionRecord & r = log[i];
        const std::string where = "replay_decisions: record " + std::to_string(i) + ": ";
        if (r.layer < 0 || r.layer >= L) {
            throw std::invalid_argument(where + "MoE layer " + std::to_string(r.layer) + " outside the cache's " +
                                        std::to_string(L) + " layers");
        }
        if (r.n_tokens < 1 || r.top_k < 1 || (!r.prefetch_only && r.ids.size() != (size_t) r.n_tokens * r.top_k)) {
            throw std::invalid_argument(where + "ids must be [n_tokens, top_k] with both >= 1");
        }
        if (!r.scores.empty() && r.scores.size() != (size_t) r.n_tokens * E) {
            throw std::invalid_argument(where + "scores must be [n_tokens, " + std::to_string(E) + "]");
        }
        for (int32_t id : r.ids) {
            if (id < 0 || id >= E) throw std::invalid_argument(where + "expert id " + std::to_string(id) + " out of range");
        }
        for (const Prediction & p : r.predictions) {
            if (p.layer <= r.layer || p.layer >= L) {
                throw std::invalid_argument(where + "a prediction for MoE layer " + std::to_string(p.layer) +
                                            ", not one after layer " + std::to_string(r.layer) + " (of " +
                                            std::to_string(L) + ")");
            }
            if (p.experts.size() != p.loads.size()) {
                throw std::invalid_argument(where + "a prediction's experts and loads differ in length");
            }
            for (int32_t e : p.experts) {
                if (e < 0 || e >= E) {
                    throw std::invalid_argument(where + "predicted expert " + std::to_string(e) + " out of range");
                }
            }
        }
        if (r.prefetch_only) continue;  // its layer is another device's: it holds nothing of it
        place.layer_runs[(size_t) r.layer] = 1;
        place.layer_bytes[(size_t) r.layer] = r.expert_bytes;
    }
    cache->set_record_evicted(true);
    cache->take_evicted();
    LayerDecider decider(cache, std::move(scheduler), std::move(prefetcher), cost, cfg);
    std::vector<DecisionRecord> out;
    out.reserve(log.size());
    std::vector<float> scores;
    for (const DecisionRecord & r : log) {
        DecisionRecord d;
        place.rec = &r;
        if (r.prefetch_only) {
            decider.prefetch_ahead(r.ubatch, r.layer, r.n_tokens, r.top_k, r.now_s, r.pcie_free_s, r.predictions, L,
                                   place, &d);
            out.push_back(std::move(d));
            continue;
        }
        scores = r.scores;  // the records stay as given
        decider.split(r.ubatch, r.layer, r.ids.data(), r.n_tokens, r.top_k, scores, r.expert_bytes, r.now_s,
                      r.pcie_free_s, place, &d);
        if (decider.wants_prefetch(L)) decider.prefetch(r.predictions, L, place, &d);
        decider.fills(place, &d);
        decider.release(r.layer);
        out.push_back(std::move(d));
    }
    return out;
}

std::string first_difference(const std::vector<DecisionRecord> & a, const std::vector<DecisionRecord> & b) {
    const size_t n = std::min(a.size(), b.size());
    for (size_t i = 0; i < n; ++i) {
        const DecisionRecord & x = a[i];
        const DecisionRecord & y = b[i];
        const std::string where = "record " + std::to_string(i) + " (ubatch " + std::to_string(x.ubatch) +
                                  ", MoE layer " + std::to_string(x.layer) + "): ";
        if (x.layer != y.layer || x.ubatch != y.ubatch) {
            return where + "the other log has ubatch " + std::to_string(y.ubatch) + ", MoE layer " +
                   std::to_string(y.layer);
        }
        if (x.experts != y.experts) return where + "experts: " + list_str(x.experts) + " vs " + list_str(y.experts);
        if (x.cached != y.cached) return where + "cached: " + list_str(x.cached) + " vs " + list_str(y.cached);
        if (x.ready_s != y.ready_s) return where + "ready_s: " + list_str(x.ready_s) + " vs " + list_str(y.ready_s);
        if (x.planned_gpu != y.planned_gpu) {
            return where + "planned_gpu: " + list_str(x.planned_gpu) + " vs " + list_str(y.planned_gpu);
        }
        if (x.makespan_s != y.makespan_s) {
            return where + "makespan_s: " + std::to_string(x.makespan_s) + " vs " + std::to_string(y.makespan_s);
        }
        if (x.loaded != y.loaded) return where + "loaded: " + list_str(x.loaded) + " vs " + list_str(y.loaded);
        if (x.declined != y.declined) return where + "declined: " + list_str(x.declined) + " vs " + list_str(y.declined);
        if (x.on_gpu != y.on_gpu) return where + "on_gpu: " + list_str(x.on_gpu) + " vs " + list_str(y.on_gpu);
        if (x.first_use != y.first_use) {
            return where + "first_use: " + list_str(x.first_use) + " vs " + list_str(y.first_use);
        }
        if (x.prefetched != y.prefetched) {
            return where + "prefetched: " + pairs_str(x.prefetched) + " vs " + pairs_str(y.prefetched);
        }
        if (x.filled != y.filled) return where + "filled: " + list_str(x.filled) + " vs " + list_str(y.filled);
        if (x.evicted != y.evicted) return where + "evicted: " + list_str(x.evicted) + " vs " + list_str(y.evicted);
    }
    if (a.size() != b.size()) {
        return "the logs have " + std::to_string(a.size()) + " and " + std::to_string(b.size()) + " records";
    }
    return "";
}

}  // namespace hybrimoe
