// A cache policy that predicts reuse instead of remembering it (docs/design.md §4, "Reuse prediction").
//
// Per (MoE layer, expert): the probability that the router selects the expert at one of its layer's next `horizon`
// visits (a visit: one ubatch through the layer; in decode, one token), from an online logistic regression over
// features of the expert's own past routing. The model is learned from the routing stream as it runs: at each visit
// of a layer, the features the policy saw `horizon` visits ago are labelled by what the router did since, and one
// stochastic gradient step per expert moves the shared weights (logistic regression by SGD on the log-loss: the
// textbook online learner, e.g. Bottou, "Large-Scale Machine Learning with Stochastic Gradient Descent", 2010). No
// offline training and nothing per model: the weights start where the predicted probability ranks experts on
// feature 1, MRS's alpha-0.5 score (HybriMoE §IV.D): the same order as MRS where a visit scores only its routed
// experts (no router scores, and at most MRS's p = 2 top_k of them); with router scores MRS keeps the top p of
// them and this every expert's, capped at 1. Then the weights move.
//
// Features (each in [0, 1], top_k times a score so that an expert used at every visit tends to 1):
//   0  bias
//   1  MRS score with alpha 0.5 (the paper's: the last two visits)
//   2  the same with alpha 0.1 (about ten visits)
//   3  the same with alpha 0.01 (about a hundred: the long-run frequency)
//   4  used at this visit (0 or 1)
//   5  recency: 2^-(visits since the last use / horizon), 0 before the first use and after 32 horizons (a table)
//   6  follows: how often the expert was used at the visit after one that used the experts this visit uses, the
//      mean over them of count(used next | used) / count(used) (a first-order transition estimate per layer,
//      learned online; 0 before any). Counted between visits of at most kFollowMaxTokens tokens (decode); the
//      counts are floats over the whole run (exact up to 2^24 uses of an expert), not decayed
//   7  follows lately: the same from counts that decay by kRecentDecay per visit of the layer (the transitions of
//      the current prompt rather than of the whole run)
// A visit's score of an expert is its mean router probability over the ubatch's tokens where the router's scores
// are given, else load / (n_tokens * top_k), as MRS's fallback.
//
// Prefill: only decode-sized visits (at most kFollowMaxTokens tokens) teach (a sample whose snapshot or label
// window holds a larger visit is skipped), and a larger visit ranks its layer by MRS's own alpha-0.5 score (an
// MRSPolicy kept beside the features, its Top-P included, so that a prefill ranks exactly as MRS ranks it): after a
// prefill ubatch nearly every expert is used at the next visit, which says nothing of decode, and weights learned
// on decode rank a prefill's experts badly.
//
// Memory (bytes_per_layer): per expert four scores, a last-use index and a probability (48 bytes), `horizon`
// snapshots of its 8 features (floats), a row of each transition table (n_experts floats and a count) and a slot
// of the last visit's experts (4 bytes); per layer 28 bytes: at horizon 4, 188 + 8 n_experts bytes per expert,
// 45 KB for a layer of 64 experts, 572 KB for 256, 2.2 MB for 512. Cost per visit: the transition counts of the
// last visit's experts times this visit's (decode), the features (features 6 and 7: this visit's experts times
// n_experts), one SGD step per expert (one exponential) and one prediction per expert of the layer; about every
// 9,200 visits the decaying table is rescaled (n_experts^2). The cache ranks by the prediction's logit (the same
// order as the probability; no exponential).
#pragma once

#include "policy/expert_cache.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace hybrimoe {

class ReusePolicy : public CachePolicy {
public:
    static constexpr int kFeatures = 8;
    /// feature 7's counts decay by this factor per visit of their layer (a half-life of about 140 visits)
    static constexpr double kRecentDecay = 0.995;
    /// visits of at most this many tokens (decode) learn and count transitions (features 6 and 7); a larger
    /// ubatch (prefill) does neither and ranks its layer by feature 1 (the cache's priority admission uses the same
    /// bound)
    static constexpr int kFollowMaxTokens = ExpertCache::kSmallVisitTokens;

