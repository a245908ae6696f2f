// One MoE layer's decisions for one ubatch, as the engine takes them and as the simulator replays them (the
// engine and the simulator make the same decisions).
//
// LayerDecider holds the decision rules that sit between the policies (cache, scheduler, prefetcher) and the
// hardware: which experts are looked up and pinned, which planned loads run on the CPU because the cache refused
// them, which prefetches and fills are issued, and when pins are released. The engine (src/runtime/engine.cpp)
// drives it with its slot pool and copy queue behind an ExpertPlacement; replay_decisions (simulator.h) drives it
// from the engine's DecisionRecords with a placement that only counts. Both therefore decide by the same code,
// and a replay that differs from the engine's record points at state the engine changed outside these rules.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "policy/cost_model.h"
#include "policy/expert_cache.h"
#include "policy/prefetcher.h"
#include "policy/scheduler.h"

namespace hybrimoe {

/// One (MoE layer, ubatch) as decided: the inputs a replay needs (routing, scores, expert bytes, copy-queue
/// estimate, predictions, first-use copies) and the decisions to compare (everything else).
struct DecisionRecord {
    int64_t ubatch = 0;                  ///< ubatch counter from 0 (a new ubatch when the MoE layers start over)
    int layer = 0;                       ///< MoE layer index
    int n_tokens = 0, top_k = 0;
    std::vector<int32_t> ids;            ///< [T, k] routed ids, row-major
    std::vector<float> scores;           ///< [T, E] router probabilities (empty: none)
    double expert_bytes = 0;             ///< bytes of one expert of this layer (copy size)
    double now_s = 0;                    ///< decision time on the caller's clock (seconds; the engine's: since it started)
    double pcie_free_s = 0;              ///< copy queue busy for this long (estimate, seconds) when the split was planned
    std::vector<int32_t> experts, loads; ///< activated experts and their token counts
    std::vector<uint8_t> cached;         ///< resident (or its copy queued) when looked up
    std::vector<double> ready_s;         ///< per `experts` index: when a cached one is usable, seconds after now_s
    std::vector<uint8_t> on_disk;        ///< per `experts` index: not in RAM yet (a RAM tier); empty: none
    double read_s = 0;                   ///< seconds one expert read takes (LayerInput::read_s; 0: no disk)
    int read_slots = 1;                  ///< reads in flight at once
    std::vector<uint8_t> planned_gpu;    ///< the scheduler's split (per `experts` index, 1 = GPU)
    std::vector<uint8_t> on_gpu;         ///< the split run (planned loads the cache refused ran on the CPU)
    std::vector<int32_t> loaded, declined, filled;   ///< demand loads admitted / refused; fills admitted
    std::vector<int32_t> first_use;      ///< resident experts whose weights were copied at first use (initial fill)
    std::vector<std::pair<int, int>> prefetched;     ///< (MoE layer, expert) copies issued
    std::vector<Prediction> predictions;             ///< what the prefetcher was shown
    std::vector<int64_t> evicted;        ///< keys (layer * E + expert) evicted while deciding this record
    double makespan_s = 0;               ///< the predicted makespan of the split run (LayerDecider::run_plan, s)
    double extra_copy_bytes = 0;         ///< bytes of the copies queued after the plan (first use, prefetch, fill)
    int extra_copies = 0;                ///< how many copies those are
    double post_launch_copy_bytes = 0;   ///< of those, the bytes queued after the GPU share's launch (prefetch, fill)
    int post_launch_copies = 0;          ///< how many copies those are
    double measured_s = -1;              ///< engine: plan start to the end of the layer's wait op (s); -1: not measured
    /// several devices: a prefetch of another device's layers planned at `layer`'s router (LayerDecider::
    /// prefetch_ahead): only ubatch, layer, n_tokens, top_k, now_s, pcie_free_s, predictions, prefetched and evicted
    /// are set; it belongs to the device of its predictions' layers
    bool prefetch_only = false;
};

/// The predicted makespan (seconds) of a logged record's split run (`on_gpu`) under `cost`: evaluate_plan on the
/// record's inputs (experts, loads, cached, ready_s, pcie_free_s), then the copies queued after the plan charged
/// to the CPU share and those queued after the GPU launch to the GPU share, as LayerDecider does. Equals the record's makespan_s under the cost model it was decided with;
/// under another one it is what that model predicts for the same decisions (calibration fits the copy-overlap
/// fields on engine runs with it). Throws std::invalid_argument on a record whose vectors disagree in length.
double record_makespan(const DecisionRecord & rec, const CostModel & cost);

/// Where decisions meet the device. The engine maps admitted experts to GPU slots and queues their copies; the
/// replay only counts.
class ExpertPlacement {
public:
    enum Kind { kDemand = 0, kPrefetch = 1, kFill = 2, kFirstUse = 3 };
    virtual ~ExpertPlacement() = default;
    /// (layer, expert) was just admitted by the cache (or, kFirstUse, is resident and about to run on the GPU):
    /// give it a slot and queue the copy of its weights. Returns the bytes queued (0: no copy was needed); they
    /// count on the copy-queue estimate. Throws std::runtime_error when no slot is free (bookkeeping bug: the
    /// cache budget is a whole number of slots).
    virtual double load(int layer, int expert, Kind kind) = 0;
    /// Whether MoE layer `layer` can hold experts on the GPU (the engine: its tensors are known).
    virtual bool holds(int layer) const = 0;
    /// A RAM tier below the GPU: the seconds one expert of `layer` takes to read and how many reads run at once
    /// (0 s: no RAM tier, or nothing measured yet; the split then plans without reads), and whether (layer, expert)
    /// must be read before the CPU computes it or the GPU copies it (LayerInput::on_disk).
    virtual double read_s(int layer, int & slots) const {
        (void) layer;
        slots = 1;
        return 0.0;
    }
    virtual bool on_disk(int layer, int expert) const {
        (void) layer;
        (void) expert;
        return false;
    }
    /// The cache evicted these keys (layer * n_experts + expert) since the last call.
    virtual void evicted(const std::vector<int64_t> & keys) { (void) keys; }
};

/// Settings of the rules (the engine's, EngineConfig).
struct DeciderConfig {
    bool has_slots = true;      ///< false: an empty cache (n_slots 0): everything runs on the CPU
    int prefetch_layers = 3;    ///< predicted MoE layers ahead (0: no prefetch)
    bool fill_on_miss = true;   ///< offer CPU-computed misses to the cache while the copy queue idles
};

/// The decision rules of one engine (one cache, one set of policies). Per MoE layer and ubatch: split(), then
/// prefetch() (optional), then fills(); release() after the layer's experts ran. `now_s` is the caller's clock at
/// the split; other times are seconds after it. Copies are queued one after another on one copy engine: a copy
/// queued when the queue estimate is q ends (is ready) at now_s + q + cost.h2d(bytes), and the cache keeps that
/// ready time, so a later lookup of an expert whose copy has not ended yet is a late miss (cached, with a ready
/// time the scheduler waits for), as HybriMoE's PCIe timeline has it (§IV.B).
class LayerDecider {
public:
    /// Throws std::invalid_argument on a null policy or cost-model fields the planner rejects.
    LayerDecider(std::shared_ptr<ExpertCache> cache, std::shared_ptr<SchedulePolicy> scheduler,
                 std::shared_ptr<PrefetchPolicy> prefetcher, CostModel cost, DeciderConfig cfg);

