// The hybrid CPU+GPU MoE engine (HybriMoE, Zhong et al., DAC 2025; docs/design.md §7-§8).
//
// One Engine per llama_context, driven by the MoE hook (moe_hook.h). Per MoE layer and ubatch the hook's subgraph
// is (node names "hybrimoe_*-il"):
//
//   routing (device)  the routing ids (as F32), routing weights and router probabilities concatenated into one
//                     tensor [2k + n_expert, T] where they are computed, so that they reach the host in one
//                     transfer; the hidden state comes over once more (as upstream's -ot exps=CPU brings it).
//   plan  (1 task)    updates the cache scores; asks the scheduler for the CPU/GPU split; admits and copies the
//                     experts to load (copy queue); launches the GPU share (GpuShare: only the GPU-assigned
//                     (token, rank) pairs, compacted, over the slot pool); plans prefetches for the next layers by
//                     applying their routers to this hidden state (RouterPredictor); offers CPU-computed misses to
//                     the cache (fills). Output I32 [k, T, 2]: plane 0 the ids the CPU share uses (a GPU pair is
//                     -1, which hybrimoe's ggml-cpu skips: no row of it is computed), plane 1 each GPU pair's row
//                     in the wait op's output (-1 for a CPU pair).
//   CPU share         build_expert_ffn over the host expert tensors with plane 0: upstream's ops and kernels, and
//                     every CPU expert gets upstream's rows, so its results are upstream's bit for bit (routing
//                     weights go in before the FFN where upstream puts them there: Llama 4).
//   wait  (1 task)    waits for the GPU share and reads its weighted rows back (one transfer per launch); unpins
//                     the layer's experts.
//   combine           per token, sums the ranks in upstream's order: a CPU pair's row times its routing weight (as
//                     it is, when weighted before the FFN), a GPU pair's row as the GPU weighted it.
//
// Expert weights stay in host memory (llama tensor overrides; Python sets them up), in the file's quant types.
// Each device that serves MoE layers keeps a SlotPool of expert-sized slots (one byte budget per device); which
// (layer, expert) a slot holds is decided by that device's ExpertCache (src/policy) through the decision rules
// shared with the simulator (LayerDecider). With several devices (llama.cpp's layer split: -ngl, -ts) layer l's GPU
// share runs on the device that holds layer l, from that device's slots, and a device caches only its own layers;
// RPC has no copy between devices, so an expert never moves from one GPU to another. A slot that a queued or
// running computation reads is pinned and cannot be evicted.
#pragma once

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"
#include "policy/cost_model.h"
#include "policy/decision.h"
#include "policy/expert_cache.h"
#include "policy/prefetcher.h"
#include "policy/router_predictor.h"
#include "policy/scheduler.h"
#include "runtime/cpu_layout.h"
#include "runtime/expert_ffn.h"
#include "runtime/fused_moe.h"
#include "runtime/gpu_share.h"
#include "runtime/negative_controls.h"
#include "runtime/ram_tier.h"
#include "runtime/routing_replay.h"
#include "runtime/slot_pool.h"

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>
#include <utility>

