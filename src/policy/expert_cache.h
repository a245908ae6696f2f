// GPU expert cache over one global byte budget shared by all MoE layers (HybriMoE §IV.D; docs/design.md §4).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace hybrimoe {

/// What a cache policy sees of one (MoE layer, ubatch) after its router ran.
/// `scores` is empty (no router scores: MRS then scores each activated expert 1/top_k per token, as docs/design.md §4
/// says for traces without scores) or row-major `[n_tokens, n_experts]` router probabilities.
struct LayerObservation {
    int64_t step = 0;              ///< ubatch index (decode: token index)
    int layer = 0;                 ///< MoE layer index
    int n_tokens = 1;
    int top_k = 1;
    int n_experts = 1;
    std::vector<int32_t> experts;  ///< activated experts, distinct
    std::vector<int32_t> loads;    ///< tokens per activated expert
    std::vector<float> scores;     ///< optional router probabilities

    /// Sets the routing part of the observation: shape and the activated experts with their loads
    /// (as LayerInput::set_routing computed them).
    void set_routed(int layer_, int n_tokens_, int top_k_, int n_experts_, const std::vector<int32_t> & experts_,
                    const std::vector<int32_t> & loads_) {
        layer = layer_;
        n_tokens = n_tokens_;
        top_k = top_k_;
        n_experts = n_experts_;
        experts = experts_;
        loads = loads_;
    }
};

/// Future uses for clairvoyant policies: uses[layer * n_experts + expert] = increasing access times
/// (time = step * n_layers + layer).
struct FutureAccesses {
    int n_layers = 0;
    int n_experts = 0;
    std::vector<std::vector<int64_t>> uses;
};

/// Throws std::invalid_argument (naming `who`) unless `obs` fits a policy reset to n_layers x n_experts: its layer in
/// range, its n_experts equal, top_k and n_tokens >= 1, expert ids in range, loads empty or one per expert, scores
/// empty or [n_tokens, n_experts]. A policy checks before it changes any state.
void check_observation(const LayerObservation & obs, int n_layers, int n_experts, const char * who);

/// A replacement policy: keeps its own statistics, ranks residents, may veto admission.
/// The cache evicts the unpinned resident with the lowest `priority`, ties to the least recently used.
class CachePolicy {
public:
    virtual ~CachePolicy() = default;
    virtual std::string name() const = 0;
    /// Called when the cache is (re)built. Throws std::invalid_argument on bad sizes.
    virtual void reset(int n_layers, int n_experts) { (void)n_layers; (void)n_experts; }
    /// Called once per (layer, ubatch) before its lookups.
    virtual void observe(const LayerObservation & obs) { (void)obs; }
    /// Higher keeps longer.
    virtual double priority(int layer, int expert) = 0;
    /// priority() of n keys (layer * n_experts + expert) into out; override to avoid one virtual call per key.
    virtual void priorities(const int64_t * keys, size_t n, int n_experts, double * out) {
        for (size_t i = 0; i < n; ++i) {
            out[i] = priority(static_cast<int>(keys[i] / n_experts), static_cast<int>(keys[i] % n_experts));
        }
    }
    /// False refuses to cache (layer, expert) at all (static hot sets).
    virtual bool admit(int layer, int expert) { (void)layer; (void)expert; return true; }
    /// True lets the cache decline an admission whose priority is not above the would-be victim's (Belady bypass;
    /// on a tie the resident stays, which avoids a copy and matters when one ubatch needs both).
    virtual bool bypass() const { return false; }
    /// Clairvoyant policies receive the whole future before a run.
    virtual void prepare(const FutureAccesses & future) { (void)future; }
    /// True when the policy needs `prepare` before a run.
    virtual bool clairvoyant() const { return false; }

