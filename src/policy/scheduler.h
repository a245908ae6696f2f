// Intra-layer CPU/GPU split of a MoE layer's activated experts (HybriMoE §IV.B; docs/design.md §2).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "policy/cost_model.h"

namespace hybrimoe {

/// What the scheduler knows about one MoE layer of one ubatch, after its router ran.
/// Times are seconds relative to the moment the routed-expert work of the layer may start.
/// All per-expert vectors have the same length k (the number of distinct activated experts).
struct LayerInput {
    int layer = 0;                 ///< MoE layer index (0-based over MoE layers)
    int n_tokens = 1;              ///< tokens in the ubatch
    double expert_bytes = 0.0;     ///< bytes of one routed expert of this layer (copy size)
    double pcie_free_s = 0.0;      ///< the copy engine is busy until this time (earlier copies, prefetches)
    std::vector<int32_t> experts;  ///< activated expert ids, distinct
    std::vector<int32_t> loads;    ///< tokens routed to each expert, >= 1
    std::vector<uint8_t> cached;   ///< 1 when resident on the GPU or already in flight there
    std::vector<double> ready_s;   ///< for cached experts: when the weights are usable on the GPU (0 = now)
    /// A RAM tier below the GPU cache (docs/design.md §18): per expert, 1 when its bytes are not in RAM yet (on
    /// disk, or its read still in flight). Such an expert is read before the CPU computes it or the GPU copies
    /// it; a cached one on the GPU needs no read. Empty: every expert is in RAM (no disk in the timeline).
    std::vector<uint8_t> on_disk;
    double read_s = 0.0;           ///< seconds one expert's read takes, with up to read_slots reads in flight
    int read_slots = 1;            ///< reads in flight at once (the RAM tier's I/O workers)