namespace hybrimoe {

/// Whether the CPU backend registered in this process is hybrimoe's ggml-cpu (patch 0005: mul_mat_id and add_id
/// skip negative expert ids), found through the "CPU" registry's proc address
/// "ggml_backend_cpu_skips_negative_expert_ids". An unpatched ggml-cpu given a negative id writes out of bounds
/// (its id assert is compiled out in release builds), so the engine refuses to run without it.
bool cpu_backend_skips_negative_ids();
/// "" when cpu_backend_skips_negative_ids(), else why the engine cannot run and what to do (one sentence or two).
std::string cpu_backend_problem();
/// Whether ggml-cpu's repacked mul_mat_id (upstream's CPU_REPACK buffer type) skips negative expert ids too (patch
/// 0005, version 2): the engine's CPU share may then run on repacked experts.
bool cpu_backend_skips_negative_ids_repacked();


/// One more accelerator that caches experts (several GPUs; EngineConfig::more_devices): its slot pool's size and
/// device, and the planner's cost model for the layers it serves.
struct EngineDevice {
    int64_t n_slots = 0;                   ///< expert slots on this device (0: its layers run on the CPU)
    ggml_backend_dev_t device = nullptr;
    int64_t max_buffer_bytes = 0;          ///< as EngineConfig::max_buffer_bytes
    CostModel cost;
};

/// The policies of one device's share (Engine's extra devices).
struct EnginePolicies {
    std::shared_ptr<ExpertCache> cache;
    std::shared_ptr<SchedulePolicy> scheduler;
    std::shared_ptr<PrefetchPolicy> prefetcher;
};

/// Facts and settings the engine is built from (Python fills them from the GGUF and the user's options).
struct EngineConfig {
    int n_layer = 0;                       ///< model layers (llama's il range)
    int n_expert = 0;                      ///< routed experts per MoE layer
    int top_k = 0;                         ///< experts used per token
    int n_embd = 0;
    std::vector<int> moe_layers;           ///< model layer index of each MoE layer (cache layer index = position)
    /// per MoE layer: bytes of one expert's gate (or fused gate_up), up and down matrices as stored (ggml nb[2]);
    /// 0 for a matrix the layer does not have (up with a fused gate_up, gate in an ungated FFN)
    std::vector<std::array<int64_t, 3>> expert_bytes;
    /// per MoE layer: ggml types of the gate (gate_up), up and down matrices (an absent one: any valid type)
    std::vector<std::array<int32_t, 3>> expert_types;
    /// per MoE layer: bytes of one expert's gate (gate_up), up and down bias rows (F32, ggml_add_id's [n_out]
    /// row), 0 where the layer has no such bias; empty: no layer has biases. The slot pool carries them per slot.
    std::vector<std::array<int64_t, 3>> bias_bytes;
    /// per MoE layer: bytes of one expert's gate, up and down scales (F32 ffn_*_exps.scale: 4, else 0); empty: no
    /// layer has scales. The slot pool carries them per slot.
    std::vector<std::array<int64_t, 3>> scale_bytes;
    int64_t n_slots = 0;                   ///< GPU expert slots (0: nothing cached, everything on the CPU)
    ggml_backend_dev_t device = nullptr;   ///< accelerator holding the slot pool (needed when n_slots > 0)
    /// bytes one slot buffer may hold at most, below the device's own cap (0: the device's max buffer size only)
    int64_t max_buffer_bytes = 0;
    CostModel cost;                        ///< planner cost model (seconds, bytes/s)
    /// several accelerators: the devices after the one above (n_slots, device, max_buffer_bytes, cost are device
    /// 0), each with a slot pool of its own (empty: one device)
    std::vector<EngineDevice> more_devices;
    /// per MoE layer: the device whose slots serve its GPU share (0: `device`, i: more_devices[i - 1]); llama.cpp's
    /// layer split puts the layer's router there (llama_model_dev_layer). Empty: every layer on device 0.
    std::vector<int> layer_device;
    int prefetch_layers = 3;               ///< predicted MoE layers ahead (0: no prefetch)
    bool fill_on_miss = true;              ///< offer CPU-computed misses to the cache while the copy queue idles
    /// assumed prediction confidence per distance 1..D (RouterPredictor; the last value repeats beyond D)
    std::vector<double> confidence{kDefaultPredictionConfidence.begin(), kDefaultPredictionConfidence.end()};
    /// per MoE layer: router weights F32 [n_expert, n_embd] row-major (empty: no prediction for that layer)
    std::vector<std::vector<float>> routers;
    /// per MoE layer: selection bias added to sigmoid scores (DeepSeek-V3 exp_probs_b) or empty
    std::vector<std::vector<float>> router_bias;
    bool sigmoid_gating = false;           ///< router probabilities by sigmoid (else softmax)
    /// where the routed experts lie in the model's files: the RAM tier reads them from there, and the GPU copies of
    /// experts whose host tensor is repacked take the file's bytes from there (empty: neither is possible)
    ExpertFiles where;
    /// the RAM expert tier (ram.n_slots > 0: routed experts read from the file into host slots; ram_tier.h)
    RamTierConfig ram;
    /// the CPU share as one fused op per layer (fused_moe.h) where it can be, else upstream's ops: 0 off, 1 with
    /// upstream's numbers, 2 also with the repacked gemm kernels that round differently (FusedCpuShare's any_gemm)
    int fused_cpu = 0;
};

/// Per MoE layer counters (read between decodes).
struct EngineLayerStats {
    uint64_t runs = 0, tokens = 0;
    uint64_t cpu_experts = 0, gpu_experts = 0;       ///< distinct experts per run, summed
    uint64_t cpu_late_experts = 0;                   ///< of the CPU's: computed in the second pass (RAM tier: read
                                                     ///< for this layer, not in RAM at its plan)
    uint64_t cpu_pairs = 0, gpu_pairs = 0;           ///< (token, rank) pairs computed on each side, summed
    uint64_t demand_copies = 0, prefetch_copies = 0, fill_copies = 0;
    uint64_t declined_loads = 0;                     ///< planned loads the cache refused (ran on the CPU)
    uint64_t gpu_runs = 0, gpu_launches = 0;         ///< runs with a GPU share; GPU graph launches (per run 1 or 2
                                                     ///< per slot buffer used)
    double bytes_demand = 0, bytes_prefetch = 0, bytes_fill = 0;
    double bytes_act_h2d = 0, bytes_act_d2h = 0;     ///< GPU share inputs up, weighted outputs back (bytes)
    double plan_s = 0, wait_s = 0, layer_s = 0;      ///< seconds in plan, waiting for the GPU, plan start to wait end
    double cpu_share_s = 0;                          ///< seconds from plan end to wait start: the CPU share's nodes
    double cpu_share_cpu_s = 0;                      ///< process CPU seconds over the same span (all threads)
    double predicted_s = 0;                          ///< planner's predicted makespans, summed
};

/// The engine. Thread-safety: its ops run on ggml's thread 0 of the context's CPU backend, one at a time;
/// Python reads statistics between decodes.
class Engine {
public:
    /// Allocates the slot pool on cfg.device (n_slots + 1 slots; the last is an all-zero null slot).
    /// Throws std::invalid_argument on inconsistent facts, std::runtime_error when the CPU backend is not
    /// hybrimoe's ggml-cpu (cpu_backend_skips_negative_ids), the device cannot be initialised or the pool cannot
    /// be allocated (the message names the device and the bytes).
    /// With cfg.ram.n_slots > 0 also opens the RAM tier (RamTier: its files, host slots, I/O workers) with
    /// `ram_cache` as its cache. With GPU slots too, the RAM slots come from the device's pinned host buffer type
    /// when one buffer of it holds them all (else from the CPU's), and every GPU load copies from a RAM slot: an
    /// expert on disk is read into RAM first (a demand read), and is prefetched to the GPU only once it is there.
    /// Several devices (cfg.more_devices): `more` holds the policies of each extra device, in the same order: a
    /// cache over every MoE layer sized to its device's slots (a device only ever caches the layers it serves,
    /// cfg.layer_device: give the other layers expert bytes 0), its schedule and its prefetch policy. Each device
    /// has its own decision rules (LayerDecider: its copy queue, its cost model). Throws std::invalid_argument on a
    /// layer_device entry out of range or a policy missing for a device.
    Engine(EngineConfig cfg, std::shared_ptr<ExpertCache> cache, std::shared_ptr<SchedulePolicy> scheduler,
           std::shared_ptr<PrefetchPolicy> prefetcher, std::shared_ptr<ExpertCache> ram_cache = nullptr,
           std::vector<EnginePolicies> more = {});
    ~Engine();
    /// Waits for queued device work and frees the slot pool, the GPU graphs and the device backends now (the
    /// engine then runs every layer on the CPU). Call before the llama context and the device go away; the
    /// destructor does it otherwise.
    void release();
    Engine(const Engine &) = delete;
    Engine & operator=(const Engine &) = delete;