    /// True when priority(layer, e) changes only where the policy says so through `touch(layer)` (built-in
    /// policies: in observe of that layer, set_score, reset, prepare). The cache then keeps its eviction order
    /// per layer and re-reads a layer only after its revision moved. False (the default, and every Python
    /// subclass) makes the cache re-read every resident's priority at each admission that needs a victim.
    virtual bool tracks_changes() const { return false; }
    /// Counter that grows whenever priorities of `layer` may have changed (only meaningful with tracks_changes).
    uint64_t revision(int layer) const {
        return rev_all_ + (static_cast<size_t>(layer) < rev_layer_.size() ? rev_layer_[layer] : 0);
    }
    /// How many times priorities were marked as changed so far, and the layer of the last mark (-1: all layers):
    /// a cache that saw touches() == n and now sees n + 1 knows that only last_touched() may have changed.
    uint64_t touches() const { return touches_; }
    int last_touched() const { return last_touched_; }

    /// The sizes of the last reset (set by ExpertCache and the Python binding of reset; -1 before any), so that a
    /// caller outside the cache can check a key before priority(), which does not (it is the cache's hot path).
    void set_shape(int n_layers, int n_experts) {
        shape_layers_ = n_layers;
        shape_experts_ = n_experts;
    }
    /// Throws std::out_of_range unless (layer, expert) is within the last reset's sizes.
    void check_key(int layer, int expert, const char * what) const {
        if (shape_layers_ < 0) {
            throw std::out_of_range(std::string(what) + ": call reset(n_layers, n_experts) first");
        }
        if (layer < 0 || layer >= shape_layers_ || expert < 0 || expert >= shape_experts_) {
            throw std::out_of_range(std::string(what) + ": (layer " + std::to_string(layer) + ", expert " +
                                    std::to_string(expert) + ") outside " + std::to_string(shape_layers_) +
                                    " layers x " + std::to_string(shape_experts_) + " experts");
        }
    }

protected:
    int shape_layers_ = -1, shape_experts_ = -1;
    /// Marks the priorities of one layer (layer < 0: all layers) as changed.
    void touch(int layer) {
        ++touches_;
        last_touched_ = layer < 0 ? -1 : layer;
        if (layer < 0) {
            ++rev_all_;
            return;
        }
        if (static_cast<size_t>(layer) >= rev_layer_.size()) rev_layer_.resize(static_cast<size_t>(layer) + 1, 0);
        ++rev_layer_[layer];
    }

private:
    uint64_t rev_all_ = 0;
    std::vector<uint64_t> rev_layer_;
    uint64_t touches_ = 0;
    int last_touched_ = -1;
};

/// MRS, "minus recent score" (HybriMoE §IV.D): S[e] <- alpha * TopP(s)[e] + (1 - alpha) * S[e] for every expert
/// of the observed layer, where s aggregates the ubatch's per-token router scores by mean (default) or max and
/// TopP keeps the p largest entries (p = 0 means 2 * top_k). Without scores each token gives 1/top_k to each of its
/// activated experts. Throws std::invalid_argument unless 0 < alpha <= 1 and p >= 0.
class MRSPolicy : public CachePolicy {
public:
    explicit MRSPolicy(double alpha = 0.5, int p = 0, bool use_max = false);
    std::string name() const override { return "mrs"; }
    void reset(int n_layers, int n_experts) override;
    void observe(const LayerObservation & obs) override;
    double priority(int layer, int expert) override { return score_[static_cast<size_t>(layer) * n_experts_ + expert]; }
    void priorities(const int64_t * keys, size_t n, int, double * out) override {
        for (size_t i = 0; i < n; ++i) out[i] = score_[keys[i]];
    }
    bool tracks_changes() const override { return true; }
    double score(int layer, int expert) const;
    void set_score(int layer, int expert, double s);

private:
    double alpha_;
    int p_;
    bool use_max_;
    int n_layers_ = 0, n_experts_ = 0;
    std::vector<double> score_;
    std::vector<double> agg_;
    struct Scored {
        double v;
        int32_t e;
    };
    std::vector<Scored> cand_, kept_;  // TopP's candidates and the entries kept, of one observation
    /// The p entries of v[0..n) (p < n) that rank highest by value, ties to the lower index, into kept (unordered);
    /// cand: scratch.
    static void top_p(const double * v, int n, int p, std::vector<Scored> & cand, std::vector<Scored> & kept);
};