    size_t size() const { return experts.size(); }
    /// Whether the disk is in the timeline: some expert on disk and a known read time.
    bool has_disk() const;
    /// Seconds `n` reads take, issued together: ceil(n / read_slots) waves of read_s.
    double reads_s(int n) const;
    /// Throws std::invalid_argument when the vectors disagree in length, a load is < 1, a time is negative
    /// or an expert id repeats.
    void validate() const;
    /// Rebuilds experts/loads from routed ids `[n_tokens, top_k]` row-major (ids in 0..n_experts-1); sets
    /// every expert uncached, ready 0. Throws std::invalid_argument on an id out of range.
    void set_routing(const int32_t * ids, int n_tokens, int top_k, int n_experts);
};

/// A split: which activated experts run where, what to copy, and the predicted timeline (seconds).
struct SchedulePlan {
    std::vector<uint8_t> on_gpu;         ///< per LayerInput index: 1 = GPU, 0 = CPU
    std::vector<int32_t> cpu_experts;    ///< expert ids on the CPU, in execution order
    std::vector<int32_t> gpu_experts;    ///< expert ids on the GPU, in execution order
    std::vector<int32_t> load_experts;   ///< uncached expert ids to copy to the GPU, in copy order
    double makespan_s = 0.0;             ///< max(cpu_end_s, gpu_end_s)
    double cpu_end_s = 0.0;
    double gpu_end_s = 0.0;
    double pcie_end_s = 0.0;             ///< when the last copy of this plan ends (pcie_free_s if none)
    std::string method;                  ///< which plan won: "greedy", "all_cpu", "all_gpu", "exhaustive", ...
};

/// Indices 0..k-1 of `in`'s experts by load descending, ties by expert id ascending: the order every evaluation
/// and the greedy split work in.
void load_descending_order(const LayerInput & in, std::vector<int32_t> & idx);

/// Predicted timeline of a given split `on_gpu` (size k), filling `out` (method untouched).
/// With the disk in the timeline (LayerInput::has_disk) the RAM tier's reads come first, as the engine issues
/// them: those of the GPU's uncached experts on disk (n_g), then the CPU's experts on disk (n_c), all at once. The
/// GPU's copies of experts already in RAM run first; its copies from disk start when their reads end
/// (reads_s(n_g)), and so does its launch; the CPU share starts when every read it needs ended
/// (reads_s(n_g + n_c)), before its start-up.
/// CPU experts run back to back (start-up paid once); uncached GPU experts are copied highest load first from
/// `pcie_free_s` (Johnson's rule with equal copy times, so that order is optimal); the GPU pays one activation
/// round trip, then runs its experts earliest-ready first (optimal for one machine with release times). On a
/// device that cannot compute while it copies (CostModel::copy_overlap < 1) the GPU starts only after
/// copy_blocking(end of the copy queue, this layer's loads included). On a host that pays for copies
/// (CostModel::cpu_copy_overlap < 1) the CPU share ends later by cpu_copy_blocking(this plan's copy time).
/// Returns the makespan in seconds. Throws std::invalid_argument if on_gpu.size() != k.
double evaluate_plan(const LayerInput & in, const CostModel & cost, const std::vector<uint8_t> & on_gpu,
                     SchedulePlan & out);

/// Maps a plan back to routed (token, rank) pairs: device[t*top_k + j] = 1 when the expert that token t
/// routed at rank j (top-k position) runs on the GPU. `ids` `[n_tokens, top_k]` must be the routing `in` was built from.
/// Throws std::invalid_argument on an id not among in.experts.
std::vector<uint8_t> assign_pairs(const LayerInput & in, const SchedulePlan & plan, const int32_t * ids,
                                  int n_tokens, int top_k);

/// The makespan evaluate_plan would give, without building the plan: for searches that try many splits of one
/// layer input (ExhaustiveScheduler, HybriMoEScheduler's best-of, ImpactPrefetcher's gains). prepare() fixes the
/// input, the cost model and the load-descending order; makespan() then takes a split and does the same floating-
/// point operations in the same order as evaluate_plan (so the value is bit-identical), from per-rank costs
/// computed once and without allocating. The input must not change between prepare() and makespan().
class MakespanEvaluator {
public:
    /// `desc`: the input's indices by load descending, ties by expert id ascending (evaluate_plan's order).
    void prepare(const LayerInput & in, const CostModel & cost, const std::vector<int32_t> & desc);
    /// evaluate_plan(in, cost, on_gpu, plan).makespan_s for on_gpu[i] (per LayerInput index, 1 = GPU).
    double makespan(const uint8_t * on_gpu);
    /// The same for the split whose bit i (of LayerInput index i) is 1 for the GPU (k <= 32).
    double makespan_mask(uint32_t mask);
    /// The first mask in 0, 1, ..., 2^k - 1 of least makespan_mask (k <= kMaxMaskSearch), its makespan into `best`:
    /// what evaluating every mask in that order and keeping the first strict minimum gives. A mask is evaluated
    /// only when a lower bound of its makespan is below the best so far (a mask at or above it cannot replace it):
    /// the exact CPU end (the CPU queue's sums for every CPU set, one addition each) and the GPU end's bound from
    /// its last copy.
    uint32_t best_mask(double & best);
    static constexpr int kMaxMaskSearch = 16;
    /// HybriMoE's greedy split of the prepared input (HybriMoE §IV.B), kept as the current split.
    void greedy();
    /// min(greedy, all-CPU, all-GPU) makespan of the prepared input, seconds (HybriMoEScheduler::plan's choice);
    /// with the disk in the timeline, that split improved by improve_split.
    double best_of_greedy_and_trivial();
    /// With the disk in the timeline: moves single experts to the other side while that shortens the makespan
    /// (first improvement, in LayerInput order, at most k rounds); `on_gpu` (per LayerInput index) and `best` (its
    /// makespan) are updated. The greedy does not see the reads; this local search does.
    void improve_split(std::vector<uint8_t> & on_gpu, double & best);
    bool has_disk() const { return disk_; }
    /// best_of_greedy_and_trivial() of the prepared input changed in one place: the uncached expert of LayerInput
    /// index i cached, usable from ready_s, and the copy queue busy for pcie_free_s. Bit-identical to preparing that
    /// input and asking best_of_greedy_and_trivial(), without preparing it (the per-rank costs stay; only the lists
    /// of cached and uncached ranks change, by one entry each way): ImpactPrefetcher's gain of one candidate copy.
    /// The prepared input is unchanged afterwards. Throws std::logic_error if i is cached.
    double best_with_cached(int32_t i, double ready_s, double pcie_free_s);
    /// Makes that change part of the prepared input (ImpactPrefetcher: a copy was issued).
    void set_cached(int32_t i, double ready_s, double pcie_free_s);
    /// A key under which uncached candidates share one best_with_cached(i, t, t) result: when every prepared rank
    /// has the same CPU and the same GPU cost (decode: one token per expert) and t + h2d_s() > t (every copy ends
    /// after the candidate is ready), two candidates with the same key give the same makespan, bit for bit. The
    /// key is the number of cached ranks above i's rank: the candidate then takes the same place in every list the
    /// evaluations walk (ranks differ, costs and ready times in each position do not), and an uncached rank compares
    /// with every other cached rank the same way. -1 when the costs differ (no two candidates known equal).
    int32_t equal_result_key(int32_t i) const;
    /// The copy time of one expert of the prepared input, seconds (CostModel::h2d of its bytes).
    double h2d_s() const { return h2d_s_; }
    /// The current split per LayerInput index (1 = GPU), as a k-vector.
    void split_by_input(std::vector<uint8_t> & on_gpu) const;

private:
    // the split by rank (position in desc): on_rank_[r] = 1 for the GPU
    double makespan_ranked();
    // makespan_ranked() of the all-CPU and the all-GPU split, the same operations without looking at a split
    double makespan_all_cpu();
    double makespan_all_gpu();
    // a lower bound of makespan_all_gpu(), O(uncached) additions
    double makespan_all_gpu_bound() const;
    // The change of best_with_cached / set_cached, and its undoing (positions of the entries moved).
    struct CacheChange {
        int32_t r = -1;           // rank made cached
        size_t unc = 0;           // its position in uncached_ before
        size_t desc = 0, order = 0;  // its positions in cached_desc_ and cached_order_ after
        double ready = 0.0, pcie_free = 0.0;  // ready_rank_[r] and pcie_free_s_ before
    };
    CacheChange apply_cached(int32_t i, double ready_s, double pcie_free_s);
    void undo(const CacheChange & c);