    /// The GPU slot pool (its geometry, which slot holds which expert; bindings read it). Its static sizing
    /// functions (SlotPool::slot_bytes_for and the region strides) size an engine's slots before it exists.
    const SlotPool & pool(int device = 0) const { return devs_.at((size_t) device)->pool; }
    /// GPU expert slots of every device (0 after release()), or of one.
    int64_t n_slots() const;
    int64_t n_slots(int device) const { return devs_.at((size_t) device)->n_slots; }
    /// Devices with a slot pool (1 + cfg.more_devices), and the one serving MoE layer `ml`'s GPU share.
    int n_devices() const { return (int) devs_.size(); }
    int device_of(int ml) const { return dev_of_.at((size_t) ml); }
    /// The cache of device `device` (0: the one given first).
    const ExpertCache & cache(int device = 0) const { return *devs_.at((size_t) device)->cache; }
    /// Bytes queued for copies to one device since the last reset_stats (between decodes).
    double bytes_copied(int device) const { return devs_.at((size_t) device)->bytes_copied; }
    /// The RAM tier, or nullptr without one (and after release()).
    RamTier * ram() const { return ram_.get(); }
    /// Experts whose weights are in a GPU slot (copied, not a streamed load on probation) and in a RAM slot too:
    /// what exclusive tiers give back between ubatches (0 then). Between decodes only.
    int64_t in_both_tiers() const;
    const EngineConfig & config() const { return cfg_; }
    /// Host buffers the RAM slots may be split over: the combine op takes one CPU share per buffer as a source,
    /// beside the GPU rows, the plan and the routing (GGML_MAX_SRC in all).
    static constexpr int kMaxRamBuffers = GGML_MAX_SRC - 4;
    /// Slot buffers up to which the CPU share runs in two passes (the experts in RAM at the plan, then the ones
    /// read for this layer): two shares per buffer among the combine op's sources.
    static constexpr int kMaxLateBuffers = (GGML_MAX_SRC - 3) / 2;

