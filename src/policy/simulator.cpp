#include "policy/simulator.h"

#include <algorithm>
#include <chrono>
#include <functional>
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
        for (int64_t s = b; s < e; s += chunk) {
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

SimResult simulate(const Trace & trace, ExpertCache & cache, SchedulePolicy & scheduler, PrefetchPolicy & prefetcher,
                   const CostModel & planner, const CostModel & truth_cost, const TruthModel & truth,
                   const SimConfig & cfg, int first_prompt, int end_prompt) {
    cfg.validate();
    truth.validate();
    planner.validate();
    truth_cost.validate();
    check_cache_matches(trace, cache);
    const std::vector<Step> steps = make_steps(trace, first_prompt, end_prompt, cfg);
    if (cache.policy().clairvoyant()) cache.policy().prepare(build_future(trace, steps));
    cache.reset_stats();

    using clock = std::chrono::steady_clock;
    const int L = trace.n_layers, K = trace.top_k, E = trace.n_experts;
    TracePredictor predictor(cfg.recall, cfg.predictor_seed);
    Noise noise(truth.seed);
    SimResult res;
    res.stage = cfg.stage;
    res.layer_moe_s.assign(L, 0.0);

    std::vector<int32_t> ids32;
    std::vector<float> scores;
    std::vector<double> truth_ready((size_t) L * E, 0.0);  // key -> true end of its last copy (0: from the start)
    std::vector<std::pair<double, double>> link_busy;       // copy intervals, in start order
    double t = 0.0, true_pcie_free_at = 0.0, pcie_free_at = 0.0, layer_est = -1.0;
    double decision_ns = 0.0, prefetch_ns = 0.0;
    int64_t layers_run = 0;
    int current_prompt = -1;
    double prompt_start = 0.0, ttft_sum = 0.0;
    int64_t cur_step = 0;
    int cur_layer = 0;
    double t_moe = 0.0;

    auto record = [&](int64_t si, int l, int resource, int expert, int kind, double a, double b) {
        if (static_cast<int64_t>(si) == cfg.timeline_step && l < cfg.timeline_layers) {
            res.timeline.push_back({si, l, resource, expert, kind, a, b});
        }
    };

    // The engine's decision rules (LayerDecider) decide; this placement charges each copy they queue on the link
    // under the truth model. The initial fill is resident from the start (no first-use copies here).
    struct TruthPlacement : ExpertPlacement {
        std::function<double(int, int, Kind)> on_load;
        double load(int layer, int expert, Kind kind) override { return on_load(layer, expert, kind); }
        bool holds(int) const override { return true; }
    } place;
    double charge_ns = 0.0;  // time spent charging copies inside a timed decision (not part of deciding)
    double layer_copy_s = 0.0;  // true copy time queued for the current layer (loads, prefetches, fills)
    place.on_load = [&](int layer, int e, ExpertPlacement::Kind kind) -> double {
        if (kind == ExpertPlacement::kFirstUse) return 0.0;
        const auto c0 = clock::now();
        const double bytes = trace.expert_bytes[(size_t) layer];
        const double start = std::max(true_pcie_free_at, t_moe);
        const double end = start + truth_cost.h2d(bytes) * truth.h2d_scale * noise.factor(truth.h2d_noise);
        res.link_busy_s += end - start;
        layer_copy_s += end - start;
        true_pcie_free_at = end;
        link_busy.emplace_back(start, end);
        truth_ready[(size_t) layer * E + e] = end;
        int tl_kind = 1;
        if (kind == ExpertPlacement::kDemand) {
            res.bytes_demand += bytes;
        } else if (kind == ExpertPlacement::kPrefetch) {
            res.bytes_prefetch += bytes;
            ++res.prefetch_issued;
            tl_kind = 2;
        } else {
            res.bytes_fill += bytes;
            tl_kind = 3;
        }
        record(cur_step, cur_layer, 2, e, tl_kind, start, end);
        charge_ns += std::chrono::duration<double, std::nano>(clock::now() - c0).count();
        return bytes;
    };
    DeciderConfig dcfg;
    dcfg.has_slots = cache.budget_bytes() > 0.0;
    dcfg.prefetch_layers = cfg.prefetch_depth;
    dcfg.fill_on_miss = cfg.fill_on_miss;
    // the caller owns the policies: non-owning handles for the rules
    LayerDecider decider(std::shared_ptr<ExpertCache>(&cache, [](ExpertCache *) {}),
                         std::shared_ptr<SchedulePolicy>(&scheduler, [](SchedulePolicy *) {}),
                         std::shared_ptr<PrefetchPolicy>(&prefetcher, [](PrefetchPolicy *) {}), planner, dcfg);
    std::vector<Prediction> preds;
    std::vector<int32_t> gpu_order, cpu_order, pos(E, -1);

    for (size_t si_u = 0; si_u < steps.size(); ++si_u) {
        const int64_t si = static_cast<int64_t>(si_u);
        const Step & st = steps[si_u];
        const int n = static_cast<int>(st.end - st.begin);
        if (st.prompt != current_prompt) {
            if (current_prompt >= 0) ttft_sum += t - prompt_start;
            current_prompt = st.prompt;
            prompt_start = t;
            ++res.prompts;
        }
        for (int d = 0; d < trace.n_dense_layers; ++d) {
            const double dur = truth_cost.dense(n) * truth.gpu_scale * noise.factor(truth.layer_noise);
            res.gpu_busy_s += dur;
            t += dur;
        }
        for (int l = 0; l < L; ++l) {
            const double t_layer0 = t;
            const double ne = truth_cost.layer(n) * truth.gpu_scale * noise.factor(truth.layer_noise);
            res.gpu_busy_s += ne;
            record(si, l, 1, -1, 4, t, t + ne);
            t_moe = t + ne;
            cur_step = si;
            cur_layer = l;
            // Drop copy intervals that can no longer overlap CPU work.
            size_t keep = 0;
            while (keep < link_busy.size() && link_busy[keep].second < t_moe) ++keep;
            link_busy.erase(link_busy.begin(), link_busy.begin() + keep);

            // ---- decision (timed): observe, look up, split, demand loads, as the engine decides ----
            const auto d0 = clock::now();
            charge_ns = 0.0;
            layer_copy_s = 0.0;
            load_routing(trace, st, l, ids32, scores);
            const std::vector<uint8_t> & on_gpu =
                decider.split(si, l, ids32.data(), n, K, scores,
                              trace.expert_bytes[(size_t) l], t_moe, std::max(0.0, pcie_free_at - t_moe), place, nullptr);
            decision_ns += std::chrono::duration<double, std::nano>(clock::now() - d0).count() - charge_ns;
            const LayerInput & din = decider.input();
            const SchedulePlan & plan = decider.plan();
            const double predicted_s = decider.run_plan().makespan_s;
            for (size_t i = 0; i < din.size(); ++i) pos[din.experts[i]] = static_cast<int32_t>(i);
            // execution order: the plan's; a load the cache refused runs on the CPU, after the planned CPU experts
            gpu_order.clear();
            cpu_order.assign(plan.cpu_experts.begin(), plan.cpu_experts.end());
            for (int32_t e : plan.gpu_experts) (on_gpu[pos[e]] ? gpu_order : cpu_order).push_back(e);

            // ---- truth: GPU ----
            double t_gpu_end = t_moe;
            if (!gpu_order.empty()) {
                // a device that cannot compute while it copies works through the queued copies first
                const double blocked = truth_cost.copy_blocking(std::max(0.0, true_pcie_free_at - t_moe));
                double tg = t_moe + blocked + truth_cost.act(n) * noise.factor(truth.act_noise);
                record(si, l, 1, -1, 5, t_moe, tg);
                for (int32_t e : gpu_order) {
                    const double s0 = std::max(tg, truth_ready[(size_t) l * E + e]);
                    const double dur = truth_cost.gpu(din.loads[pos[e]]) * truth.gpu_scale * noise.factor(truth.gpu_noise);
                    tg = s0 + dur;
                    res.gpu_busy_s += dur;
                    record(si, l, 1, e, 0, s0, tg);
                }
                t_gpu_end = tg;
            }
            // ---- truth: CPU ----
            double t_cpu_end = t_moe;
            if (!cpu_order.empty()) {
                // the layer's loads, queued before its CPU share runs, delay it on a host that pays for copies
                double tc = t_moe + truth_cost.cpu_copy_blocking(layer_copy_s) + truth_cost.cpu_startup_s +
                            truth.cpu_startup_extra_s;
                for (int32_t e : cpu_order) {
                    double dur = truth_cost.cpu(din.loads[pos[e]]) * truth.cpu_scale * noise.factor(truth.cpu_noise);
                    if (truth.contention > 0.0) {
                        double overlap = 0.0;
                        for (const auto & iv : link_busy) {
                            overlap += std::max(0.0, std::min(tc + dur, iv.second) - std::max(tc, iv.first));
                        }
                        dur += truth.contention * overlap;
                    }
                    record(si, l, 0, e, 0, tc, tc + dur);
                    tc += dur;
                }
                res.cpu_busy_s += tc - t_moe;
                t_cpu_end = tc;
            }
            // ---- prefetch for the next D layers (planned after this layer's router), then fills ----
            const double demand_copy_s = layer_copy_s;
            if (decider.wants_prefetch(L)) {
                const auto p0 = clock::now();
                if (layer_est < 0.0) layer_est = planner.layer(n) + predicted_s;
                const int depth = std::min(cfg.prefetch_depth, L - 1 - l);
                preds.resize(static_cast<size_t>(depth));
                for (int d = 1; d <= depth; ++d) {
                    Prediction & p = preds[static_cast<size_t>(d - 1)];
                    const int j = l + d;
                    predictor.predict(trace.row(st.begin, j), static_cast<int64_t>(L) * K, n, K, E, d, p);
                    p.layer = j;
                    p.expert_bytes = trace.expert_bytes[j];
                    p.start_s = predicted_s + (double(d) - 1.0) * layer_est + planner.layer(n);
                }
                decider.prefetch(preds, L, place, nullptr);
                res.prefetch_declined += decider.prefetch_declined();
                prefetch_ns += std::chrono::duration<double, std::nano>(clock::now() - p0).count();
            }
            decider.fills(place, nullptr);
            pcie_free_at = t_moe + decider.pcie_free_s();
            res.predicted_moe_s += decider.run_plan().makespan_s;  // with the copies queued after the plan
            // the prefetches and fills are queued before the CPU share runs too (the engine's order): on a host that
            // pays for copies they delay it as well (0 when copies cost the CPU nothing: the order of the draws
            // and the contention above stay as without the term)
            if (!cpu_order.empty()) {
                const double late = truth_cost.cpu_copy_blocking(layer_copy_s - demand_copy_s);
                res.cpu_busy_s += late;
                t_cpu_end += late;
            }
            // and they are queued after the GPU share's launch: a device that cannot compute while it copies
            // returns the share's outputs after them
            if (!gpu_order.empty()) t_gpu_end += truth_cost.copy_blocking(layer_copy_s - demand_copy_s);

            const double t_end = std::max(t_moe, std::max(t_cpu_end, t_gpu_end));
            res.charged_moe_s += t_end - t_moe;
            res.layer_moe_s[l] += t_end - t_moe;

            decider.release(l);

            const double layer_dur = t_end - t_layer0;
            layer_est = layer_est < 0.0 ? layer_dur : 0.8 * layer_est + 0.2 * layer_dur;
            t = t_end;
            ++layers_run;
        }
        res.tokens += n;
        ++res.steps;
    }
    if (current_prompt >= 0) ttft_sum += t - prompt_start;
    res.total_s = t;
    res.cache = cache.stats();
    res.prefetch_used = res.cache.prefetch_hits;
    res.bytes_h2d = res.bytes_demand + res.bytes_prefetch + res.bytes_fill;
    res.tokens_per_s = t > 0.0 ? double(res.tokens) / t : 0.0;
    if (cfg.stage == "decode") {
        res.tpot_s = res.tokens ? t / double(res.tokens) : 0.0;
    } else {
        res.ttft_s = res.prompts ? ttft_sum / double(res.prompts) : 0.0;
    }
    if (res.steps > 0) {
        for (double & v : res.layer_moe_s) v /= double(res.steps);
    }
    if (layers_run > 0) {
        res.decision_us_mean = decision_ns / 1e3 / double(layers_run);
        res.prefetch_us_mean = prefetch_ns / 1e3 / double(layers_run);
    }
    return res;
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
        if (r.n_tokens < 1 || r.top_k < 1 || r.ids.size() != (size_t) r.n_tokens * r.top_k) {
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