/// LRU: every resident has the same priority, so the cache's least-recently-used tie-break decides.
class LRUPolicy : public CachePolicy {
public:
    std::string name() const override { return "lru"; }
    double priority(int, int) override { return 0.0; }
    void priorities(const int64_t *, size_t n, int, double * out) override { std::fill(out, out + n, 0.0); }
    bool tracks_changes() const override { return true; }
};

/// LFU: priority = number of (ubatch, layer) activations seen so far; ties LRU.
class LFUPolicy : public CachePolicy {
public:
    std::string name() const override { return "lfu"; }
    void reset(int n_layers, int n_experts) override;
    void observe(const LayerObservation & obs) override;
    double priority(int layer, int expert) override { return count_[static_cast<size_t>(layer) * n_experts_ + expert]; }
    void priorities(const int64_t * keys, size_t n, int, double * out) override {
        for (size_t i = 0; i < n; ++i) out[i] = count_[keys[i]];
    }
    bool tracks_changes() const override { return true; }

private:
    int n_layers_ = 0, n_experts_ = 0;
    std::vector<double> count_;
};

/// Static hot set (kTransformers-style, upstream --n-cpu-moe): only the given (layer, expert) keys are ever
/// admitted; their priority is their profile weight. Build the set with `ExpertCache::fill`.
class StaticPolicy : public CachePolicy {
public:
    /// keys are layer * n_experts + expert; weights the same length (higher = more important) or empty.
    StaticPolicy(std::vector<int64_t> keys, std::vector<double> weights);
    std::string name() const override { return "static"; }
    void reset(int n_layers, int n_experts) override;
    double priority(int layer, int expert) override;
    bool admit(int layer, int expert) override;
    bool tracks_changes() const override { return true; }

private:
    std::vector<int64_t> keys_;
    std::vector<double> weights_;
    std::vector<double> weight_of_;  // dense, -1 = not in the set
    int n_experts_ = 0;
};

/// Belady with bypass (clairvoyant; evaluation only): evicts the resident used farthest in the future and declines
/// to admit an expert not used sooner than that victim. One ubatch needs several experts, so next uses tie; ties
/// go to the later uses (lexicographic on the future-use sequence, as deep as fits exactly in a double: 8 uses for
/// short runs, 2 for 20k decode tokens x 26 layers). Needs `prepare` with the run's future accesses.
class BeladyPolicy : public CachePolicy {
public:
    std::string name() const override { return "belady"; }
    void prepare(const FutureAccesses & future) override;
    void observe(const LayerObservation & obs) override;
    double priority(int layer, int expert) override;
    /// priority() of each key, indexing the future uses by the key itself (same numbers, no division per key).
    void priorities(const int64_t * keys, size_t n, int n_experts, double * out) override;
    bool bypass() const override { return true; }
    bool clairvoyant() const override { return true; }
    /// A key's next uses move only when its layer is observed (time = step * n_layers + layer).
    bool tracks_changes() const override { return true; }

private:
    /// priority() of key = layer * n_experts + expert; std::logic_error before prepare() or for a key beyond it.
    double priority_of(size_t key);
    FutureAccesses future_;
    std::vector<size_t> cursor_;
    // a key's priority depends only on its cursor (its future uses and the depth are fixed by prepare()): the last
    // value computed, and the cursor it was computed at (SIZE_MAX: none)
    std::vector<size_t> memo_cursor_;
    std::vector<double> memo_value_;
    int64_t now_ = -1;
    int64_t horizon_ = 0;
    int depth_ = 1;
};

/// Builds a cache policy by name: "mrs", "lru", "lfu", "belady". Throws std::invalid_argument otherwise.
std::shared_ptr<CachePolicy> make_cache_policy(const std::string & name);

