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
//   5  recency: 2^-(visits since the last use / horizon), 0 before the first use
// A visit's score of an expert is its mean router probability over the ubatch's tokens where the router's scores
// are given, else load / (n_tokens * top_k), as MRS's fallback.
//
// Memory (bytes_per_layer): per expert three scores, a last-use index and a probability (40 bytes) and `horizon`
// snapshots of its 6 features (floats): at horizon 4, 136 bytes per expert, 8.7 KB for a layer of 64 experts, 35 KB
// for 256, 70 KB for 512; no co-occurrence table. Cost per visit: the features, one prediction and one SGD step per
// expert of the layer, O(n_experts x 6).
#pragma once

#include "policy/expert_cache.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace hybrimoe {

class ReusePolicy : public CachePolicy {
public:
    static constexpr int kFeatures = 6;

    /// horizon: the visits of a layer within which a use counts as reuse (>= 1); rate: the SGD step per sample
    /// (> 0). Throws std::invalid_argument otherwise.
    explicit ReusePolicy(int horizon = 4, double rate = 0.01);
    std::string name() const override { return "reuse"; }
    void reset(int n_layers, int n_experts) override;
    /// Scores the layer's visit, labels and learns from the snapshot `horizon` visits old, predicts every expert of
    /// the layer with the updated weights.
    void observe(const LayerObservation & obs) override;
    double priority(int layer, int expert) override { return prob_[static_cast<size_t>(layer) * n_experts_ + expert]; }
    void priorities(const int64_t * keys, size_t n, int, double * out) override {
        for (size_t i = 0; i < n; ++i) out[i] = prob_[keys[i]];
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
    /// Bytes of state per layer (the scores, last uses and snapshots).
    size_t bytes_per_layer() const;

private:
    int horizon_;
    double rate_;
    int n_layers_ = 0, n_experts_ = 0;
    std::array<double, kFeatures> w_{};
    std::vector<double> fast_, mid_, slow_;  // MRS scores at alpha 0.5, 0.1, 0.01, x top_k
    std::vector<int64_t> last_use_;          // visit index of the last use, -1 never
    std::vector<int64_t> visits_;            // per layer: visits so far
    std::vector<float> snap_;                // per layer, horizon ring slots of n_experts x kFeatures
    std::vector<double> prob_;
    std::vector<double> s_;                  // one visit's scores (scratch)
    int64_t samples_ = 0, positives_ = 0;
    double loss_sum_ = 0.0, brier_sum_ = 0.0;
};

}  // namespace hybrimoe
