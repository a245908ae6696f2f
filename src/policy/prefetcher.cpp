#include "policy/prefetcher.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace hybrimoe {

TopKPrefetcher::TopKPrefetcher(int count) : count_(count) {
    if (count < 0) {
        throw std::invalid_argument("TopKPrefetcher: count must be >= 0, got " + std::to_string(count));
    }
}

std::vector<std::pair<int, int>> TopKPrefetcher::plan(const PrefetchContext & ctx, const ExpertCache & cache,
                                                      const CostModel &) {
    std::vector<std::pair<int, int>> out;
    for (const Prediction & p : ctx.predictions) {
        if (p.distance != 1) continue;
        std::vector<int32_t> idx(p.experts.size());
        std::iota(idx.begin(), idx.end(), 0);
        std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return p.loads[a] > p.loads[b]; });
        const int limit = count_ > 0 ? count_ : ctx.top_k;
        for (int32_t i : idx) {
            if (static_cast<int>(out.size()) >= limit) break;
            if (!cache.resident(p.layer, p.experts[i])) out.emplace_back(p.layer, p.experts[i]);
        }
    }
    return out;
}

ImpactPrefetcher::ImpactPrefetcher(int max_copies, int max_candidates, bool use_confidence, double waste_weight)
    : max_copies_(max_copies), max_candidates_(max_candidates), use_confidence_(use_confidence),
      waste_weight_(waste_weight) {
    if (max_copies < 0 || max_candidates < 1) {
        throw std::invalid_argument("ImpactPrefetcher: max_copies must be >= 0 and max_candidates >= 1");
    }
}

std::vector<std::pair<int, int>> ImpactPrefetcher::plan(const PrefetchContext & ctx, const ExpertCache & cache,
                                                        const CostModel & cost) {
    struct Candidate {
        double gain;
        int pred;     // index into ctx.predictions / inputs_
        int index;    // index into the layer input
        size_t round; // copies issued when `gain` was computed
    };
    std::vector<std::pair<int, int>> out;
    const size_t n_pred = ctx.predictions.size();
    inputs_.resize(n_pred);
    orders_.resize(n_pred);
    std::vector<double> base(n_pred, 0.0);
    std::vector<Candidate> heap;
    double pcie_free_at = ctx.pcie_free_at_s;

    // Makespan of prediction pi's layer if input i were (already) being copied behind the link.
    auto gain_of = [&](int pi, int i) {
        const Prediction & p = ctx.predictions[pi];
        LayerInput & in = inputs_[pi];
        const double copy_end = pcie_free_at + cost.h2d(p.expert_bytes);
        in.cached[i] = 1;
        in.ready_s[i] = std::max(0.0, copy_end - p.start_s);
        const double saved_free = in.pcie_free_s;
        in.pcie_free_s = std::max(0.0, copy_end - p.start_s);
        const double makespan = sched_.makespan(in, cost, orders_[pi]);
        ++evaluations_;
        in.pcie_free_s = saved_free;
        in.cached[i] = 0;
        in.ready_s[i] = 0.0;
        const double g = base[pi] - makespan;
        const double waste = waste_weight_ * (1.0 - p.confidence) * cost.h2d(p.expert_bytes);
        return (use_confidence_ ? g * p.confidence : g) - waste;
    };

    for (size_t pi = 0; pi < n_pred; ++pi) {
        const Prediction & p = ctx.predictions[pi];
        if (p.experts.size() != p.loads.size()) {
            throw std::invalid_argument("ImpactPrefetcher: prediction experts and loads differ in length");
        }
        LayerInput & in = inputs_[pi];
        in.layer = p.layer;
        in.n_tokens = ctx.n_tokens;
        in.expert_bytes = p.expert_bytes;
        in.pcie_free_s = std::max(0.0, pcie_free_at - p.start_s);
        in.experts = p.experts;
        in.loads = p.loads;
        in.cached.assign(p.experts.size(), 0);
        in.ready_s.assign(p.experts.size(), 0.0);
        for (size_t i = 0; i < p.experts.size(); ++i) {
            if (cache.resident(p.layer, p.experts[i])) {
                in.cached[i] = 1;
                in.ready_s[i] = std::max(0.0, cache.ready_s(p.layer, p.experts[i]) - p.start_s);
            }
        }
        if (in.experts.empty()) continue;
        // the loads stay as predicted below (only cache states change): one order serves every evaluation
        load_descending_order(in, orders_[pi]);
        base[pi] = sched_.makespan(in, cost, orders_[pi]);
        ++evaluations_;
        // Bounded candidate list: the highest predicted loads among the uncached.
        std::vector<int32_t> idx;
        for (size_t i = 0; i < in.size(); ++i) {
            if (!in.cached[i]) idx.push_back(static_cast<int32_t>(i));
        }
        std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return in.loads[a] > in.loads[b]; });
        if (static_cast<int>(idx.size()) > max_candidates_) idx.resize(max_candidates_);
        for (int32_t i : idx) {
            heap.push_back({gain_of(static_cast<int>(pi), i), static_cast<int>(pi), i, 0});
        }
    }
    auto less = [](const Candidate & a, const Candidate & b) { return a.gain < b.gain; };
    std::make_heap(heap.begin(), heap.end(), less);
    const int limit = max_copies_ > 0 ? max_copies_ : ctx.top_k;
    while (!heap.empty() && static_cast<int>(out.size()) < limit) {
        std::pop_heap(heap.begin(), heap.end(), less);
        Candidate c = heap.back();
        heap.pop_back();
        // lazy re-evaluation under the current link and cache state; both change only when a copy is issued, so a
        // gain computed since the last issue is current already (gain_of would return the same value)
        if (c.round != out.size()) {
            c.gain = gain_of(c.pred, c.index);
            c.round = out.size();
        }
        if (c.gain <= 0.0) continue;
        if (!heap.empty() && c.gain < heap.front().gain) {
            heap.push_back(c);
            std::push_heap(heap.begin(), heap.end(), less);
            continue;
        }
        const Prediction & p = ctx.predictions[c.pred];
        LayerInput & in = inputs_[c.pred];
        pcie_free_at += cost.h2d(p.expert_bytes);
        in.cached[c.index] = 1;
        in.ready_s[c.index] = std::max(0.0, pcie_free_at - p.start_s);
        in.pcie_free_s = std::max(0.0, pcie_free_at - p.start_s);
        base[c.pred] = sched_.makespan(in, cost, orders_[c.pred]);
        ++evaluations_;
        out.emplace_back(p.layer, p.experts[c.index]);
    }
    return out;
}

std::shared_ptr<PrefetchPolicy> make_prefetcher(const std::string & name) {
    if (name == "none") return std::make_shared<NoPrefetcher>();
    if (name == "topk" || name == "next-layer-topk") return std::make_shared<TopKPrefetcher>();
    if (name == "impact") return std::make_shared<ImpactPrefetcher>();
    throw std::invalid_argument("unknown prefetcher '" + name + "' (known: none, topk, impact)");
}

}  // namespace hybrimoe