/// Counters. A hit is an activated (layer, ubatch, expert) resident when its layer is scheduled; one whose copy is
/// still in flight then (ready_s later than the lookup time) is a miss, counted again under `late`.
struct CacheStats {
    int64_t accesses = 0;
    int64_t demand_hits = 0;     ///< resident through an earlier demand load or the initial fill
    int64_t prefetch_hits = 0;   ///< first use of an expert brought in by a prefetch
    int64_t misses = 0;
    int64_t late = 0;            ///< misses whose copy (usually a prefetch) was in flight at lookup time
    int64_t admissions = 0;
    int64_t evictions = 0;
    int64_t declined = 0;        ///< admissions refused (policy veto, bypass, or everything pinned)
    double hit_rate() const { return accesses ? double(demand_hits + prefetch_hits) / double(accesses) : 0.0; }
};

/// The set of experts resident (or in flight) on the GPU under one byte budget for all layers.
/// Layers with expert_bytes 0 (dense) get no slots. Times are seconds on the caller's clock.
class ExpertCache {
public:
    /// expert_bytes_per_layer: bytes of one routed expert of each MoE layer (>= 0; at least one > 0).
    /// budget_bytes: 0 is valid (nothing cached); throws std::invalid_argument if negative, not finite, or
    /// positive but smaller than the smallest expert. policy must not be null.
    ExpertCache(std::vector<double> expert_bytes_per_layer, int n_experts, double budget_bytes,
                std::shared_ptr<CachePolicy> policy);

    int n_layers() const { return static_cast<int>(bytes_.size()); }
    int n_experts() const { return n_experts_; }
    double budget_bytes() const { return budget_; }
    double used_bytes() const { return used_; }
    double total_expert_bytes() const;
    CachePolicy & policy() { return *policy_; }
    std::shared_ptr<CachePolicy> policy_ptr() const { return policy_; }

    bool resident(int layer, int expert) const { return entry(layer, expert).resident; }
    /// When a resident expert's weights are usable (0 for ones present from the start).
    double ready_s(int layer, int expert) const { return entry(layer, expert).ready_s; }
    bool pinned(int layer, int expert) const { return entry(layer, expert).pins > 0; }
    int n_resident() const { return static_cast<int>(resident_.size()); }
    /// Resident keys layer * n_experts + expert, in no particular order.
    std::vector<int64_t> resident_keys() const { return resident_; }

