// Decision-time benchmark of the policy core: per MoE layer, the HybriMoE split plus the MRS
// cache update, for decode (64 experts, top-6) and a 512-token prefill ubatch (160 experts, top-6); impact-driven
// prefetch planning (D = 3) reported separately. Run by bench/bench_policy.py, also under callgrind.
//
// usage: bench_policy MODE ITERATIONS [CACHE [EXPERTS]]   (MODE: decode | prefill | prefetch; decode-fill /
//        prefill-fill also offer every CPU-computed miss to the cache: the worst case of the simulator's idle-link
//        fills; CACHE: a cache policy name, mrs (default) or reuse, ...; EXPERTS: routed experts per layer, default
//        64 in decode and 160 in prefill)
// prints: MODE iterations ns_per_layer
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "policy/expert_cache.h"
#include "policy/prefetcher.h"
#include "policy/scheduler.h"

using namespace hybrimoe;

namespace {

struct Workload {
    int n_layers, n_experts, top_k, n_tokens;
    std::vector<std::vector<int32_t>> ids;  // per prepared layer instance: [n_tokens * top_k]
};

// Skewed routing (hot experts more likely), distinct per token; prepared up front so the timed loop only decides.
Workload make_workload(int n_layers, int n_experts, int top_k, int n_tokens, int instances, uint64_t seed) {
    Workload w{n_layers, n_experts, top_k, n_tokens, {}};
    std::mt19937_64 rng(seed);
    std::vector<double> weight(n_experts);
    for (int e = 0; e < n_experts; ++e) weight[e] = 1.0 / (1.0 + 0.1 * e);
    std::discrete_distribution<int> pick(weight.begin(), weight.end());
    for (int i = 0; i < instances; ++i) {
        std::vector<int32_t> ids;
        for (int t = 0; t < n_tokens; ++t) {
            std::vector<int32_t> row;
            while (static_cast<int>(row.size()) < top_k) {
                const int e = pick(rng);
                bool dup = false;
                for (int x : row) dup |= x == e;
                if (!dup) row.push_back(e);
            }
            ids.insert(ids.end(), row.begin(), row.end());
        }
        w.ids.push_back(std::move(ids));
    }
    return w;
}

CostModel paper_like_costs() {
    // Numbers of the paper-a6000 preset for DeepSeek-V2-Lite (hybrimoe/presets/paper-a6000.json, rounded).
    CostModel c;
    c.cpu_a_s = 98.6e-6;
    c.cpu_b_s = 49.4e-6;
    c.cpu_startup_s = 20e-6;
    c.gpu_a_s = 26.7e-6;
    c.gpu_b_s = 0.89e-6;
    c.h2d_bandwidth_Bps = 12e9;
    c.h2d_latency_s = 10e-6;
    c.act_a_s = 20e-6;
    c.act_b_s = 1.4e-9;
    return c;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 3 || argc > 5) {
        std::fprintf(stderr, "usage: %s decode|prefill|prefetch ITERATIONS [CACHE [EXPERTS]]\n", argv[0]);
        return 2;
    }
    const std::string cache_name = argc > 3 ? argv[3] : "mrs";
    std::string mode = argv[1];
    const bool fill_all = mode.size() > 5 && mode.compare(mode.size() - 5, 5, "-fill") == 0;
    if (fill_all) mode.resize(mode.size() - 5);
    const long iters = std::atol(argv[2]);
    if ((mode != "decode" && mode != "prefill" && mode != "prefetch") || iters < 0) {
        std::fprintf(stderr, "bad mode or iterations\n");
        return 2;
    }
    const bool prefill = mode == "prefill";
    const int n_layers = 26, n_experts = argc > 4 ? std::atoi(argv[4]) : prefill ? 160 : 64, top_k = 6,
              n_tokens = prefill ? 512 : 1;
    if (n_experts < top_k) {
        std::fprintf(stderr, "EXPERTS must be at least top_k (6)\n");
        return 2;
    }
    const Workload w = make_workload(n_layers, n_experts, top_k, n_tokens, prefill ? 64 : 1024, 42);
    const double expert_bytes = 6.3e6;
    std::shared_ptr<CachePolicy> policy;
    try {
        policy = make_cache_policy(cache_name);
    } catch (const std::exception & e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 2;
    }
    ExpertCache cache(std::vector<double>(n_layers, expert_bytes), n_experts,
                      0.25 * n_layers * n_experts * expert_bytes, policy);
    std::vector<int64_t> fill;
    for (int64_t k = 0; k < static_cast<int64_t>(n_layers) * n_experts; ++k) fill.push_back(k);
    cache.fill(fill);
    const CostModel cost = paper_like_costs();
    HybriMoEScheduler sched;
    ImpactPrefetcher prefetcher;
    LayerInput in;
    SchedulePlan plan;
    LayerObservation obs;
    PrefetchContext ctx;
    ctx.top_k = top_k;
    ctx.n_tokens = n_tokens;
    ctx.predictions.resize(3);
    double sink = 0.0;
    std::vector<int32_t> misses;

    const auto t0 = std::chrono::steady_clock::now();
    for (long it = 0; it < iters; ++it) {
        const int l = static_cast<int>(it % n_layers);
        const std::vector<int32_t> & ids = w.ids[it % w.ids.size()];
        if (mode == "prefetch") {
            // Impact-driven planning over the next 3 layers, predictions = the prepared routings.
            ctx.layer = l;
            for (int d = 0; d < 3; ++d) {
                Prediction & p = ctx.predictions[d];
                LayerInput tmp;
                tmp.set_routing(w.ids[(it + d + 1) % w.ids.size()].data(), n_tokens, top_k, n_experts);
                p.layer = (l + d + 1) % n_layers;
                p.distance = d + 1;
                p.confidence = 0.8 - 0.15 * d;
                p.start_s = 300e-6 * (d + 1);
                p.expert_bytes = expert_bytes;
                p.experts = tmp.experts;
                p.loads = tmp.loads;
            }
            sink += static_cast<double>(prefetcher.plan(ctx, cache, cost).size());
            continue;
        }
        // split + cache update of one layer
        in.layer = l;
        in.set_routing(ids.data(), n_tokens, top_k, n_experts);
        in.expert_bytes = expert_bytes;
        obs.set_routed(l, n_tokens, top_k, n_experts, in.experts, in.loads);
        cache.observe(obs);
        for (size_t i = 0; i < in.size(); ++i) {
            cache.access(l, in.experts[i]);
            cache.pin(l, in.experts[i]);
            in.cached[i] = cache.resident(l, in.experts[i]);
        }
        sched.plan(in, cost, plan);
        cache.admit_batch(l, plan.load_experts, {}, false);
        if (fill_all) {
            // worst case: every CPU-computed miss is offered too (the simulator's idle-link fill)
            misses.clear();
            for (int32_t e : plan.cpu_experts) {
                if (!cache.resident(l, e)) misses.push_back(e);
            }
            cache.admit_batch(l, misses, {}, false);
        }
        for (int32_t e : in.experts) cache.unpin(l, e);
        sink += plan.makespan_s;
    }
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%s%s %ld %.1f\n", mode.c_str(), fill_all ? "-fill" : "", iters, iters ? ns / iters : 0.0);
    if (sink < 0) std::printf("%f\n", sink);
    return 0;
}