    /// HybriMoE §IV.B/§IV.D. Observes the router scores (MRS), looks up and pins the activated experts, asks the
    /// scheduler for the split with the copy queue busy for `pcie_free_s` (the copy-queue estimate), and admits the planned loads (a load the
    /// cache refuses runs on the CPU); resident experts on the GPU whose weights were never copied get a
    /// first-use copy. ids: [n_tokens, top_k] row-major; scores: [n_tokens, n_experts] router probabilities or
    /// empty, taken by swapping buffers (no copy on the hot path: the caller gets back an earlier buffer to refill).
    /// Without slots (DeciderConfig::has_slots false) nothing counts as cached and everything runs on the CPU.
    /// Returns the split run (1 = GPU) per index of input().experts. Throws std::invalid_argument on an id out of
    /// range, std::runtime_error on a plan whose size or GPU/CPU lists disagree with its split; policy errors
    /// propagate.
    const std::vector<uint8_t> & split(int64_t ubatch, int layer, const int32_t * ids, int n_tokens, int top_k,
                                       std::vector<float> & scores, double expert_bytes, double now_s, double pcie_free_s,
                                       ExpertPlacement & place, DecisionRecord * rec);
    /// Whether prefetch() would do anything after this split (slots, depth, a prefetcher, a next layer):
    /// callers skip computing predictions otherwise.
    bool wants_prefetch(int n_moe_layers) const;
    /// Whether this device prefetches at all (slots, depth, a prefetcher): prefetch_ahead() does nothing otherwise.
    bool prefetches() const { return cfg_.has_slots && cfg_.prefetch_layers > 0 && !no_prefetcher_; }
    /// HybriMoE §IV.C: shows the prefetcher `predictions` (of the layers after the split's layer; start_s in
    /// seconds after the split) with the copy queue as estimated now, then admits, pins (until that layer's
    /// release) and loads what it asks for. The prefetcher sees times on the caller's clock, like the cache's
    /// ready times: now_s, pcie_free_at_s = now_s + pcie_free_s, start_s + now_s. The record keeps the predictions as
    /// given. Throws std::invalid_argument on a request outside the next prefetch_layers layers.
    void prefetch(const std::vector<Prediction> & predictions, int n_moe_layers, ExpertPlacement & place,
                  DecisionRecord * rec);
    /// Several devices (llama.cpp's layer split): the prefetch of this device's layers planned at another device's
    /// MoE layer `from_layer`, whose router just ran (HybriMoE §IV.C across a device boundary). As prefetch(), with
    /// the context given instead of this device's last split: the tokens and top-k of that ubatch, the caller's
    /// clock now_s, this device's copy queue busy for pcie_free_s, and predictions of this device's layers within
    /// (from_layer, from_layer + prefetch_layers] (start_s after now_s). Its copies are charged to no plan (this
    /// device's last plan has run; its next split sees them in the queue). The record, when given, is a
    /// prefetch-only one (DecisionRecord::prefetch_only). Throws as prefetch() does.
    void prefetch_ahead(int64_t ubatch, int from_layer, int n_tokens, int top_k, double now_s, double pcie_free_s,
                        const std::vector<Prediction> & predictions, int n_moe_layers, ExpertPlacement & place,
                        DecisionRecord * rec);
    /// Fills: CPU-computed misses of the split's layer are offered to the cache, in activation order, while the
    /// copy-queue estimate stays below the predicted makespan of the split run (the copy would end before the
    /// layer's work) and, on a host that pays for copies (CostModel::cpu_copy_overlap < 1), while the CPU share
    /// so delayed still ends by then; likewise the GPU share on a device that cannot compute while it copies.
    void fills(ExpertPlacement & place, DecisionRecord * rec);
    /// After MoE layer `layer` ran: unpins its activated experts and the ones prefetched for it.
    void release(int layer);