    /// Forwards to the policy's observe.
    void observe(const LayerObservation & obs);
    /// Counts one lookup of an activated expert at time now_s and returns 0 miss, 1 demand hit, 2 prefetch hit,
    /// 3 late (resident but its copy ends after now_s: a miss). The default now_s never finds a copy late.
    int access(int layer, int expert, double now_s = std::numeric_limits<double>::infinity());
    /// Tries to make (layer, expert) resident, usable from ready_s, evicting unpinned residents of lowest priority
    /// (ties LRU). Returns false (and changes nothing) when the policy vetoes or bypasses, or not enough unpinned
    /// bytes exist. Already resident: returns true. `demand`: the scheduler runs this expert on the GPU now (a
    /// demand load); a bypass policy (Belady) then does not refuse it, since refusing moves the expert to the CPU,
    /// which in a large ubatch costs far more than the copy (a clairvoyant bound must not be slower than the
    /// policies it bounds).
    bool admit(int layer, int expert, double ready_s, bool by_prefetch, bool demand = false);
    /// admit() of a prefetch read ahead of use, ranked as the most recently used: the kernel adds newly read pages
    /// (its read-around and read-ahead included) at the head of its LRU (folio_add_lru, Linux mm/swap.c), so they
    /// age from their read, whatever earlier uses of the same expert left behind.
    bool admit_read_ahead(int layer, int expert, double ready_s);
    /// admit() of an expert a faster tier gave up (its GPU copy evicted, copied back into this RAM tier: exclusive
    /// tiers, docs/design.md §17): as a prefetch, usable from ready_s, and only by displacing residents that rank
    /// below it (its priority under the policy at least the victim's: a tie enters, as a recency order would
    /// admit the expert used last); it never bypasses the ranking as a demand would.
    bool admit_demoted(int layer, int expert, double ready_s);
    /// A lookup of (layer, expert) counted a miss, and by the expert's use a read ahead of it (admit_read_ahead:
    /// the read-around of another expert's fault in the same layer) has brought it in: recounts that miss as a
    /// prefetch hit. Does nothing unless the expert is resident and unused since its prefetch.
    void found_read_ahead(int layer, int expert);
    /// Admits several experts of one layer at once, most valuable (highest priority) first, with one scan for
    /// victims instead of one per expert; same decisions as calling `admit` in that order when the newcomers are
    /// pinned. ready_s: one per expert or empty (all 0). Returns how many were admitted (already resident not
    /// counted). Throws std::invalid_argument if ready_s has another length.
    int admit_batch(int layer, const std::vector<int32_t> & experts, const std::vector<double> & ready_s,
                    bool by_prefetch);
    /// Sets when a resident expert's weights are usable (e.g. its copy's estimated end, once the copy is queued).
    /// Throws std::logic_error if it is not resident.
    void set_ready(int layer, int expert, double ready_s);
    void pin(int layer, int expert);
    /// Throws std::logic_error if the expert is not pinned.
    void unpin(int layer, int expert);
    /// Drops one resident expert (no stats). Throws std::logic_error if it is pinned.
    void evict(int layer, int expert);
    /// Initial fill: admits keys (layer * n_experts + expert) in order while they fit, ready at time 0,
    /// counted neither as admissions nor as prefetches. Returns how many were admitted.
    int fill(const std::vector<int64_t> & keys);

    const CacheStats & stats() const { return stats_; }
    void reset_stats() { stats_ = CacheStats{}; }

