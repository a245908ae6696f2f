#include "policy/expert_cache.h"
#include "policy/reuse_policy.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <stdexcept>

namespace hybrimoe {

// ---- MRS (HybriMoE §IV.D) -------------------------------------------------------------------------------------

MRSPolicy::MRSPolicy(double alpha, int p, bool use_max) : alpha_(alpha), p_(p), use_max_(use_max) {
    if (!(alpha > 0.0 && alpha <= 1.0)) {
        throw std::invalid_argument("MRSPolicy: alpha must be in (0, 1], got " + std::to_string(alpha));
    }
    if (p < 0) {
        throw std::invalid_argument("MRSPolicy: p must be >= 0 (0 = 2 * top_k), got " + std::to_string(p));
    }
}

void check_observation(const LayerObservation & obs, int n_layers, int n_experts, const char * who) {
    const std::string w(who);
    if (obs.layer < 0 || obs.layer >= n_layers || obs.n_experts != n_experts) {
        throw std::invalid_argument(w + ": layer or n_experts does not match reset()");
    }
    if (obs.top_k < 1 || obs.n_tokens < 1) throw std::invalid_argument(w + ": top_k and n_tokens must be >= 1");
    for (int32_t e : obs.experts) {
        if (e < 0 || e >= n_experts) throw std::invalid_argument(w + ": expert out of range");
    }
    if (!obs.loads.empty() && obs.loads.size() != obs.experts.size()) {
        throw std::invalid_argument(w + ": loads must be empty or one per expert");
    }
    if (!obs.scores.empty() && obs.scores.size() != static_cast<size_t>(obs.n_tokens) * n_experts) {
        throw std::invalid_argument(w + ": scores must be [n_tokens, n_experts]");
    }
}

void MRSPolicy::reset(int n_layers, int n_experts) {
    if (n_layers < 1 || n_experts < 1) {
        throw std::invalid_argument("MRSPolicy.reset: n_layers and n_experts must be >= 1");
    }
    n_layers_ = n_layers;
    n_experts_ = n_experts;
    score_.assign(static_cast<size_t>(n_layers) * n_experts, 0.0);
    touch(-1);
}

double MRSPolicy::score(int layer, int expert) const {
    if (layer < 0 || layer >= n_layers_ || expert < 0 || expert >= n_experts_) {
        throw std::out_of_range("MRSPolicy.score: (layer, expert) out of range");
    }
    return score_[static_cast<size_t>(layer) * n_experts_ + expert];
}

void MRSPolicy::set_score(int layer, int expert, double s) {
    if (layer < 0 || layer >= n_layers_ || expert < 0 || expert >= n_experts_) {
        throw std::out_of_range("MRSPolicy.set_score: (layer, expert) out of range");
    }
    score_[static_cast<size_t>(layer) * n_experts_ + expert] = s;
    touch(layer);
}

// The p entries of v[0..n) (p < n) that rank highest by value, ties to the lower index, into kept (unordered): the
// entries MRS's TopP keeps (HybriMoE §IV.D). First a bound: the smallest of the maxima of p disjoint blocks is met
// or beaten by p entries (one per block), so the p best are among the entries >= it (cand, in index order; a few
// times p of them). Then one pass over those keeping the best p so far in a min-heap whose top is the lowest value,
// among equal values the highest index; an entry replaces it only when strictly greater (a later entry of equal
// value ranks lower).
void MRSPolicy::top_p(const double * v, int n, int p, std::vector<Scored> & cand, std::vector<Scored> & kept) {
    const int block = n / p;
    double bound = v[0];
    for (int b = 0; b < p; ++b) {
        const double * x = v + static_cast<size_t>(b) * block;
        double m = x[0];
        for (int j = 1; j < block; ++j) m = x[j] > m ? x[j] : m;
        bound = b == 0 || m < bound ? m : bound;
    }
    cand.clear();
    for (int e = 0; e < n; ++e) {
        if (v[e] >= bound) cand.push_back({v[e], e});
    }
    const int m = static_cast<int>(cand.size());
    kept.assign(cand.begin(), cand.begin() + p);
    Scored * h = kept.data();
    auto lower = [](const Scored & a, const Scored & b) { return a.v < b.v || (a.v == b.v && a.e > b.e); };
    // a min-heap under `lower`: std::make_heap builds a max-heap, so give it the reverse order
    std::make_heap(h, h + p, [&](const Scored & a, const Scored & b) { return lower(b, a); });
    for (int c = p; c < m; ++c) {
        const Scored in = cand[static_cast<size_t>(c)];
        if (!(in.v > h[0].v)) continue;
        // replace the lowest kept entry by `in` and sift it down
        int i = 0;
        for (;;) {
            const int l = 2 * i + 1;
            if (l >= p) break;
            const int k = (l + 1 < p && lower(h[l + 1], h[l])) ? l + 1 : l;
            if (!lower(h[k], in)) break;
            h[i] = h[k];
            i = k;
        }
        h[i] = in;
    }
}

void MRSPolicy::observe(const LayerObservation & obs) {
    check_observation(obs, n_layers_, n_experts_, "MRSPolicy.observe");
    const int E = n_experts_;
    agg_.resize(E);
    double * agg = agg_.data();
    int nonzero = 0;
    if (!obs.scores.empty()) {
        if (obs.scores.size() != static_cast<size_t>(obs.n_tokens) * E) {
            throw std::invalid_argument("MRSPolicy.observe: scores must be [n_tokens, n_experts]");
        }
        // every aggregate starts from 0 (0.0 + s, max(0.0, s) for the first token)
        const float * row = obs.scores.data();
        if (use_max_) {
            for (int e = 0; e < E; ++e) agg[e] = std::max(0.0, double(row[e]));
        } else {
            for (int e = 0; e < E; ++e) agg[e] = 0.0 + row[e];
        }
        for (int t = 1; t < obs.n_tokens; ++t) {
            row = obs.scores.data() + static_cast<size_t>(t) * E;
            if (use_max_) {
                for (int e = 0; e < E; ++e) agg[e] = std::max(agg[e], double(row[e]));
            } else {
                for (int e = 0; e < E; ++e) agg[e] = agg[e] + row[e];
            }
        }
        if (!use_max_ && obs.n_tokens != 1) {  // the mean (a division by 1 changes nothing)
            for (int e = 0; e < E; ++e) agg[e] /= obs.n_tokens;
        }
        // only whether more than p are nonzero matters below: stop counting there
        const int p_stop = p_ > 0 ? p_ : 2 * obs.top_k;
        for (int e = 0; e < E && nonzero <= p_stop; ++e) nonzero += agg[e] > 0.0;
    } else {
        // No router scores: each token gives 1/top_k to each of its activated experts (docs/design.md §4,
        // no-scores fallback).
        std::fill(agg, agg + E, 0.0);
        for (size_t i = 0; i < obs.experts.size(); ++i) {
            const double load = obs.loads.empty() ? 1.0 : double(obs.loads[i]);
            agg[obs.experts[i]] = use_max_ ? 1.0 / obs.top_k : load / (double(obs.n_tokens) * obs.top_k);
            nonzero += agg[obs.experts[i]] > 0.0;
        }
    }
    // TopP: keep the p largest aggregated scores (ties to the lower expert id), zero the rest:
    // S[e] <- alpha * 0 + (1 - alpha) * S[e] for the others, the whole update for the p kept.
    const int p = p_ > 0 ? p_ : 2 * obs.top_k;
    double * S = score_.data() + static_cast<size_t>(obs.layer) * E;
    if (nonzero > p) {
        top_p(agg, E, p, cand_, kept_);
        for (Scored & k : kept_) k.v = alpha_ * k.v + (1.0 - alpha_) * S[k.e];
        for (int e = 0; e < E; ++e) S[e] = alpha_ * 0.0 + (1.0 - alpha_) * S[e];
        for (const Scored & k : kept_) S[k.e] = k.v;
    } else {
        for (int e = 0; e < E; ++e) S[e] = alpha_ * agg[e] + (1.0 - alpha_) * S[e];
    }
    touch(obs.layer);
}

// ---- LFU -------------------------------------------------------------------------------------------------------

void LFUPolicy::reset(int n_layers, int n_experts) {
    if (n_layers < 1 || n_experts < 1) {
        throw std::invalid_argument("LFUPolicy.reset: n_layers and n_experts must be >= 1");
    }
    count_.assign(static_cast<size_t>(n_layers) * n_experts, 0.0);
    n_layers_ = n_layers;
    n_experts_ = n_experts;
    touch(-1);
}

void LFUPolicy::observe(const LayerObservation & obs) {
    check_observation(obs, n_layers_, n_experts_, "LFUPolicy.observe");
    for (int32_t e : obs.experts) {
        count_[static_cast<size_t>(obs.layer) * n_experts_ + e] += 1.0;
    }
    touch(obs.layer);
}

// ---- static hot set ----------------------------------------------------------------------------------------------

StaticPolicy::StaticPolicy(std::vector<int64_t> keys, std::vector<double> weights)
    : keys_(std::move(keys)), weights_(std::move(weights)) {
    if (!weights_.empty() && weights_.size() != keys_.size()) {
        throw std::invalid_argument("StaticPolicy: weights must be empty or as long as keys");
    }
}

void StaticPolicy::reset(int n_layers, int n_experts) {
    if (n_layers < 1 || n_experts < 1) {
        throw std::invalid_argument("StaticPolicy.reset: n_layers and n_experts must be >= 1");
    }
    // every key checked before any state changes: a refused reset leaves the policy as it was
    const int64_t n = static_cast<int64_t>(n_layers) * n_experts;
    for (int64_t key : keys_) {
        if (key < 0 || key >= n) {
            throw std::invalid_argument("StaticPolicy: key " + std::to_string(key) + " outside 0.." +
                                        std::to_string(n - 1));
        }
    }
    n_experts_ = n_experts;
    weight_of_.assign(static_cast<size_t>(n), -1.0);
    for (size_t i = 0; i < keys_.size(); ++i) weight_of_[keys_[i]] = weights_.empty() ? 1.0 : weights_[i];
    touch(-1);
}

double StaticPolicy::priority(int layer, int expert) {
    return weight_of_[static_cast<size_t>(layer) * n_experts_ + expert];
}

bool StaticPolicy::admit(int layer, int expert) {
    return weight_of_[static_cast<size_t>(layer) * n_experts_ + expert] >= 0.0;
}

// ---- Belady with bypass --------------------------------------------------------------------------------------------

void BeladyPolicy::prepare(const FutureAccesses & future) {
    future_ = future;
    cursor_.assign(future_.uses.size(), 0);
    memo_cursor_.assign(future_.uses.size(), SIZE_MAX);
    memo_value_.assign(future_.uses.size(), 0.0);
    now_ = -1;
    horizon_ = 0;
    for (const auto & u : future_.uses) {
        if (!u.empty()) horizon_ = std::max(horizon_, u.back() + 1);
    }
    if (horizon_ >= (int64_t(1) << 52)) {
        throw std::invalid_argument("BeladyPolicy: run too long for exact priorities");
    }
    int bits = 1;
    while ((int64_t(1) << bits) < horizon_ + 1) ++bits;
    depth_ = std::max(1, std::min(8, 53 / bits));
    touch(-1);
}

void BeladyPolicy::observe(const LayerObservation & obs) {
    const int64_t now = obs.step * future_.n_layers + obs.layer;
    // Moving the clock forward changes only the keys used in (now_, now]: this layer's when the clock advances by
    // one layer as in a run; anything else (a jump, a step back) may change any key.
    if (now == now_ + 1 || now == now_) {
        touch(obs.layer);
    } else {
        touch(-1);
    }
    now_ = now;
}

double BeladyPolicy::priority(int layer, int expert) {
    return priority_of(static_cast<size_t>(layer) * future_.n_experts + expert);
}

void BeladyPolicy::priorities(const int64_t * keys, size_t n, int n_experts, double * out) {
    if (n_experts != future_.n_experts) {
        CachePolicy::priorities(keys, n, n_experts, out);
        return;
    }
    for (size_t i = 0; i < n; ++i) out[i] = priority_of(static_cast<size_t>(keys[i]));
}

double BeladyPolicy::priority_of(size_t key) {
    if (key >= future_.uses.size()) {
        throw std::logic_error("BeladyPolicy: prepare() was not called with this run's future accesses");
    }
    const std::vector<int64_t> & u = future_.uses[key];
    size_t & c = cursor_[key];
    while (c < u.size() && u[c] <= now_) ++c;
    if (memo_cursor_[key] == c) return memo_value_[key];
    // Farthest next use evicted first. One ubatch needs several experts at once, so next uses tie; ties go to the
    // uses after that (lexicographic on the future-use sequence: keep the expert needed again sooner), to the depth
    // that fits exactly in a double's 53-bit mantissa (depth_ levels of horizon_+1 values each).
    const double base = static_cast<double>(horizon_) + 1.0;
    double key_value = 0.0;
    for (int d = 0; d < depth_; ++d) {
        const size_t i = c + static_cast<size_t>(d);
        key_value = key_value * base + (i < u.size() ? double(u[i]) : double(horizon_));
    }
    memo_cursor_[key] = c;
    memo_value_[key] = -key_value;
    return -key_value;
}

std::shared_ptr<CachePolicy> make_cache_policy(const std::string & name) {
    if (name == "mrs") return std::make_shared<MRSPolicy>();
    if (name == "lru") return std::make_shared<LRUPolicy>();
    if (name == "lfu") return std::make_shared<LFUPolicy>();
    if (name == "belady") return std::make_shared<BeladyPolicy>();
    if (name == "reuse") return std::make_shared<ReusePolicy>();
    throw std::invalid_argument("unknown cache policy '" + name + "' (known: mrs, lru, lfu, reuse, belady; static "
                                "sets are built from a profile)");
}

// ---- the cache -----------------------------------------------------------------------------------------------------

ExpertCache::ExpertCache(std::vector<double> expert_bytes_per_layer, int n_experts, double budget_bytes,
                         std::shared_ptr<CachePolicy> policy)
    : bytes_(std::move(expert_bytes_per_layer)), n_experts_(n_experts), budget_(budget_bytes),
      policy_(std::move(policy)) {
    if (!policy_) {
        throw std::invalid_argument("ExpertCache: policy must not be null");
    }
    if (bytes_.empty() || n_experts < 1) {
        throw std::invalid_argument("ExpertCache: need at least one layer and one expert");
    }
    double smallest = std::numeric_limits<double>::infinity();
    for (double b : bytes_) {
        if (!std::isfinite(b) || b < 0.0) {
            throw std::invalid_argument("ExpertCache: expert bytes per layer must be finite and >= 0");
        }
        if (b > 0.0) smallest = std::min(smallest, b);
    }
    if (!std::isfinite(smallest)) {
        throw std::invalid_argument("ExpertCache: no layer has routed experts (all expert bytes are 0)");
    }
    if (!std::isfinite(budget_bytes) || budget_bytes < 0.0) {
        throw std::invalid_argument("ExpertCache: budget must be finite and >= 0 bytes, got " +
                                    std::to_string(budget_bytes));
    }
    if (budget_bytes > 0.0 && budget_bytes < smallest) {
        throw std::invalid_argument("ExpertCache: budget of " + std::to_string(budget_bytes) +
                                    " bytes is smaller than one expert (" + std::to_string(smallest) +
                                    " bytes); use 0 for no cache");
    }
    entries_.assign(bytes_.size() * n_experts_, Entry{});
    policy_->set_shape(-1, -1);  // a reset that throws leaves no sizes to check keys against
    policy_->reset(n_layers(), n_experts_);
    policy_->set_shape(n_layers(), n_experts_);
    order_.assign(bytes_.size(), {});
    members_.assign(bytes_.size(), {});
    tracks_ = policy_->tracks_changes();
    stale_.assign(bytes_.size(), 0);
    seen_rev_.assign(bytes_.size(), 0);
    for (int l = 0; l < n_layers(); ++l) seen_rev_[l] = policy_->revision(l);
    cursor_.assign(bytes_.size(), 0);
    is_dirty_.assign(bytes_.size(), 0);
    while (tree_leaves_ < n_layers()) tree_leaves_ *= 2;
    tree_.assign(2 * static_cast<size_t>(tree_leaves_), -1);
}

double ExpertCache::total_expert_bytes() const {
    double t = 0.0;
    for (double b : bytes_) t += b * n_experts_;
    return t;
}

void ExpertCache::out_of_range(int layer, int expert) {
    throw std::out_of_range("ExpertCache: (layer " + std::to_string(layer) + ", expert " + std::to_string(expert) +
                            ") out of range");
}

void ExpertCache::observe(const LayerObservation & obs) {
    small_visit_ = obs.n_tokens <= kSmallVisitTokens;
    stream_now_ = stream_min_active_ > 0.0 && obs.n_experts > 0 &&
                  static_cast<double>(obs.experts.size()) >= stream_min_active_ * static_cast<double>(obs.n_experts);
    policy_->observe(obs);
}

void ExpertCache::set_streaming_demand(double min_active_fraction) {
    if (!(min_active_fraction >= 0.0 && min_active_fraction <= 1.0)) {
        throw std::invalid_argument("ExpertCache.set_streaming_demand: the fraction of activated experts must be "
                                    "within 0..1");
    }
    stream_min_active_ = min_active_fraction;
    if (min_active_fraction == 0.0) stream_now_ = false;
}

void ExpertCache::set_frequency_admission(bool on, int64_t window) {
    if (window < 0) throw std::invalid_argument("ExpertCache.set_frequency_admission: window must be >= 0");
    freq_admission_ = on;
    freq_.assign(on ? bytes_.size() * (size_t) n_experts_ : 0, 0.0);
    freq_count_ = 0;
    if (window == 0) {
        double smallest = std::numeric_limits<double>::infinity();
        for (double b : bytes_) if (b > 0.0) smallest = std::min(smallest, b);
        window = 10 * std::max<int64_t>(1, (int64_t) (budget_ / smallest));
    }
    freq_window_ = window;
}

int ExpertCache::access(int layer, int expert, double now_s) {
    Entry & en = entry(layer, expert);
    ++stats_.accesses;
    if (freq_admission_) {
        freq_[(size_t) layer * n_experts_ + expert] += 1.0;
        if (++freq_count_ >= freq_window_) {  // TinyLFU's reset: halve every count
            for (double & f : freq_) f *= 0.5;
            freq_count_ = 0;
        }
    }
    en.last_use = ++clock_;
    if (!en.resident) {
        ++stats_.misses;
        return 0;
    }
    stale_[layer] = 1;  // its last_use moved
    mark_dirty(layer);
    en.probation = false;  // used again after its demand load: ranked by its policy from now on
    if (en.ready_s > now_s) {
        en.prefetched_unused = false;
        ++stats_.misses;
        ++stats_.late;
        return 3;
    }
    if (en.prefetched_unused) {
        en.prefetched_unused = false;
        ++stats_.prefetch_hits;
        return 2;
    }
    ++stats_.demand_hits;
    return 1;
}

void ExpertCache::set_ready(int layer, int expert, double ready_s) {
    Entry & en = entry(layer, expert);
    if (!en.resident) {
        throw std::logic_error("set_ready: expert " + std::to_string(expert) + " of layer " + std::to_string(layer) +
                               " is not resident");
    }
    en.ready_s = ready_s;
}

void ExpertCache::refresh(int layer) {
    if (fresh(layer)) return;
    std::vector<Rank> & ord = order_[layer];
    rank_keys_.clear();
    for (int64_t k : members_[layer]) {
        if (entries_[k].pins == 0) rank_keys_.push_back(k);
    }
    rank_p_.resize(rank_keys_.size());
    policy_->priorities(rank_keys_.data(), rank_keys_.size(), n_experts_, rank_p_.data());
    ord.resize(rank_keys_.size());
    for (size_t i = 0; i < ord.size(); ++i) {
        const Entry & en = entries_[rank_keys_[i]];
        ord[i] = Rank{order_priority(en, rank_p_[i]), en.last_use, en.slot, rank_keys_[i]};
    }
    std::sort(ord.begin(), ord.end(), RankLess());
    stale_[layer] = 0;
    seen_rev_[layer] = policy_->revision(layer);
}

void ExpertCache::order_add(int64_t key, bool keep_order, double p) {
    const int layer = static_cast<int>(key / n_experts_);
    if (!keep_order || !fresh(layer)) {
        stale_[layer] = 1;
        mark_dirty(layer);
        return;
    }
    const Entry & en = entries_[key];
    const Rank r{order_priority(en, p), en.last_use, en.slot, key};
    std::vector<Rank> & ord = order_[layer];
    ord.insert(std::upper_bound(ord.begin(), ord.end(), r, RankLess()), r);
    head_changed(layer);
}

void ExpertCache::order_drop(int64_t key) {
    std::vector<Rank> & ord = order_[key / n_experts_];
    for (size_t i = 0; i < ord.size(); ++i) {
        if (ord[i].key == key) {
            ord.erase(ord.begin() + static_cast<std::ptrdiff_t>(i));
            head_changed(static_cast<int>(key / n_experts_));
            return;
        }
    }
}

int32_t ExpertCache::better_layer(int32_t a, int32_t b) const {
    if (a < 0) return b;
    if (b < 0) return a;
    // Slots are unique, so two heads never compare equal.
    return rank_less(order_[b][cursor_[b]], order_[a][cursor_[a]]) ? b : a;
}

void ExpertCache::head_changed(int layer) {
    if (!tree_valid_) {
        mark_dirty(layer);
        return;
    }
    size_t i = static_cast<size_t>(tree_leaves_) + layer;
    tree_[i] = cursor_[layer] < static_cast<int32_t>(order_[layer].size()) ? layer : -1;
    for (i >>= 1; i > 0; i >>= 1) tree_[i] = better_layer(tree_[2 * i], tree_[2 * i + 1]);
}

void ExpertCache::sync_tree() {
    const int L = n_layers();
    bool all = !tree_built_ || !tracks_;
    if (!tracks_) std::fill(stale_.begin(), stale_.end(), 1);
    const uint64_t touches = policy_->touches();
    if (!all && touches != seen_touches_) {
        // priorities the policy changed since the last sync: one layer's when it marked one change since
        const int last = policy_->last_touched();
        if (touches == seen_touches_ + 1 && last >= 0) {
            if (last < L) mark_dirty(last);
        } else {
            for (int l = 0; l < L; ++l) {
                if (seen_rev_[l] != policy_->revision(l)) mark_dirty(l);
            }
        }
    }
    seen_touches_ = touches;
    if (all) {
        for (int l = 0; l < L; ++l) refresh(l);
        // Orders now hold exactly the unpinned residents; build the tree bottom-up.
        for (int l = 0; l < tree_leaves_; ++l) {
            tree_[tree_leaves_ + l] = (l < L && !order_[l].empty()) ? l : -1;
        }
        for (int i = tree_leaves_ - 1; i > 0; --i) tree_[i] = better_layer(tree_[2 * i], tree_[2 * i + 1]);
        tree_built_ = true;
    } else if (!dirty_.empty()) {
        // Every other layer's order and leaf are as the tree last saw them. The dirty leaves first, then their
        // paths level by level (all leaves are at one depth), so that a node is recomputed only from children that
        // are final.
        for (int32_t l : dirty_) {
            refresh(l);
            tree_[static_cast<size_t>(tree_leaves_) + l] = order_[l].empty() ? -1 : l;
        }
        for (int shift = 1; (tree_leaves_ >> shift) > 0; ++shift) {
            for (int32_t l : dirty_) {
                const size_t i = (static_cast<size_t>(tree_leaves_) + l) >> shift;
                tree_[i] = better_layer(tree_[2 * i], tree_[2 * i + 1]);
            }
        }
    }
    for (int32_t l : dirty_) is_dirty_[l] = 0;
    dirty_.clear();
    tree_valid_ = true;
}

bool ExpertCache::choose_victims(double need, double incoming, bool & refreshed, bool allow_bypass) {
    victims_.clear();
    if (used_ + need <= budget_ * (1.0 + 1e-12)) return true;
    if (!refreshed) {
        sync_tree();
        refreshed = true;
    }
    const bool bypass = allow_bypass && policy_->bypass();
    bool ok = true;
    double freed = 0.0;
    touched_.clear();
    while (used_ - freed + need > budget_ * (1.0 + 1e-12)) {
        const int32_t l = tree_[1];
        if (l < 0 || (bypass && incoming <= order_[l][cursor_[l]].p) ||
            (compete_now_ && incoming < order_[l][cursor_[l]].p)) {
            ok = false;
            break;
        }
        victims_.push_back(order_[l][cursor_[l]].key);
        freed += bytes_[l];
        if (cursor_[l]++ == 0) touched_.push_back(l);
        head_changed(l);
    }
    for (int32_t l : touched_) {
        cursor_[l] = 0;
        head_changed(l);
    }
    return ok;
}

void ExpertCache::insert(int64_t key, double ready_s, bool by_prefetch, bool keep_order, double p) {
    Entry & en = entries_[key];
    en.resident = true;
    en.prefetched_unused = by_prefetch;
    en.ready_s = ready_s;
    en.slot = static_cast<int32_t>(resident_.size());
    if (en.last_use < 0) en.last_use = clock_;
    resident_.push_back(key);
    const int layer = static_cast<int>(key / n_experts_);
    used_ += bytes_[layer];
    en.member = static_cast<int32_t>(members_[layer].size());
    members_[layer].push_back(key);
    if (en.pins == 0) order_add(key, keep_order, p);
}

void ExpertCache::remove(int64_t key) {
    Entry & en = entries_[key];
    const int layer = static_cast<int>(key / n_experts_);
    std::vector<int64_t> & mem = members_[layer];
    mem[en.member] = mem.back();
    entries_[mem.back()].member = en.member;
    mem.pop_back();
    en.member = -1;
    order_drop(key);
    // The last resident moves into the freed slot: its tie-break key gets smaller, so in a fresh order it can
    // only move towards the front.
    const int32_t slot = en.slot;
    const int64_t moved = resident_.back();
    resident_[slot] = moved;
    entries_[moved].slot = slot;
    resident_.pop_back();
    if (moved != key) {
        std::vector<Rank> & mo = order_[moved / n_experts_];
        for (size_t i = 0; i < mo.size(); ++i) {
            if (mo[i].key == moved) {
                mo[i].slot = slot;
                for (size_t j = i; j > 0 && rank_less(mo[j], mo[j - 1]); --j) std::swap(mo[j], mo[j - 1]);
                head_changed(static_cast<int>(moved / n_experts_));
                break;
            }
        }
    }
    en.resident = false;
    en.prefetched_unused = false;
    en.probation = false;
    en.slot = -1;
    used_ -= bytes_[layer];
    if (used_ < 0.0) used_ = 0.0;
}

void ExpertCache::admit_key(int64_t key, double p, double ready_s, bool by_prefetch) {
    for (int64_t v : victims_) {
        remove(v);
        if (record_evicted_) evicted_.push_back(v);
        ++stats_.evictions;
    }
    insert(key, ready_s, by_prefetch, true, p);
    ++stats_.admissions;
}

namespace {
// Sets a flag (when `on`) for the length of a scope, then restores it (an exception included).
struct FlagScope {
    bool & flag;
    const bool old;
    explicit FlagScope(bool & f, bool on = true) : flag(f), old(f) { flag = f || on; }
    ~FlagScope() { flag = old; }
};
}  // namespace

bool ExpertCache::admit(int layer, int expert, double ready_s, bool by_prefetch, bool demand) {
    Entry & en = entry(layer, expert);
    const int64_t key = static_cast<int64_t>(layer) * n_experts_ + expert;
    if (en.resident) return true;
    const double need = bytes_[layer];
    if (need <= 0.0 || need > budget_ || !policy_->admit(layer, expert)) {
        ++stats_.declined;
        return false;
    }
    // Victims: lowest priority, ties least recently used, then first in resident order; the newcomer's priority
    // is read only when it has to compete (bypass) or enter an ordered layer.
    const bool full = used_ + need > budget_ * (1.0 + 1e-12);
    // priority admission (a prefetch or fill in a decode-sized ubatch; not a RAM tier's read ahead nor a demoted
    // expert, which keep their rules): the newcomer competes with the victims on the policy's priority, as a demoted
    // expert does (choose_victims); elsewhere frequency admission
    const bool by_priority = prio_admission_ && !demand && small_visit_ && !compete_now_ && !read_ahead_now_;
    const double p = (full || tracks_ || compete_now_ || by_priority) ? policy_->priority(layer, expert) : 0.0;
    bool refreshed = false;
    bool ok;
    {
        FlagScope compete(compete_now_, by_priority);
        ok = choose_victims(need, p, refreshed, !demand);
    }
    // frequency admission: a prefetch or fill does not displace a more frequently used expert
    if (ok && freq_admission_ && !demand && !by_priority) {
        for (int64_t v : victims_) ok = ok && freq_[(size_t) key] > freq_[(size_t) v];
    }
    if (ok) {
        en.probation = demand && stream_now_;
        if (read_ahead_now_) en.last_use = ++clock_;  // newly read: the most recent, whatever its earlier uses
        admit_key(key, p, ready_s, by_prefetch);
    }
    tree_valid_ = false;
    if (!ok) ++stats_.declined;
    return ok;
}

bool ExpertCache::admit_read_ahead(int layer, int expert, double ready_s) {
    FlagScope on(read_ahead_now_);
    return admit(layer, expert, ready_s, true);
}

bool ExpertCache::admit_demoted(int layer, int expert, double ready_s) {
    FlagScope on(compete_now_);
    return admit(layer, expert, ready_s, true);
}

void ExpertCache::found_read_ahead(int layer, int expert) {
    Entry & en = entry(layer, expert);
    if (!en.resident || !en.prefetched_unused || stats_.misses == 0) return;
    en.prefetched_unused = false;
    --stats_.misses;
    ++stats_.prefetch_hits;
}

int ExpertCache::admit_batch(int layer, const std::vector<int32_t> & experts, const std::vector<double> & ready_s,
                             bool by_prefetch) {
    if (!ready_s.empty() && ready_s.size() != experts.size()) {
        throw std::invalid_argument("ExpertCache.admit_batch: ready_s must be empty or one per expert");
    }
    if (layer < 0 || layer >= n_layers()) {
        throw std::out_of_range("ExpertCache.admit_batch: layer " + std::to_string(layer) + " out of range");
    }
    const double need = bytes_[layer];
    incoming_.clear();
    for (size_t i = 0; i < experts.size(); ++i) {
        const Entry & en = entry(layer, experts[i]);
        if (en.resident) continue;
        if (need <= 0.0 || need > budget_ || !policy_->admit(layer, experts[i])) {
            ++stats_.declined;
            continue;
        }
        const int64_t key = static_cast<int64_t>(layer) * n_experts_ + experts[i];
        incoming_.push_back({policy_->priority(layer, experts[i]), key, ready_s.empty() ? 0.0 : ready_s[i]});
    }
    if (incoming_.empty()) return 0;
    std::stable_sort(incoming_.begin(), incoming_.end(),
                     [](const Candidate & a, const Candidate & b) { return a.priority > b.priority; });
    // One admit per newcomer, most valuable first; newcomers are pinned meanwhile so that none evicts another.
    for (const Candidate & c : incoming_) ++entries_[c.key].pins;
    // Nothing but this loop changes priorities, pins or last uses meanwhile, so one refresh serves every newcomer.
    int admitted = 0;
    bool refreshed = false;
    try {
        for (size_t ci = 0; ci < incoming_.size(); ++ci) {
            const Candidate & c = incoming_[ci];
            if (!choose_victims(need, c.priority, refreshed)) {
                // The rest rank no higher and face the same victims: declined too.
                stats_.declined += static_cast<int64_t>(incoming_.size() - ci);
                break;
            }
            admit_key(c.key, c.priority, c.ready_s, by_prefetch);
            ++admitted;
        }
    } catch (...) {
        // A Python policy's priorities() may throw during a refresh: leave no pin behind.
        tree_valid_ = false;
        for (const Candidate & c : incoming_) --entries_[c.key].pins;
        throw;
    }
    tree_valid_ = false;
    for (const Candidate & c : incoming_) {
        Entry & en = entries_[c.key];
        if (--en.pins == 0 && en.resident) order_add(c.key, true, c.priority);
    }
    return admitted;
}

void ExpertCache::pin(int layer, int expert) {
    Entry & en = entry(layer, expert);
    if (en.pins++ == 0 && en.resident) order_drop(static_cast<int64_t>(layer) * n_experts_ + expert);
}

void ExpertCache::unpin(int layer, int expert) {
    Entry & en = entry(layer, expert);
    if (en.pins <= 0) {
        throw std::logic_error("ExpertCache.unpin: (layer " + std::to_string(layer) + ", expert " +
                               std::to_string(expert) + ") is not pinned");
    }
    if (--en.pins == 0 && en.resident) {
        // Back among the candidates; its priority is read only for an order kept fresh (no Python call otherwise).
        const bool keep = fresh(layer);
        order_add(static_cast<int64_t>(layer) * n_experts_ + expert, keep, keep ? policy_->priority(layer, expert) : 0.0);
    }
}

void ExpertCache::evict(int layer, int expert) {
    Entry & en = entry(layer, expert);
    if (en.pins > 0) {
        throw std::logic_error("ExpertCache.evict: (layer " + std::to_string(layer) + ", expert " +
                               std::to_string(expert) + ") is pinned");
    }
    if (en.resident) {
        remove(static_cast<int64_t>(layer) * n_experts_ + expert);
    }
}

int ExpertCache::fill(const std::vector<int64_t> & keys) {
    int n = 0;
    for (int64_t key : keys) {
        if (key < 0 || key >= static_cast<int64_t>(entries_.size())) {
            throw std::invalid_argument("ExpertCache.fill: key " + std::to_string(key) + " out of range");
        }
        const double need = bytes_[key / n_experts_];
        if (entries_[key].resident || need <= 0.0 || used_ + need > budget_ * (1.0 + 1e-12)) continue;
        insert(key, 0.0, false, false, 0.0);
        ++n;
    }
    return n;
}

std::vector<int64_t> ExpertCache::take_evicted() {
    std::vector<int64_t> out;
    out.swap(evicted_);
    return out;
}

}  // namespace hybrimoe