    const LayerInput & input() const { return in_; }
    /// The observation of the last split (routing, router scores [n_tokens, n_experts]): the cache saw it.
    const LayerObservation & observation() const { return obs_; }
    /// The scheduler's plan of the last split.
    const SchedulePlan & plan() const { return plan_; }
    /// The plan of the split that runs (split()'s result): plan() itself, or its re-evaluation (evaluate_plan)
    /// when the cache refused loads or there are no slots; its makespan is the prediction of the layer's time.
    /// On a host that pays for copies (CostModel::cpu_copy_overlap < 1) its CPU end, and so the makespan, grows
    /// with the first-use copies, prefetches and fills queued after the plan (the engine queues them all before
    /// the layer's CPU share runs).
    const SchedulePlan & run_plan() const { return run_plan_; }
    /// Copy-queue estimate (seconds from the split) after the copies queued so far.
    double pcie_free_s() const { return pcie_free_s_; }
    /// Prefetch requests of the last prefetch() that the cache refused.
    int prefetch_declined() const { return prefetch_declined_; }
    ExpertCache & cache() { return *cache_; }
    const CostModel & cost() const { return cost_; }
    const DeciderConfig & config() const { return cfg_; }
    /// The engine released its slot pool: from now on everything runs on the CPU.
    void set_has_slots(bool on) { cfg_.has_slots = on; }

private:
    void take_evictions(ExpertPlacement & place, DecisionRecord * rec);
    /// The prefetcher's plan for the layers after MoE layer `ml` and its admissions, pins and loads (prefetch()'s
    /// and prefetch_ahead()'s common part; now_s_ and pcie_free_s_ are the context's).
    void plan_prefetches(int ml, int n_tokens, int top_k, const std::vector<Prediction> & predictions,
                         int n_moe_layers, ExpertPlacement & place, DecisionRecord * rec);
    /// Queues the copy of an admitted expert; true when one was queued (the cache then gets its ready time).
    bool load(int layer, int expert, ExpertPlacement::Kind kind, ExpertPlacement & place);
    /// run_plan_'s CPU end and makespan with the copies queued after the plan (extra_copy_s_) charged to the
    /// CPU share and, on a device that cannot compute while it copies (CostModel::copy_overlap < 1), the ones
    /// queued after the GPU launch to the GPU share (its outputs are read after them); updates the record.
    void charge_extra_copies(DecisionRecord * rec);

    std::shared_ptr<ExpertCache> cache_;
    std::shared_ptr<SchedulePolicy> scheduler_;
    std::shared_ptr<PrefetchPolicy> prefetcher_;
    CostModel cost_;
    DeciderConfig cfg_;
    bool no_prefetcher_ = false;
    LayerInput in_;
    SchedulePlan plan_, run_plan_;
    LayerObservation obs_;
    PrefetchContext pctx_;
    std::vector<uint8_t> on_gpu_;
    std::vector<int32_t> pos_;   // expert -> index in in_.experts (-1: not activated)
    double now_s_ = 0.0;
    double pcie_free_s_ = 0.0;
    double extra_copy_s_ = 0.0;   // copy time queued after the plan (first use, prefetch, fill) for this layer
    double extra_copy_bytes_ = 0.0;
    int extra_copies_ = 0;
    double post_launch_copy_s_ = 0.0;  // of extra_copy_s_, the copies queued after the GPU launch (prefetch, fill)
    double post_launch_copy_bytes_ = 0.0;
    int post_launch_copies_ = 0;
    double plan_gpu_end_s_ = 0.0; // run_plan_'s GPU end before those copies
    double plan_cpu_end_s_ = 0.0; // run_plan_'s CPU end before those copies
    int prefetch_declined_ = 0;
    std::vector<std::vector<int32_t>> used_;            // per MoE layer: experts pinned by its split
    std::vector<std::vector<int32_t>> pending_unpin_;   // per MoE layer: experts pinned by earlier prefetches
};

}  // namespace hybrimoe