    /// Frequency admission (TinyLFU, Einziger, Friedman and Manes, ACM Trans. Storage 13(4), 2017): a prefetch or
    /// fill that needs victims is admitted only if the newcomer's access frequency is above each victim's, so an
    /// expert seen once does not displace one used every token. Demand loads (the scheduler runs the expert on the
    /// GPU now) are exempt. Frequencies count every access() and are halved every `window` accesses (TinyLFU's
    /// reset; window 0: 10 x the cache's capacity in experts, as the paper's sample size). Off by default.
    void set_frequency_admission(bool on, int64_t window = 0);
    bool frequency_admission() const { return freq_admission_; }
    /// Priority admission (for a policy that predicts reuse): in a ubatch of at most kSmallVisitTokens tokens
    /// (decode), a prefetch or fill (`admit` without `demand`) that needs victims is admitted only if its policy
    /// priority is at least each victim's (the predicted reuse of the newcomer against the victim's), instead of by
    /// frequency; larger ubatches keep frequency admission where it is on. The rule goes by the last observed
    /// ubatch's size, not by stage: a prompt's last chunk of a few tokens counts as decode, a decode step of more
    /// sequences as prefill. Demand loads, reads ahead (admit_read_ahead) and demoted experts (admit_demoted) keep
    /// their own rules. Off by default.
    void set_priority_admission(bool on) { prio_admission_ = on; }
    bool priority_admission() const { return prio_admission_; }
    /// The most tokens of a ubatch that priority admission (and ReusePolicy's learning) treat as decode.
    static constexpr int kSmallVisitTokens = 4;
    /// The access frequency admission compares (0 for keys never accessed).
    double frequency(int layer, int expert) const { return freq_.empty() ? 0.0 : freq_[(size_t) layer * n_experts_ + expert]; }
    /// Streaming demand loads: in a (layer, ubatch) whose router activated at least `min_active_fraction` of the
    /// layer's experts, a demand load enters the cache on probation: it ranks below every other unpinned resident
    /// (evicted first, whatever its policy priority) until a later lookup finds it resident. In a large prefill
    /// ubatch nearly every expert of every layer is activated, so every resident is needed at its layer's next visit
    /// and a demand load that evicts one only moves a miss to that visit: the cyclic access pattern on which
    /// recency-ordered insertion thrashes and insertion at the lowest position does not (LIP, Qureshi et al.,
    /// "Adaptive insertion policies for high performance caching", ISCA 2007). The expert still runs on the GPU
    /// for this ubatch; the next demand loads reuse its slot. 0 (the default) turns it off. Throws
    /// std::invalid_argument unless 0 <= min_active_fraction <= 1.
    void set_streaming_demand(double min_active_fraction);
    double streaming_demand() const { return stream_min_active_; }
    /// True while (layer, expert) is resident on probation (set_streaming_demand).
    bool on_probation(int layer, int expert) const { return entry(layer, expert).probation; }
    /// Evicted keys, in order, since the last call; recorded only after set_record_evicted(true).
    std::vector<int64_t> take_evicted();
    void set_record_evicted(bool on) { record_evicted_ = on; }

private:
    struct Entry {
        bool resident = false;
        bool prefetched_unused = false;
        bool probation = false;  // set_streaming_demand: ranked below every other resident until its next hit
        int32_t pins = 0;
        int32_t slot = -1;       // index into resident_
        int32_t member = -1;     // index into members_[layer]
        int64_t last_use = -1;
        double ready_s = 0.0;
    };
    /// The entry of (layer, expert); std::out_of_range naming both when either is out of range. Inline: every
    /// access, residency test and admission goes through it (the throw is out of line, out_of_range below).
    const Entry & entry(int layer, int expert) const {
        if (static_cast<unsigned>(layer) >= static_cast<unsigned>(n_layers()) ||
            static_cast<unsigned>(expert) >= static_cast<unsigned>(n_experts_)) {
            out_of_range(layer, expert);
        }
        return entries_[static_cast<size_t>(layer) * n_experts_ + expert];
    }
    Entry & entry(int layer, int expert) {
        return const_cast<Entry &>(static_cast<const ExpertCache *>(this)->entry(layer, expert));
    }
    [[noreturn]] static void out_of_range(int layer, int expert);
    /// Makes key resident. keep_order: p is its current priority and it is placed in its layer's order when that
    /// order is fresh; otherwise (or when the order is stale) the layer is marked stale.
    void insert(int64_t key, double ready_s, bool by_prefetch, bool keep_order, double p);
    void remove(int64_t key);