    /// Builds the layer's replacement subgraph (called by MoeHook::build for supported layers), or nullptr when
    /// this layer's tensors are not the ones the engine was given (upstream's path then). `counters` receives run
    /// counts for the hook's statistics.
    ggml_tensor * build(const llama_moe_hook_args & a, void * counters);

    std::vector<EngineLayerStats> layer_stats() const;
    void reset_stats();
    /// First error since the last call ("" if none): a policy that raised, a failed GPU computation. After an
    /// error the engine runs every layer on the CPU (upstream's numbers) until clear_failure().
    std::string take_error();
    bool failed() const { return failed_; }
    void clear_failure();
    /// MoE layer index of model layer il, or -1.
    int moe_index(int il) const { return il >= 0 && il < (int) moe_index_.size() ? moe_index_[il] : -1; }
    /// Keep a DecisionRecord per (MoE layer, ubatch) from now on (off: stop and drop them).
    void set_logging(bool on);
    /// The records kept since the last call.
    std::vector<DecisionRecord> take_log();
    /// The test-only negative controls (negative_controls.h): results must then differ from upstream's where the GPU
    /// computes. set_negative_control sets the GPU share's left-out variant by name ("" for none; throws
    /// std::invalid_argument for another name).
    void set_negative_control(const std::string & what) { controls_.set_variant(what); }
    void set_drop_gpu_share(bool on) { controls_.drop_gpu_share = on; }
    void set_wrong_bias_rows(bool on) { controls_.wrong_bias_rows = on; }
    void set_repacked_copies(bool on) { controls_.repacked_copies = on; }
    /// The routing replay of the context, whose router scores (when it has them) the cache policies see instead
    /// of the model's own router's for the layers it replays (nullptr: none).
    void set_routing_replay(std::shared_ptr<const RoutingReplay> replay) { replay_ = std::move(replay); }
    void set_fused_swap(bool on) {
        controls_.fused_swap = on;
        if (fused_) fused_->set_swap(on);
    }
    /// Per MoE layer whose graph was built: which of its matrices (gate or gate_up, up, down) the CPU share reads
    /// repacked (upstream's CPU_REPACK layout).
    std::vector<std::array<bool, 3>> repacked() const { return repacked_; }
    /// Per MoE layer: the largest ubatch (tokens) whose CPU share runs fused (fused_moe.h), -1 where none does
    /// (not asked for, or the layer's experts are of a kind it does not compute).
    std::vector<int64_t> fused_max_tokens() const { return fused_max_T_; }
    /// (layer, expert) keys pinned now; 0 between decodes unless prefetched experts wait for their layer.
    int pinned_count() const;

