#include "policy/expert_cache.h"

#include <algorithm>
#include <cmath>
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

void MRSPolicy::reset(int n_layers, int n_experts) {
    if (n_layers < 1 || n_experts < 1) {
        throw std::invalid_argument("MRSPolicy.reset: n_layers and n_experts must be >= 1");
    }
    n_layers_ = n_layers;
    n_experts_ = n_experts;
    score_.assign(static_cast<size_t>(n_layers) * n_experts, 0.0);
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
}

void MRSPolicy::observe(const LayerObservation & obs) {
    if (obs.layer < 0 || obs.layer >= n_layers_ || obs.n_experts != n_experts_) {
        throw std::invalid_argument("MRSPolicy.observe: layer or n_experts does not match reset()");
    }
    const int E = n_experts_;
    agg_.assign(E, 0.0);
    if (!obs.scores.empty()) {
        if (obs.scores.size() != static_cast<size_t>(obs.n_tokens) * E) {
            throw std::invalid_argument("MRSPolicy.observe: scores must be [n_tokens, n_experts]");
        }
        for (int t = 0; t < obs.n_tokens; ++t) {
            const float * row = obs.scores.data() + static_cast<size_t>(t) * E;
            for (int e = 0; e < E; ++e) {
                agg_[e] = use_max_ ? std::max(agg_[e], double(row[e])) : agg_[e] + row[e];
            }
        }
        if (!use_max_) {
            for (double & v : agg_) v /= obs.n_tokens;
        }
    } else {
        // No router scores: each token gives 1/top_k to each of its activated experts (HYBRIMOE.md fallback).
        for (size_t i = 0; i < obs.experts.size(); ++i) {
            agg_[obs.experts[i]] = use_max_ ? 1.0 / obs.top_k : double(obs.loads[i]) / (double(obs.n_tokens) * obs.top_k);
        }
    }
    // TopP: keep the p largest aggregated scores (ties to the lower expert id), zero the rest.
    const int p = p_ > 0 ? p_ : 2 * obs.top_k;
    int nonzero = 0;
    for (double v : agg_) nonzero += v > 0.0;
    if (nonzero > p) {
        sorted_.assign(agg_.begin(), agg_.end());
        std::nth_element(sorted_.begin(), sorted_.begin() + (p - 1), sorted_.end(), std::greater<double>());
        const double thr = sorted_[p - 1];
        int above = 0;
        for (double v : agg_) above += v > thr;
        int equal_left = p - above;
        for (double & v : agg_) {
            if (v > thr) continue;
            if (v == thr && equal_left > 0) {
                --equal_left;
                continue;
            }
            v = 0.0;
        }
    }
    double * S = score_.data() + static_cast<size_t>(obs.layer) * E;
    for (int e = 0; e < E; ++e) {
        S[e] = alpha_ * agg_[e] + (1.0 - alpha_) * S[e];
    }
}

// ---- LFU -------------------------------------------------------------------------------------------------------

void LFUPolicy::reset(int n_layers, int n_experts) {
    n_experts_ = n_experts;
    count_.assign(static_cast<size_t>(n_layers) * n_experts, 0.0);
}

void LFUPolicy::observe(const LayerObservation & obs) {
    for (int32_t e : obs.experts) {
        count_[static_cast<size_t>(obs.layer) * n_experts_ + e] += 1.0;
    }
}

// ---- static hot set ----------------------------------------------------------------------------------------------

StaticPolicy::StaticPolicy(std::vector<int64_t> keys, std::vector<double> weights)
    : keys_(std::move(keys)), weights_(std::move(weights)) {
    if (!weights_.empty() && weights_.size() != keys_.size()) {
        throw std::invalid_argument("StaticPolicy: weights must be empty or as long as keys");
    }
}

void StaticPolicy::reset(int n_layers, int n_experts) {
    n_experts_ = n_experts;
    weight_of_.assign(static_cast<size_t>(n_layers) * n_experts, -1.0);
    for (size_t i = 0; i < keys_.size(); ++i) {
        if (keys_[i] < 0 || keys_[i] >= static_cast<int64_t>(weight_of_.size())) {
            throw std::invalid_argument("StaticPolicy: key " + std::to_string(keys_[i]) + " outside 0.." +
                                        std::to_string(weight_of_.size() - 1));
        }
        weight_of_[keys_[i]] = weights_.empty() ? 1.0 : weights_[i];
    }
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
}

void BeladyPolicy::observe(const LayerObservation & obs) {
    now_ = obs.step * future_.n_layers + obs.layer;
}