    std::vector<double> bytes_;
    int n_experts_;
    double budget_;
    double used_ = 0.0;
    std::shared_ptr<CachePolicy> policy_;
    std::vector<Entry> entries_;
    std::vector<int64_t> resident_;
    std::vector<int64_t> evicted_;
    bool read_ahead_now_ = false;  // inside admit_read_ahead
    bool compete_now_ = false;     // inside admit_demoted or a priority admission: victims rank below the newcomer
    // Eviction order, per layer: the layer's unpinned residents ascending by (priority, last_use, slot), i.e. the
    // victim first (members_ holds all its residents). The slot (position in resident_) breaks full ties exactly
    // as a scan of resident_ in slot order keeping the first strict minimum would. A stale layer's order is
    // rebuilt from members_ before it is needed; a layer goes stale on an access of one of its residents, on a
    // policy revision of its layer, or (policies without tracks_changes) at every admission that needs a victim.
    struct Rank {
        double p;
        int64_t last_use;
        int32_t slot;
        int64_t key;
    };
    static bool rank_less(const Rank & a, const Rank & b) {
        if (a.p != b.p) return a.p < b.p;
        if (a.last_use != b.last_use) return a.last_use < b.last_use;
        return a.slot < b.slot;
    }
    /// Priority as ordered: NaN counts as -infinity (evicted first) so the order stays a strict weak order; an
    /// entry on probation ranks below every finite priority (-max), above NaN.
    static double order_priority(const Entry & en, double p) {
        if (en.probation) return -std::numeric_limits<double>::max();
        return p == p ? p : -std::numeric_limits<double>::infinity();
    }
    bool fresh(int layer) const { return tracks_ && !stale_[layer] && seen_rev_[layer] == policy_->revision(layer); }
    void refresh(int layer);
    /// The layer's order (or its freshness) changed since the tree last looked at it: its leaf is recomputed at the
    /// next sync_tree (or now, inside an admission, when the tree is valid).
    void mark_dirty(int layer) {
        if (!is_dirty_[layer]) {
            is_dirty_[layer] = 1;
            dirty_.push_back(layer);
        }
    }
    /// Brings the orders of every layer that may be out of date (dirty, stale, or a policy revision since the last
    /// sync) up to date, and the tournament tree with them; afterwards the tree is valid.
    void sync_tree();
    /// std::sort / upper_bound comparator over Rank (inlined, unlike a pointer to rank_less).
    struct RankLess {
        bool operator()(const Rank & a, const Rank & b) const { return rank_less(a, b); }
    };
    /// Puts an unpinned resident into its layer's order (sorted when fresh, else marks the layer stale).
    void order_add(int64_t key, bool keep_order, double p);
    /// Takes key out of its layer's order, if there.
    void order_drop(int64_t key);
    /// Layer holding the least head among layers a and b (-1: none).
    int32_t better_layer(int32_t a, int32_t b) const;
    /// Recomputes layer's leaf of the tournament tree over layer heads and its path (no-op unless tree_valid_).
    void head_changed(int layer);
    /// Picks unpinned victims for `need` bytes in eviction order without removing them (none when they fit).
    /// False (victims_ then meaningless) when not enough unpinned bytes exist or, for bypass policies, when
    /// `incoming` does not outrank a victim. Brings every layer's order up to date first unless `refreshed`
    /// (then sets it): callers that change nothing else between calls refresh once.
    bool choose_victims(double need, double incoming, bool & refreshed, bool allow_bypass = true);
    /// admit() after the checks: evict victims_ (from choose_victims) and insert.
    void admit_key(int64_t key, double p, double ready_s, bool by_prefetch);
    std::vector<std::vector<Rank>> order_;
    std::vector<std::vector<int64_t>> members_;
    bool tracks_ = false;
    std::vector<uint8_t> stale_;
    std::vector<uint64_t> seen_rev_;
    std::vector<int32_t> cursor_;       // per layer: how many of its order are chosen in this admission
    // Tournament tree over the layers' heads (order_[l][cursor_[l]]), root tree_[1] = the layer of the global
    // victim. Kept between admissions: a layer whose order changes (or goes stale) outside an admission is marked
    // dirty, and sync_tree recomputes only the dirty layers' leaves and paths (every layer when the policy does
    // not track its changes). tree_valid_: inside one admit / admit_batch call, where the tree is updated at once.
    std::vector<int32_t> tree_;
    int32_t tree_leaves_ = 1;
    bool tree_valid_ = false;
    bool tree_built_ = false;
    std::vector<int32_t> dirty_;
    std::vector<uint8_t> is_dirty_;
    uint64_t seen_touches_ = 0;  // policy_->touches() at the last sync_tree
    std::vector<int32_t> touched_;
    std::vector<int64_t> victims_;
    double stream_min_active_ = 0.0;
    bool stream_now_ = false;  // the observed (layer, ubatch) activates enough experts for streaming demand loads
    bool freq_admission_ = false;
    bool prio_admission_ = false;
    bool small_visit_ = true;  // the last observed visit had at most kSmallVisitTokens tokens
    int64_t freq_window_ = 0, freq_count_ = 0;
    std::vector<double> freq_;
    std::vector<int64_t> rank_keys_;
    std::vector<double> rank_p_;
    struct Candidate {
        double priority;
        int64_t key;
        double ready_s;
    };
    std::vector<Candidate> incoming_;
    int64_t clock_ = 0;
    bool record_evicted_ = false;
    CacheStats stats_;
};

}  // namespace hybrimoe