    // ---- custom-op bodies (public for the C trampolines) ----
    struct LayerRun;
    void op_plan(ggml_tensor * dst, LayerRun & run);
    void op_wait(ggml_tensor * dst, LayerRun & run);
    void op_late(ggml_tensor * dst, LayerRun & run);
    void op_fused(ggml_tensor * dst, LayerRun & run, int ith, int nth);

private:
    /// Stages and launches the GPU share of the split just decided (plane 0/1 of the plan's output written).
    void launch_gpu_share(ggml_tensor * dst, LayerRun & run, const std::vector<uint8_t> & on_gpu, int64_t k,
                          int64_t T, const ggml_tensor * x, uint64_t & launches);
    void fail(const std::string & msg);
    /// With the RAM tier: queues the copy of (layer, expert) from its RAM slot (ready) into its GPU slot, holding
    /// the RAM slot until the copy ended when copies are asynchronous. Returns the bytes queued.
    double copy_from_ram(int layer, int expert, int bias_expert);
    /// Drops the RAM holds of GPU copies that ended (sequence number <= the device's copies_done); all of them with
    /// `all`, after waiting for the copy queues. On every device.
    void release_ram_holds(bool all);
    /// RAM slots held for GPU copies, on every device.
    size_t ram_holds() const;
    /// Exclusive tiers (cfg.ram.exclusive): the GPU cache evicts `key`; its GPU copy goes back into a RAM slot
    /// when the RAM tier takes it (RamTier::demote), before the GPU slot is reused. Not in a large ubatch.
    void demote(int64_t key);
    /// Exclusive tiers: MoE layer `ml`'s experts whose weights are on the GPU give up their RAM slots (those that
    /// no layer pins and no copy holds any more; not a streamed load on probation, which leaves at the next load).
    void give_up_ram(int ml);
    /// Whether (l, e)'s weights are in a GPU slot (copied there) that the GPU cache keeps (not a streamed load on
    /// probation).
    bool kept_on_gpu(int l, int e) const;

    EngineConfig cfg_;
    std::vector<int> moe_index_;
    std::vector<ExpertMatrices> tensors_;   // per MoE layer: the host expert tensors (known once built)
    std::vector<std::unique_ptr<LayerRun>> runs_;
    std::unique_ptr<RamTier> ram_;
    /// the experts' file bytes, for GPU copies of repacked experts (mapped at the first build that needs them)
    std::unique_ptr<MappedExperts> originals_;
    /// per MoE layer: which matrix regions (gate or gate_up, up, down) are repacked on the host
    std::vector<std::array<bool, 3>> repacked_;
    /// the fused CPU share (cfg_.fused_cpu), and per MoE layer the largest ubatch it runs fused (-1: none)
    std::unique_ptr<FusedCpuShare> fused_;
    std::shared_ptr<const RoutingReplay> replay_;
    std::vector<int64_t> fused_max_T_;
    /// The plan op's work (op_plan adds the fused CPU share's part after it).
    void plan_layer(ggml_tensor * dst, LayerRun & run);
    /// The plan's output when the engine cannot plan (an error, a warm-up graph): every pair to the CPU share with
    /// upstream's ids, or, with the RAM tier (whose CPU share indexes RAM slots), no pair computed at all.
    void write_fallback(ggml_tensor * dst);

    struct Dev;
    /// the decision rules shared with the simulator's replay (policy/decision.h); the engine is their placement,
    /// one per device, which holds only the layers that device serves
    struct Placement : ExpertPlacement {
        Engine * engine = nullptr;
        Dev * dev = nullptr;
        double load(int layer, int expert, Kind kind) override;
        bool holds(int layer) const override;
        void evicted(const std::vector<int64_t> & keys) override;
        double read_s(int layer, int & slots) const override;
        bool on_disk(int layer, int expert) const override;
    };
    /// One device's share of the engine: its slot pool and GPU launches, its cache and decision rules, its copy
    /// queue (copies to two devices overlap), and the RAM slots its copies still read.
    struct Dev {
        Dev(int index, const EngineConfig & cfg, const EngineDevice & d, EnginePolicies policies);
        int index = 0;
        int64_t n_slots = 0;
        ggml_backend_dev_t device = nullptr;
        int64_t max_buffer_bytes = 0;
        CostModel cost;
        std::shared_ptr<ExpertCache> cache;
        std::shared_ptr<SchedulePolicy> scheduler;
        std::shared_ptr<PrefetchPolicy> prefetcher;
        SlotPool pool;
        std::unique_ptr<GpuShare> gpu;
        std::unique_ptr<LayerDecider> decider;
        Placement placement;
        /// the copy-queue estimate as an end time: the queued copies end at this engine-clock time (seconds); the
        /// decision rules get it as pcie_free_s = max(0, pcie_free_at - now)
        double pcie_free_at = 0.0;
        uint64_t copies_done = 0;   ///< every copy up to this sequence number has ended
        /// RAM slots held for this device's GPU copies (key, copy sequence number)
        std::vector<std::pair<int64_t, uint64_t>> ram_holds;
        double bytes_copied = 0.0;  ///< bytes queued for copies to this device since the last reset_stats
    };
    std::vector<std::unique_ptr<Dev>> devs_;
    std::vector<int> dev_of_;                   // per MoE layer: index into devs_
    std::vector<const SlotPool *> gpu_pool_of_; // per MoE layer: its device's pool (the RAM tier's read-ahead)
    Dev & dev(int ml) { return *devs_[(size_t) dev_of_[(size_t) ml]]; }
    const Dev & dev(int ml) const { return *devs_[(size_t) dev_of_[(size_t) ml]]; }
    bool any_slots() const { return n_slots() > 0; }
    std::unique_ptr<RouterPredictor> predictor_;
    std::vector<Prediction> predictions_;