    std::vector<int32_t> index_;          // LayerInput index of each rank
    std::vector<int32_t> rank_of_;        // rank of each LayerInput index
    std::vector<double> cpu_sum_;         // best_mask: CPU queue sum per CPU set (bits: positions in that queue)
    std::vector<uint32_t> queue_set_;     // best_mask: the CPU set of a LayerInput-index mask, as queue positions
    std::vector<double> cpu_s_, gpu_s_;   // cost.cpu(load), cost.gpu(load) per rank
    std::vector<double> ready_rank_;      // ready_s per rank
    std::vector<int32_t> uncached_;       // ranks of the uncached experts, ascending
    std::vector<int32_t> cached_desc_;    // ranks of the cached experts, descending
    std::vector<int32_t> cached_order_;   // ranks of the cached experts by (ready_s, rank) ascending
    std::vector<double> cached_ready_;    // their ready times, in that order
    std::vector<uint8_t> on_rank_;        // scratch: the split by rank
    std::vector<double> copy_end_;        // scratch: copy ends of the split's copied experts, in rank order
    std::vector<int32_t> copy_rank_;      // scratch: their ranks
    double pcie_free_s_ = 0.0, h2d_s_ = 0.0, act_s_ = 0.0, cpu_startup_s_ = 0.0;
    double copy_overlap_ = 1.0, cpu_copy_overlap_ = 1.0;
    double gpu_min_s_ = 0.0;              // the cheapest GPU task
    bool uniform_costs_ = false;          // every rank's cpu_s_ equal, and every gpu_s_ equal
    // the disk in the timeline: the evaluations run evaluate_plan's own code on a copy of the input (kept in step
    // with apply_cached and undo), bit for bit; the fast paths above are for inputs without it
    bool disk_ = false;
    LayerInput disk_in_;
    CostModel disk_cost_;
    std::vector<int32_t> disk_desc_;
    std::vector<uint8_t> disk_split_;
    SchedulePlan disk_plan_;
    double disk_makespan(const uint8_t * on_rank);
};

/// A scheduling policy: decides the CPU/GPU split of one layer. Subclass and override `split`
/// (also from Python via hybrimoe.SchedulePolicy); `plan` evaluates the split with `evaluate_plan`.
class SchedulePolicy {
public:
    virtual ~SchedulePolicy() = default;
    virtual std::string name() const = 0;
    /// Fills on_gpu (size k: 1 = GPU). Must not change `in`.
    virtual void split(const LayerInput & in, const CostModel & cost, std::vector<uint8_t> & on_gpu) = 0;
    /// Split + predicted timeline into `out`.
    virtual void plan(const LayerInput & in, const CostModel & cost, SchedulePlan & out);
};

/// HybriMoE §IV.B greedy simulated split: three timelines (CPU, GPU, PCIe); GPU takes cached experts highest
/// load first; CPU takes uncached experts lowest load first, then cached ones lowest load first; PCIe copies
/// uncached experts highest load first for the GPU; each step gives the next task to the timeline that would
/// finish it earliest. Our documented improvement: the result is the best of that greedy plan, all-CPU and
/// all-GPU (each evaluated with `evaluate_plan`), so it is never worse than either trivial plan.
/// Cost O(k log k); see bench/bench_policy.py for measured microseconds.
class HybriMoEScheduler : public SchedulePolicy {
public:
    std::string name() const override { return "hybrimoe"; }
    void split(const LayerInput & in, const CostModel & cost, std::vector<uint8_t> & on_gpu) override;
    void plan(const LayerInput & in, const CostModel & cost, SchedulePlan & out) override;
    /// plan(in, cost, p).makespan_s without building the plan (bit-identical; ImpactPrefetcher's gains).
    double makespan(const LayerInput & in, const CostModel & cost);
    /// The same with `desc`, the input's load_descending_order (for a caller that evaluates one set of loads
    /// under several cache states).
    double makespan(const LayerInput & in, const CostModel & cost, const std::vector<int32_t> & desc);
    /// The greedy split alone (no best-of), for ablations and tests.
    void greedy_split(const LayerInput & in, const CostModel & cost, std::vector<uint8_t> & on_gpu);

private:
    /// greedy_split on `desc`, the activated experts' indices by load descending (ties expert id ascending).
    void greedy_ordered(const LayerInput & in, const CostModel & cost, const std::vector<int32_t> & desc,
                        std::vector<uint8_t> & on_gpu);