double BeladyPolicy::priority(int layer, int expert) {
    const size_t key = static_cast<size_t>(layer) * future_.n_experts + expert;
    if (key >= future_.uses.size()) {
        throw std::logic_error("BeladyPolicy: prepare() was not called with this run's future accesses");
    }
    const std::vector<int64_t> & u = future_.uses[key];
    size_t & c = cursor_[key];
    while (c < u.size() && u[c] <= now_) ++c;
    // Farthest next use evicted first. One ubatch needs several experts at once, so next uses tie; ties go to the
    // uses after that (lexicographic on the future-use sequence: keep the expert needed again sooner), to the depth
    // that fits exactly in a double's 53-bit mantissa (depth_ levels of horizon_+1 values each).
    const double base = static_cast<double>(horizon_) + 1.0;
    double key_value = 0.0;
    for (int d = 0; d < depth_; ++d) {
        const size_t i = c + static_cast<size_t>(d);
        key_value = key_value * base + (i < u.size() ? double(u[i]) : double(horizon_));
    }
    return -key_value;
}

std::shared_ptr<CachePolicy> make_cache_policy(const std::string & name) {
    if (name == "mrs") return std::make_shared<MRSPolicy>();
    if (name == "lru") return std::make_shared<LRUPolicy>();
    if (name == "lfu") return std::make_shared<LFUPolicy>();
    if (name == "belady") return std::make_shared<BeladyPolicy>();
    throw std::invalid_argument("unknown cache policy '" + name + "' (known: mrs, lru, lfu, belady; static sets "
                                "are built from a profile)");
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
    policy_->reset(n_layers(), n_experts_);
}

double ExpertCache::total_expert_bytes() const {
    double t = 0.0;
    for (double b : bytes_) t += b * n_experts_;
    return t;
}

const ExpertCache::Entry & ExpertCache::entry(int layer, int expert) const {
    if (layer < 0 || layer >= n_layers() || expert < 0 || expert >= n_experts_) {
        throw std::out_of_range("ExpertCache: (layer " + std::to_string(layer) + ", expert " +
                                std::to_string(expert) + ") out of range");
    }
    return entries_[static_cast<size_t>(layer) * n_experts_ + expert];
}

ExpertCache::Entry & ExpertCache::entry(int layer, int expert) {
    return const_cast<Entry &>(static_cast<const ExpertCache *>(this)->entry(layer, expert));
}

void ExpertCache::observe(const LayerObservation & obs) { policy_->observe(obs); }

