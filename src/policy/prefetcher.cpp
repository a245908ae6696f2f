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

ImpactPrefetcher::ImpactPrefetcher(int max_copies, int max_candidates, bool use_confidence, double waste_weight,
                                   bool share_equal)
    : max_copies_(max_copies), max_candidates_(max_candidates), use_confidence_(use_confidence),
      waste_weight_(waste_weight), share_equal_(share_equal) {
    if (max_copies < 0 || max_candidates < 1) {
        throw std::invalid_argument("ImpactPrefetcher: max_copies must be >= 0 and max_candidates >= 1");
    }
}

std::vector<std::pair<int, int>> ImpactPrefetcher::plan(const PrefetchContext & ctx, const ExpertCache & cache,
                                                        const CostModel & cost) {
    std::vector<std::pair<int, int>> out;
    const size_t n_pred = ctx.predictions.size();
    inputs_.resize(n_pred);
    orders_.resize(n_pred);
    evals_.resize(n_pred);
    base_.assign(n_pred, 0.0);
    version_.assign(n_pred, 0);
    known_.resize(n_pred);
    for (std::vector<Known> & k : known_) k.clear();
    heap_.clear();
    double pcie_free_at = ctx.pcie_free_at_s;

    // Net gain of copying input i of prediction pi next: the drop in that layer's makespan if i were (already)
    // being copied behind the link, weighted by the prediction's confidence, minus the expected waste. The
    // evaluator holds the layer as predicted with the copies issued so far; only i's state changes here.
    // The gain depends on the prediction's layer as the issued copies leave it (version_) and on how long the copy
    // would make it wait (wait): with both as at its last evaluation the gain is the same number, and the lazy
    // loop below takes it again instead of evaluating it again.
    auto wait_of = [&](int pi) {
        const Prediction & p = ctx.predictions[pi];
        const double copy_end = pcie_free_at + cost.h2d(p.expert_bytes);
        return std::max(0.0, copy_end - p.start_s);
    };
    auto makespan_of = [&](int pi, int i, double wait) {
        MakespanEvaluator & ev = evals_[pi];
        // with every copy ending after the candidate is ready, candidates of one key share the result
        const int32_t key = share_equal_ && wait + ev.h2d_s() > wait ? ev.equal_result_key(i) : -1;
        std::vector<Known> & known = known_[pi];
        if (key >= 0) {
            for (const Known & k : known) {
                if (k.key == key && k.version == version_[pi] && k.wait == wait) return k.makespan;
            }
        }
        const double makespan = ev.best_with_cached(i, wait, wait);
        ++evaluations_;
        if (key >= 0) known.push_back({key, version_[pi], wait, makespan});
        return makespan;
    };
    auto gain_of = [&](int pi, int i, double wait) {
        const Prediction & p = ctx.predictions[pi];
        const double makespan = makespan_of(pi, i, wait);
        const double g = base_[pi] - makespan;
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
        // the loads stay as predicted below (only cache states change): one order and one preparation serve every
        // evaluation of this layer
        load_descending_order(in, orders_[pi]);
        evals_[pi].prepare(in, cost, orders_[pi]);
        base_[pi] = evals_[pi].best_of_greedy_and_trivial();
        ++evaluations_;
        // Bounded candidate list: the highest predicted loads among the uncached.
        idx_.clear();
        for (size_t i = 0; i < in.size(); ++i) {
            if (!in.cached[i]) idx_.push_back(static_cast<int32_t>(i));
        }
        // (in decode every load is one: already in order, and stable_sort would only copy it through a buffer)
        auto by_load = [&](int32_t a, int32_t b) { return in.loads[a] > in.loads[b]; };
        if (!std::is_sorted(idx_.begin(), idx_.end(), by_load)) std::stable_sort(idx_.begin(), idx_.end(), by_load);
        if (static_cast<int>(idx_.size()) > max_candidates_) idx_.resize(max_candidates_);
        const double wait = wait_of(static_cast<int>(pi));
        for (int32_t i : idx_) {
            heap_.push_back({gain_of(static_cast<int>(pi), i, wait), static_cast<int>(pi), i, 0, wait, 0});
        }
    }
    auto less = [](const Candidate & a, const Candidate & b) { return a.gain < b.gain; };
    std::make_heap(heap_.begin(), heap_.end(), less);
    const int limit = max_copies_ > 0 ? max_copies_ : ctx.top_k;
    while (!heap_.empty() && static_cast<int>(out.size()) < limit) {
        std::pop_heap(heap_.begin(), heap_.end(), less);
        Candidate c = heap_.back();
        heap_.pop_back();
        // lazy re-evaluation under the current link and cache state; both change only when a copy is issued, so a
        // gain computed since the last issue is current already (gain_of would return the same value)
        if (c.round != out.size()) {
            const double wait = wait_of(c.pred);
            if (wait != c.wait || version_[c.pred] != c.version) {
                c.gain = gain_of(c.pred, c.index, wait);
                c.wait = wait;
                c.version = version_[c.pred];
            }
            c.round = out.size();
        }
        if (c.gain <= 0.0) continue;
        if (!heap_.empty() && c.gain < heap_.front().gain) {
            heap_.push_back(c);
            std::push_heap(heap_.begin(), heap_.end(), less);
            continue;
        }
        const Prediction & p = ctx.predictions[c.pred];
        LayerInput & in = inputs_[c.pred];
        pcie_free_at += cost.h2d(p.expert_bytes);
        in.cached[c.index] = 1;
        in.ready_s[c.index] = std::max(0.0, pcie_free_at - p.start_s);
        in.pcie_free_s = std::max(0.0, pcie_free_at - p.start_s);
        evals_[c.pred].set_cached(c.index, in.ready_s[c.index], in.pcie_free_s);
        ++version_[c.pred];
        known_[c.pred].clear();  // the layer changed: its known makespans no longer hold
        base_[c.pred] = evals_[c.pred].best_of_greedy_and_trivial();
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