    std::vector<int32_t> by_load_desc_;
    std::vector<uint8_t> trial_;
    SchedulePlan scratch_;
    MakespanEvaluator eval_;
};

/// kTransformers-style: cached experts on the GPU, every uncached expert on the CPU, nothing copied.
class CpuUncachedScheduler : public SchedulePolicy {
public:
    std::string name() const override { return "ktransformers"; }
    void split(const LayerInput & in, const CostModel & cost, std::vector<uint8_t> & on_gpu) override;
};

/// GPU-only with on-demand loading (AdapMoE / MoE-Infinity style): every expert on the GPU.
class GpuOnDemandScheduler : public SchedulePolicy {
public:
    std::string name() const override { return "gpu-on-demand"; }
    void split(const LayerInput & in, const CostModel & cost, std::vector<uint8_t> & on_gpu) override;
};

/// Upstream llama.cpp `--n-cpu-moe N`: experts of MoE layers 0..N-1 run on the CPU, the others on the GPU
/// (where they are resident when the cache holds those layers). Throws std::invalid_argument if N < 0.
class StaticLayerScheduler : public SchedulePolicy {
public:
    explicit StaticLayerScheduler(int n_cpu_layers);
    std::string name() const override { return "upstream-ncmoe"; }
    void split(const LayerInput & in, const CostModel & cost, std::vector<uint8_t> & on_gpu) override;
    int n_cpu_layers() const { return n_cpu_layers_; }

private:
    int n_cpu_layers_;
};

/// Evaluation bound: the optimal split by exhaustive search over all 2^k splits when k <= max_exhaustive
/// (default 10; method "exhaustive"); beyond that a single-flip local search started from the HybriMoE plan
/// (method "local_search", a labelled local optimum, not a proven bound). Throws std::invalid_argument if
/// max_exhaustive is outside 0..24.
class ExhaustiveScheduler : public SchedulePolicy {
public:
    explicit ExhaustiveScheduler(int max_exhaustive = 10);
    std::string name() const override { return "exhaustive"; }
    void split(const LayerInput & in, const CostModel & cost, std::vector<uint8_t> & on_gpu) override;
    void plan(const LayerInput & in, const CostModel & cost, SchedulePlan & out) override;

private:
    int max_exhaustive_;
    std::vector<int32_t> order_;
    HybriMoEScheduler start_;
    SchedulePlan scratch_;
    std::vector<uint8_t> trial_;
    MakespanEvaluator eval_;
};

/// Builds a scheduler by name: "hybrimoe", "ktransformers", "gpu-on-demand", "upstream-ncmoe"
/// (uses n_cpu_layers), "exhaustive". Throws std::invalid_argument naming an unknown name.
std::shared_ptr<SchedulePolicy> make_scheduler(const std::string & name, int n_cpu_layers = 0);

}  // namespace hybrimoe