int ExpertCache::access(int layer, int expert, double now_s) {
    Entry & en = entry(layer, expert);
    ++stats_.accesses;
    en.last_use = ++clock_;
    if (!en.resident) {
        ++stats_.misses;
        return 0;
    }
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

void ExpertCache::insert(int64_t key, double ready_s, bool by_prefetch) {
    Entry & en = entries_[key];
    en.resident = true;
    en.prefetched_unused = by_prefetch;
    en.ready_s = ready_s;
    en.slot = static_cast<int32_t>(resident_.size());
    if (en.last_use < 0) en.last_use = clock_;
    resident_.push_back(key);
    used_ += bytes_[key / n_experts_];
}

void ExpertCache::remove(int64_t key) {
    Entry & en = entries_[key];
    const int32_t slot = en.slot;
    resident_[slot] = resident_.back();
    entries_[resident_[slot]].slot = slot;
    resident_.pop_back();
    en.resident = false;
    en.prefetched_unused = false;
    en.slot = -1;
    used_ -= bytes_[key / n_experts_];
    if (used_ < 0.0) used_ = 0.0;
}

bool ExpertCache::admit(int layer, int expert, double ready_s, bool by_prefetch) {
    Entry & en = entry(layer, expert);
    const int64_t key = static_cast<int64_t>(layer) * n_experts_ + expert;
    if (en.resident) return true;
    const double need = bytes_[layer];
    if (need <= 0.0 || need > budget_ || !policy_->admit(layer, expert)) {
        ++stats_.declined;
        return false;
    }
    // Choose victims (lowest priority, ties least recently used) until the expert fits.
    thread_local std::vector<int32_t> victims;
    victims.clear();
    double freed = 0.0;
    const double incoming = (budget_ - used_ >= need) ? 0.0 : policy_->priority(layer, expert);
    while (used_ - freed + need > budget_ * (1.0 + 1e-12)) {
        int32_t best = -1;
        double best_p = 0.0;
        int64_t best_use = 0;
        for (int32_t s = 0; s < static_cast<int32_t>(resident_.size()); ++s) {
            const Entry & r = entries_[resident_[s]];
            if (r.pins > 0 || std::find(victims.begin(), victims.end(), s) != victims.end()) continue;
            const int64_t k = resident_[s];
            const double p = policy_->priority(static_cast<int>(k / n_experts_), static_cast<int>(k % n_experts_));
            if (best < 0 || p < best_p || (p == best_p && r.last_use < best_use)) {
                best = s;
                best_p = p;
                best_use = r.last_use;
            }
        }
        if (best < 0 || (policy_->bypass() && incoming <= best_p)) {
            ++stats_.declined;
            return false;
        }
        victims.push_back(best);
        freed += bytes_[resident_[best] / n_experts_];
    }
    // Remove victims by key (slots move on removal).
    thread_local std::vector<int64_t> keys;
    keys.clear();
    for (int32_t s : victims) keys.push_back(resident_[s]);
    for (int64_t k : keys) {
        remove(k);
        if (record_evicted_) evicted_.push_back(k);
        ++stats_.evictions;
    }
    insert(key, ready_s, by_prefetch);
    ++stats_.admissions;
    return true;
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
        incoming_.push_back({policy_->priority(layer, experts[i]), en.last_use, key,
                             ready_s.empty() ? 0.0 : ready_s[i]});
    }
    if (incoming_.empty()) return 0;
    std::stable_sort(incoming_.begin(), incoming_.end(),
                     [](const Candidate & a, const Candidate & b) { return a.priority > b.priority; });
    // How many need a victim; one scan ranks the unpinned residents (lowest priority, then least recent, first).
    const double free_bytes = budget_ * (1.0 + 1e-12) - used_;
    const size_t fit_free = free_bytes >= need ? static_cast<size_t>(free_bytes / need) : 0;
    victims_.clear();
    if (incoming_.size() > fit_free) {
        scan_keys_.clear();
        for (int64_t k : resident_) {
            if (entries_[k].pins == 0) scan_keys_.push_back(k);
        }
        scan_priority_.resize(scan_keys_.size());
        policy_->priorities(scan_keys_.data(), scan_keys_.size(), n_experts_, scan_priority_.data());
        for (size_t i = 0; i < scan_keys_.size(); ++i) {
            victims_.push_back({scan_priority_[i], entries_[scan_keys_[i]].last_use, scan_keys_[i], 0.0});
        }
        auto order = [](const Candidate & a, const Candidate & b) {
            return a.priority < b.priority || (a.priority == b.priority && a.last_use < b.last_use);
        };
        // Only the lowest few need ordering: enough to free room for every newcomer even if each victim were
        // the smallest expert of any layer.
        double smallest = need;
        for (double b : bytes_) {
            if (b > 0.0) smallest = std::min(smallest, b);
        }
        const double missing = double(incoming_.size()) * need - std::max(0.0, free_bytes);
        const size_t m = std::min(victims_.size(), static_cast<size_t>(std::ceil(missing / smallest)) + 1);
        std::partial_sort(victims_.begin(), victims_.begin() + m, victims_.end(), order);
        victims_.resize(m);
    }
    int admitted = 0;
    size_t v = 0;
    for (size_t ci = 0; ci < incoming_.size(); ++ci) {
        const Candidate & c = incoming_[ci];
        // Free bytes first, then victims in order; decline (and stop: the rest rank lower) when none is left or,
        // for bypass policies, when the newcomer does not outrank the victim.
        const size_t first_victim = v;
        double freed = 0.0;
        bool ok = true;
        while (used_ - freed + need > budget_ * (1.0 + 1e-12)) {
            if (v >= victims_.size() || (policy_->bypass() && c.priority <= victims_[v].priority)) {
                ok = false;
                break;
            }
            freed += bytes_[victims_[v].key / n_experts_];
            ++v;
        }
        if (!ok) {
            stats_.declined += static_cast<int64_t>(incoming_.size() - ci);
            break;
        }
        for (size_t i = first_victim; i < v; ++i) {
            remove(victims_[i].key);
            if (record_evicted_) evicted_.push_back(victims_[i].key);
            ++stats_.evictions;
        }
        insert(c.key, c.ready_s, by_prefetch);
        ++stats_.admissions;
        ++admitted;
    }
    return admitted;
}

void ExpertCache::pin(int layer, int expert) { ++entry(layer, expert).pins; }

void ExpertCache::unpin(int layer, int expert) {
    Entry & en = entry(layer, expert);
    if (en.pins <= 0) {
        throw std::logic_error("ExpertCache.unpin: (layer " + std::to_string(layer) + ", expert " +
                               std::to_string(expert) + ") is not pinned");
    }
    --en.pins;
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
        insert(key, 0.0, false);
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