    // per-plan scratch
    std::vector<float> scores_;              // [T, E] router probabilities of the layer being planned
    std::vector<float> weights_;             // [T, k] routing weights
    std::vector<int32_t> ids_;               // [T, k] routed ids
    std::vector<int32_t> expert_pos_;        // expert -> index in the decider's activated experts
    std::vector<int32_t> token_row_;         // token -> staged row of the launch being filled (-1: none)
    std::vector<int8_t> late_of_;            // expert -> in the CPU share's second pass (1), first (0), unseen (-1)
    std::array<uint64_t, 4> copies_{};       // copies queued by the plan being made, per ExpertPlacement::Kind
    std::array<double, 4> copy_bytes_{};

    using clock = std::chrono::steady_clock;
    clock::time_point t0_ = clock::now();
    double now() const { return std::chrono::duration<double>(clock::now() - t0_).count(); }
    double layer_est_ = -1.0;                // smoothed seconds per MoE layer (prediction start times)

    mutable std::mutex stats_mu_;
    std::vector<EngineLayerStats> stats_;
    std::string error_;
    bool failed_ = false;
    NegativeControls controls_;              // tests only
    bool logging_ = false;
    int64_t ubatch_ = -1;
    int last_ml_ = 1 << 30;                  // MoE layer of the previous plan (a lower or equal one: new ubatch)
    std::vector<DecisionRecord> log_;
    // the RAM tier under a GPU cache: loads of the plan being made whose expert was not in RAM yet (key, kind),
    // copied once the plan op has read them
    std::vector<std::pair<int64_t, int>> deferred_;
    std::vector<int32_t> ram_hits_;         // this plan's GPU loads copied from RAM at once (looked up with the rest)
    // several devices: this plan's predictions by the device of their layer, and the prefetch-only records of the
    // other devices' prefetches it planned (logged after its own record)
    std::vector<std::vector<Prediction>> preds_by_dev_;
    std::vector<DecisionRecord> cross_log_;
    /// this ubatch likely uses every expert of a layer (prefill): exclusive tiers leave the tiers as they are then
    /// (the GPU's loads stream through, and moving each between the tiers would churn the RAM tier)
    bool large_ubatch_ = false;
};

/// What one layer's ops share within one ubatch (owned by the Engine, one per MoE layer).
struct Engine::LayerRun {
    Engine * engine = nullptr;
    int ml = -1;                 ///< MoE layer index
    int il = -1;                 ///< model layer index
    int64_t k_sum = 0;           ///< ranks summed into the output (the layer's top-k, also in warm-up graphs)
    bool weight_before = false;  ///< the CPU share's rows are weighted already (Llama 4: weights before the FFN)
    /// the RAM tier's CPU share runs in two passes: the experts in RAM at the plan, then the others once read
    bool late_pass = false;
    void * counters = nullptr;   ///< hook counters (LayerCounters)
    /// the launches of this run, in the order of their output rows: part 0 (experts resident and, by the
    /// estimate, copied before this layer), then part 1 (this layer's demand loads and experts whose copy is still
    /// in flight, which waits only for their copies); within a part one launch per slot buffer used
    std::vector<GpuShare::Launch *> launches;
    double t_start = 0.0;
    double plan_s = 0.0;
    double cpu_at_plan_end = 0.0;  ///< process CPU clock when the plan op ended (seconds)
    int64_t log_pos = -1;          ///< this run's decision record in the log (-1: none); measured_s is set at the wait
    int64_t log_ubatch = -1;       ///< and its ubatch (the record at log_pos must match: take_log may run between)
};

}  // namespace hybrimoe
