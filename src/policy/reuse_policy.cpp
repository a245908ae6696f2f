#include "policy/reuse_policy.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace hybrimoe {

namespace {

// The starting weights: p = sigmoid(-2 + 4 * f1), increasing in MRS's alpha-0.5 score alone, so that before it has
// learned anything the policy ranks the residents as MRS does (ties as well: equal scores give equal p).
constexpr double kBias0 = -2.0;
constexpr double kFast0 = 4.0;
constexpr double kAlpha[3] = {0.5, 0.1, 0.01};

inline double sigmoid(double z) {
    if (z >= 0.0) return 1.0 / (1.0 + std::exp(-z));
    const double e = std::exp(z);
    return e / (1.0 + e);
}

}  // namespace

ReusePolicy::ReusePolicy(int horizon, double rate) : horizon_(horizon), rate_(rate) {
    if (horizon < 1 || horizon > kMaxHorizon) {
        throw std::invalid_argument("ReusePolicy: horizon must be 1.." + std::to_string(kMaxHorizon) +
                                    " visits, got " + std::to_string(horizon));
    }
    if (!(rate > 0.0 && rate <= 1.0)) {
        throw std::invalid_argument("ReusePolicy: rate must be in (0, 1], got " + std::to_string(rate));
    }
    w_[0] = kBias0;  // the starting weights, as reset() sets them
    w_[1] = kFast0;
}

void ReusePolicy::reset(int n_layers, int n_experts) {
    if (n_layers < 1 || n_experts < 1) {
        throw std::invalid_argument("ReusePolicy.reset: n_layers and n_experts must be >= 1");
    }
    n_layers_ = n_layers;
    n_experts_ = n_experts;
    const size_t n = static_cast<size_t>(n_layers) * n_experts;
    w_.fill(0.0);
    w_[0] = kBias0;
    w_[1] = kFast0;
    mrs_.reset(n_layers, n_experts);
    fast_.assign(n, 0.0);
    mid_.assign(n, 0.0);
    slow_.assign(n, 0.0);
    last_use_.assign(n, -1);
    visits_.assign(static_cast<size_t>(n_layers), 0);
    snap_.assign(n * static_cast<size_t>(horizon_) * kFeatures, 0.0f);
    follow_.assign(n * static_cast<size_t>(n_experts), 0.0f);
    recency_.resize(static_cast<size_t>(32) * horizon_ + 1);
    for (size_t a = 0; a < recency_.size(); ++a) {
        recency_[a] = static_cast<float>(std::exp2(-double(a) / horizon_));
    }
    follow_n_.assign(n, 0.0f);
    recent_.assign(n * static_cast<size_t>(n_experts), 0.0f);
    recent_n_.assign(n, 0.0f);
    recent_gain_.assign(static_cast<size_t>(n_layers), 1.0);
    last_large_.assign(static_cast<size_t>(n_layers), -1);
    prev_.assign(n, 0);
    prev_n_.assign(static_cast<size_t>(n_layers), 0);
    logit_.assign(n, kBias0);
    samples_ = positives_ = 0;
    loss_sum_ = brier_sum_ = 0.0;
    touch(-1);
}

double ReusePolicy::probability(int layer, int expert) const {
    if (layer < 0 || layer >= n_layers_ || expert < 0 || expert >= n_experts_) {
        throw std::out_of_range("ReusePolicy.probability: (layer, expert) out of range");
    }
    return sigmoid(logit_[static_cast<size_t>(layer) * n_experts_ + expert]);
}

size_t ReusePolicy::bytes_per_layer() const {
    const size_t per_expert = 4 * sizeof(double) + sizeof(int64_t) + sizeof(double) +
                              static_cast<size_t>(horizon_) * kFeatures * sizeof(float) +
                              2 * (static_cast<size_t>(n_experts_) + 1) * sizeof(float) + sizeof(int32_t);
    return per_expert * static_cast<size_t>(n_experts_) + 2 * sizeof(int64_t) + sizeof(int32_t) + sizeof(double);
}