    /// The longest horizon taken (its snapshots cost horizon x 8 floats per expert).
    static constexpr int kMaxHorizon = 1024;
    /// The defaults: 4 visits and 0.001. Rate 0.001 ranked best of 0.01, 0.003 and 0.001 in a cache-only replay of
    /// the DeepSeek-V2-Lite development trace at 25%; with the cache's priority admission, horizon 4 decoded fastest
    /// of 1, 2, 3, 4, 6 and 8 in the full simulated runs on that trace (horizon 2 had the best cache-only hit rate).
    static constexpr int kDefaultHorizon = 4;
    static constexpr double kDefaultRate = 0.001;
    /// horizon: the visits of a layer within which a use counts as reuse (1..kMaxHorizon); rate: the SGD step per
    /// sample (in (0, 1]). Throws std::invalid_argument otherwise.
    explicit ReusePolicy(int horizon = kDefaultHorizon, double rate = kDefaultRate);
    std::string name() const override { return "reuse"; }
    void reset(int n_layers, int n_experts) override;
    /// Scores the layer's visit, labels and learns from the snapshot `horizon` visits old, predicts every expert of
    /// the layer with the updated weights.
    void observe(const LayerObservation & obs) override;
    double priority(int layer, int expert) override { return logit_[static_cast<size_t>(layer) * n_experts_ + expert]; }
    void priorities(const int64_t * keys, size_t n, int, double * out) override {
        for (size_t i = 0; i < n; ++i) out[i] = logit_[keys[i]];
    }
    bool tracks_changes() const override { return true; }

    /// The predicted probability of (layer, expert) being used within the horizon, as of its layer's last visit.
    double probability(int layer, int expert) const;
    /// The weights, bias first (kFeatures of them).
    std::vector<double> weights() const { return {w_.begin(), w_.end()}; }
    /// Samples learned from so far, and their mean log-loss (nats) and Brier score, each prediction scored before
    /// the step it took (progressive validation: an online learner's honest error). 0 before any sample.
    int64_t samples() const { return samples_; }
    double log_loss() const { return samples_ ? loss_sum_ / double(samples_) : 0.0; }
    double brier() const { return samples_ ? brier_sum_ / double(samples_) : 0.0; }
    /// The base rate: the share of samples whose label was 1.
    double positive_rate() const { return samples_ ? double(positives_) / double(samples_) : 0.0; }
    int horizon() const { return horizon_; }
    double rate() const { return rate_; }
    /// Bytes of state per layer (the scores, last uses, snapshots and the transition table's rows).
    size_t bytes_per_layer() const;

private:
    int horizon_;
    double rate_;
    int n_layers_ = 0, n_experts_ = 0;
    std::array<double, kFeatures> w_{};
    std::vector<double> fast_, mid_, slow_;  // MRS scores at alpha 0.5, 0.1, 0.01, x top_k
    MRSPolicy mrs_{0.5};                     // MRS itself (Top-P and all): a prefill ubatch ranks its layer by it
    std::vector<int64_t> last_use_;          // visit index of the last use, -1 never
    std::vector<int64_t> visits_;            // per layer: visits so far
    std::vector<float> snap_;                // per layer, horizon ring slots of n_experts x kFeatures
    std::vector<float> follow_;              // per layer [n_experts x n_experts]: used at the next visit after
    std::vector<float> follow_n_;            // per layer [n_experts]: visits that used the row's expert
    std::vector<int32_t> prev_;              // per layer: the last visit's experts (n_experts slots)
    std::vector<int32_t> prev_n_;            // per layer: how many
    std::vector<double> logit_;              // the predictions as logits (the cache ranks by them: same order)
    std::vector<double> s_;                  // one visit's scores (scratch)
    std::vector<float> recent_;              // per layer [n_experts x n_experts]: feature 7's decayed counts
    std::vector<float> recent_n_;            // per layer [n_experts]: their decayed row totals
    std::vector<double> recent_gain_;        // per layer: the weight of a count added now (kRecentDecay^-visits)
    /// the gain at which a layer's decaying table is scaled back to gain 1 (far inside float's range)
    static constexpr double kRecentRescale = 1e20;
    std::vector<int64_t> last_large_;        // per layer: the last visit of more than kFollowMaxTokens tokens, -1
    std::vector<double> fol_;                // one visit's feature 6 (scratch)
    std::vector<double> rec_;                // one visit's feature 7 (scratch)
    std::vector<int32_t> cur_;               // one visit's distinct experts (scratch)
    std::vector<float> recency_;             // feature 5 by visits since the last use, 0..32 horizons
    int64_t samples_ = 0, positives_ = 0;
    double loss_sum_ = 0.0, brier_sum_ = 0.0;
};

}  // namespace hybrimoe
