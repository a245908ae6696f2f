// Inter-layer expert prefetching (HybriMoE §IV.C; docs/design.md §3).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "policy/cost_model.h"
#include "policy/expert_cache.h"
#include "policy/scheduler.h"

namespace hybrimoe {

/// Predicted routing of one upcoming MoE layer. In the engine it comes from that layer's router applied to the
/// current hidden state; in the simulator from the trace through an imperfect predictor (simulator.h).
/// The chance that a ubatch of `n_tokens` tokens, each picking `top_k` of `n_expert` experts, uses a given expert
/// under uniform routing: 1 - (1 - top_k / n_expert)^n_tokens. At 1/2 or above every expert of a layer is likely
/// used: exclusive tiers leave the tiers as they are, and the RAM tier reads ahead by it (RamTier::prefetch: every
/// expert at kCertainUse and above, a prefill's; below, what the router look-ahead predicts, and the others by the
/// prior of the tokens it did not score).
inline double expert_use_prior(int top_k, int n_expert, int64_t n_tokens) {
    return 1.0 - std::pow(1.0 - std::min(1.0, (double) top_k / n_expert), (double) n_tokens);
}

/// A read ahead into the RAM tier whose expert is used at its layer with at least this probability (a prefill's)
/// is admitted as a demand read: frequency admission (TinyLFU) does not refuse it, since refusing a read the layer
/// needs anyway does not save it, only moves it to the layer's start, where the CPU waits for it.
constexpr double kCertainUse = 0.95;

struct Prediction {
    int layer = 0;                 ///< MoE layer predicted
    int distance = 1;              ///< layer - current layer (>= 1)
    double confidence = 1.0;       ///< probability that a predicted expert is really activated (0..1)
    double start_s = 0.0;          ///< estimated time (caller's clock, seconds) when that layer's experts start
                                   ///< (LayerDecider::prefetch takes it relative to the split and converts)
    double expert_bytes = 0.0;     ///< bytes of one expert of that layer
    std::vector<int32_t> experts;  ///< predicted experts, distinct
    std::vector<int32_t> loads;    ///< predicted tokens per expert
};

/// What a prefetch policy may look at after layer `layer`'s router ran.
struct PrefetchContext {
    int layer = 0;
    int n_tokens = 1;
    int top_k = 1;
    double now_s = 0.0;        ///< current time (seconds)
    double pcie_free_at_s = 0.0;  ///< the copy-queue estimate as a time: queued copies end then (seconds)
    std::vector<Prediction> predictions;
};

/// A prefetch policy returns (layer, expert) copies to issue, most important first. The caller admits each into
/// the cache (which may decline) and queues its copy; a layer waits only for its own copies.
class PrefetchPolicy {
public:
    virtual ~PrefetchPolicy() = default;
    virtual std::string name() const = 0;
    virtual std::vector<std::pair<int, int>> plan(const PrefetchContext & ctx, const ExpertCache & cache,
                                                  const CostModel & cost) = 0;
};

/// No prefetching.
class NoPrefetcher : public PrefetchPolicy {
public:
    std::string name() const override { return "none"; }
    std::vector<std::pair<int, int>> plan(const PrefetchContext &, const ExpertCache &, const CostModel &) override {
        return {};
    }
};

/// Baseline: the next layer's predicted experts, highest predicted load first, up to `count` uncached ones
/// (count 0 = top_k). Throws std::invalid_argument if count < 0.
class TopKPrefetcher : public PrefetchPolicy {
public:
    explicit TopKPrefetcher(int count = 0);
    std::string name() const override { return "next-layer-topk"; }
    std::vector<std::pair<int, int>> plan(const PrefetchContext & ctx, const ExpertCache & cache,
                                          const CostModel & cost) override;

private:
    int count_;
};

/// Weight of a prefetch's expected waste (ImpactPrefetcher): a prediction of confidence c is wrong with
/// probability 1 - c, and its copy then took the link for h2d(bytes) from copies that were needed; the copied
/// expert stays cached and may still be used later, so only part of that time counts. 0.5 is the value that did
/// best in `hybrimoe simulate` sweeps over 0 .. 4 (DeepSeek-V2-Lite routing, paper-a6000, rtx4090-desktop and h200
/// presets, 10-75% caches, decode): without the term, prefetching at the default confidences was slower than no
/// prefetching at all.
constexpr double kDefaultPrefetchWasteWeight = 0.5;

/// HybriMoE §IV.C impact-driven prefetch: for each predicted, uncached (layer j, expert e), gain = drop in layer
/// j's simulated HybriMoE makespan if e were cached, the copy queued after everything already on the link
/// (so late copies gain little), times the prediction's confidence, minus the expected waste
/// `waste_weight * (1 - confidence) * h2d(bytes)` (the link time of a copy made for a wrong prediction). Lazy
/// greedy: issue the highest current net gain while it is > 0, up to `max_copies` (0 = top_k) copies per call. Cost is bounded: at most
/// `max_candidates` (highest predicted load) candidates per predicted layer; a candidate's gain is recomputed only
/// when it reaches the top. Throws std::invalid_argument on negative limits. `share_equal` (default): candidates of
/// one MakespanEvaluator::equal_result_key share one evaluation (the same gains, fewer evaluations; off only to
/// check that).
class ImpactPrefetcher : public PrefetchPolicy {
public:
    explicit ImpactPrefetcher(int max_copies = 0, int max_candidates = 12, bool use_confidence = true,
                              double waste_weight = kDefaultPrefetchWasteWeight, bool share_equal = true);
    std::string name() const override { return "impact"; }
    std::vector<std::pair<int, int>> plan(const PrefetchContext & ctx, const ExpertCache & cache,
                                          const CostModel & cost) override;
    int64_t evaluations() const { return evaluations_; }  ///< makespan evaluations so far (cost accounting)

private:
    int max_copies_;
    int max_candidates_;
    bool use_confidence_;
    double waste_weight_;
    bool share_equal_;
    struct Candidate {
        double gain;
        int pred;      // index into ctx.predictions / inputs_
        int index;     // index into the layer input
        size_t round;  // copies issued when `gain` was last looked at
        double wait;   // the copy's wait for the layer when `gain` was computed (gain_of's ready time)
        uint32_t version;  // version_[pred] then
    };
    std::vector<LayerInput> inputs_;            // each prediction's layer as the copies issued so far leave it
    std::vector<std::vector<int32_t>> orders_;  // load_descending_order of each prediction's input
    std::vector<MakespanEvaluator> evals_;      // each prediction's input, prepared once per plan
    std::vector<double> base_;                  // each prediction's current makespan
    std::vector<uint32_t> version_;             // each prediction's copies issued in this plan
    std::vector<Candidate> heap_;
    std::vector<int32_t> idx_;
    // makespans already evaluated in this plan, per prediction: a candidate whose
    // MakespanEvaluator::equal_result_key, wait and version_ match an entry takes its makespan (the same number)
    struct Known {
        int32_t key;
        uint32_t version;
        double wait;
        double makespan;
    };
    std::vector<std::vector<Known>> known_;
    int64_t evaluations_ = 0;
};

/// Builds a prefetcher by name: "none", "topk" (next-layer-topk), "impact". Throws std::invalid_argument.
std::shared_ptr<PrefetchPolicy> make_prefetcher(const std::string & name);

}  // namespace hybrimoe