void ReusePolicy::observe(const LayerObservation & obs) {
    // every check before any state changes: a refused observation leaves the policy as it was
    check_observation(obs, n_layers_, n_experts_, "ReusePolicy.observe");
    mrs_.observe(obs);  // checked as above: it cannot throw here
    const int E = n_experts_, l = obs.layer;
    const double k = obs.top_k;
    const int n_tok = obs.n_tokens;
    // this visit's score of each expert, times top_k (an expert used by every token tends to 1)
    s_.assign(static_cast<size_t>(E), 0.0);
    if (!obs.scores.empty()) {
        for (int t = 0; t < n_tok; ++t) {
            const float * row = obs.scores.data() + static_cast<size_t>(t) * E;
            for (int e = 0; e < E; ++e) s_[e] += row[e];
        }
        for (int e = 0; e < E; ++e) s_[e] = std::min(1.0, s_[e] * k / n_tok);
    } else {
        for (size_t i = 0; i < obs.experts.size(); ++i) {
            const int32_t load = i < obs.loads.size() ? obs.loads[i] : 1;
            s_[obs.experts[i]] = std::min(1.0, double(load) / n_tok);
        }
    }
    const size_t base = static_cast<size_t>(l) * E;
    // the transitions from the last visit's experts to this visit's (feature 6's counts), then this visit's set
    // becomes the last one (a ubatch's distinct experts). Only between visits of a few tokens (decode): a prefill
    // ubatch uses most experts, follows nothing and would cost n_experts^2 per visit
    int32_t * prev = prev_.data() + base;
    const bool small = n_tok <= kFollowMaxTokens;
    cur_.clear();  // this visit's experts, each once (an observation listing one twice counts it once)
    if (small) {
        for (int32_t e : obs.experts) {
            if (std::find(cur_.begin(), cur_.end(), e) == cur_.end()) cur_.push_back(e);
        }
    }
    // the recent table's counts decay by kRecentDecay per visit of the layer: each count is added with weight
    // gain = kRecentDecay^-(visits), and only count / total is read, so the common factor cancels; the table is
    // rescaled to gain 1 before the weights leave float's range (about every 9,200 visits at 0.995)
    double & gain = recent_gain_[l];
    gain /= kRecentDecay;
    if (gain > kRecentRescale) {
        const float f = static_cast<float>(1.0 / gain);
        float * t0 = recent_.data() + base * E;
        for (size_t i = 0; i < static_cast<size_t>(E) * E; ++i) t0[i] *= f;
        for (int e = 0; e < E; ++e) recent_n_[base + e] *= f;
        gain = 1.0;
    }
    const float g = static_cast<float>(gain);
    for (int32_t i = 0; i < prev_n_[l] && !cur_.empty(); ++i) {
        const size_t row = (base + prev[i]) * E;
        follow_n_[base + prev[i]] += 1.0f;
        recent_n_[base + prev[i]] += g;
        for (int32_t b : cur_) {
            follow_[row + b] += 1.0f;
            recent_[row + b] += g;
        }
    }
    prev_n_[l] = static_cast<int32_t>(cur_.size());
    std::copy(cur_.begin(), cur_.end(), prev);
    // features 6 and 7 of every expert: the mean over this visit's experts a of count(a, then b) / count(a), over
    // the whole run and over the recent visits
    fol_.assign(static_cast<size_t>(E), 0.0);
    rec_.assign(static_cast<size_t>(E), 0.0);
    for (int32_t i = 0; i < prev_n_[l]; ++i) {
        const size_t a = base + prev[i];
        const float n = follow_n_[a];
        if (n <= 0.0f) continue;
        const float * row = follow_.data() + a * E;
        const float * rrow = recent_.data() + a * E;
        const double inv = 1.0 / (double(n) * prev_n_[l]);
        // a row unused for tens of thousands of visits (three rescales or more) may have decayed to 0: it predicts
        // nothing
        const double rinv = recent_n_[a] > 0.0f ? 1.0 / (double(recent_n_[a]) * prev_n_[l]) : 0.0;
        for (int b = 0; b < E; ++b) {
            fol_[b] += row[b] * inv;
            rec_[b] += rrow[b] * rinv;
        }
    }
    const int64_t t = visits_[l]++;
    for (int32_t e : obs.experts) last_use_[base + e] = t;
    for (int e = 0; e < E; ++e) {
        const size_t i = base + e;
        fast_[i] = kAlpha[0] * s_[e] + (1.0 - kAlpha[0]) * fast_[i];
        mid_[i] = kAlpha[1] * s_[e] + (1.0 - kAlpha[1]) * mid_[i];
        slow_[i] = kAlpha[2] * s_[e] + (1.0 - kAlpha[2]) * slow_[i];
    }
    // the snapshot of visit t - horizon (ring slot t % horizon) is labelled now: used at a visit after it
    float * ring = snap_.data() + (base * horizon_ + static_cast<size_t>(t % horizon_) * E) * kFeatures;
    // only decode-sized visits teach: a sample whose snapshot or label window holds a prefill ubatch (after which
    // nearly every expert is used at the next visit, a label that says nothing of decode) is skipped
    if (!small) last_large_[l] = t;
    if (t >= horizon_ && last_large_[l] < t - horizon_) {
        const int64_t since = t - horizon_;
        for (int e = 0; e < E; ++e) {
            const float * f = ring + static_cast<size_t>(e) * kFeatures;
            double z = 0.0;
            for (int j = 0; j < kFeatures; ++j) z += w_[j] * f[j];
            const double p = sigmoid(z);
            const double y = last_use_[base + e] > since ? 1.0 : 0.0;
            const double pc = std::min(std::max(p, 1e-7), 1.0 - 1e-7);
            loss_sum_ -= y > 0.5 ? std::log(pc) : std::log(1.0 - pc);
            brier_sum_ += (p - y) * (p - y);
            ++samples_;
            positives_ += y > 0.5;
            const double g = rate_ * (p - y);
            for (int j = 0; j < kFeatures; ++j) w_[j] -= g * f[j];
        }
    }
    // this visit's features into the slot just used, and every expert's prediction with the updated weights
    for (int e = 0; e < E; ++e) {
        const size_t i = base + e;
        float * f = ring + static_cast<size_t>(e) * kFeatures;
        const int64_t last = last_use_[i];
        f[0] = 1.0f;
        f[1] = static_cast<float>(fast_[i]);
        f[2] = static_cast<float>(mid_[i]);
        f[3] = static_cast<float>(slow_[i]);
        f[4] = last == t ? 1.0f : 0.0f;
        f[5] = last < 0 || t - last >= static_cast<int64_t>(recency_.size()) ? 0.0f
                                                                          : recency_[static_cast<size_t>(t - last)];
        f[6] = static_cast<float>(fol_[e]);
        f[7] = static_cast<float>(rec_[e]);
        double z = 0.0;
        for (int j = 0; j < kFeatures; ++j) z += w_[j] * f[j];
        // a prefill ubatch ranks the layer as MRS does, by MRS's own score (its Top-P included), on feature 1's
        // scale (top_k times a score) and the starting weights'
        if (!small) z = kBias0 + kFast0 * k * mrs_.priority(l, e);
        logit_[i] = z;
    }
    touch(l);
}

}  // namespace hybrimoe
