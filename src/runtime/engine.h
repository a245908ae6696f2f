// The hybrid CPU+GPU MoE engine (HybriMoE, Zhong et al., DAC 2025; ../shared/design/HYBRIMOE.md, ARCHITECTURE.md).
//
// One Engine per llama_context, driven by the MoE hook (moe_hook.h). Per MoE layer and ubatch, three custom ops
// run on the CPU around ggml's own CPU expert nodes:
//
//   plan  (1 task)  reads the routing ids, routing weights, router probabilities and hidden state (inputs of
//                   the one CPU split of the layer: the scheduler brings them over together, one transfer each,
//                   the hidden state once for the plan and the CPU experts); updates the cache scores;
//                   asks the scheduler for the CPU/GPU split; admits and copies the experts to load (copy queue);
//                   launches the GPU share on the accelerator (mul_mat_id over the slot pool, SwiGLU, down,
//                   routing weights: per-slot outputs); plans prefetches for the next layers by applying their
//                   routers to this hidden state; offers CPU-computed misses to the cache (fills).
//                   Its output is the ids the CPU mul_mat_id nodes use: GPU-assigned (token, slot) pairs point
//                   at an expert whose result is discarded, chosen so that every CPU expert keeps upstream's row
//                   count (ggml picks its kernel per expert by row count: results stay upstream's bit for bit).
//   (CPU nodes)     mul_mat_id up/gate, swiglu, mul_mat_id down, routing weights: upstream's ops and kernels.
//   wait  (1 task)  waits for the GPU share, reads its per-slot outputs back, unpins the layer's experts.
//   combine         per token, sums the slots in upstream's order, each slot from the CPU or the GPU output.
//
// Expert weights stay in host memory (llama tensor overrides; Python sets them up), in the file's quant types.
// The GPU keeps a pool of expert-sized slots (one global byte budget); which (layer, expert) a slot holds is
// decided by the policy core's ExpertCache (src/policy). A slot that a queued or running computation reads is
// pinned and cannot be evicted.
#pragma once

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"
#include "policy/cost_model.h"
#include "policy/decision.h"
#include "policy/expert_cache.h"
#include "policy/prefetcher.h"
#include "policy/scheduler.h"

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace hybrimoe {

/// Seconds per host-to-device copy of `bytes` to `device` (median of `reps` timed copies, each followed by a
/// synchronize), from the device's pinned host buffer type when it has one, else from pageable memory.
/// Calibration input (`hybrimoe calibrate`). Throws std::runtime_error when the device or the buffers fail.
double measure_h2d_s(ggml_backend_dev_t device, size_t bytes, int reps);

/// Facts and settings the engine is built from (Python fills them from the GGUF and the user's options).
struct EngineConfig {
    int n_layer = 0;                       ///< model layers (llama's il range)
    int n_expert = 0;                      ///< routed experts per MoE layer
    int top_k = 0;                         ///< experts used per token
    int n_embd = 0;
    std::vector<int> moe_layers;           ///< model layer index of each MoE layer (cache layer index = position)
    /// per MoE layer: bytes of one expert's gate, up and down matrices as stored (ggml nb[2])
    std::vector<std::array<int64_t, 3>> expert_bytes;
    /// per MoE layer: ggml types of the gate, up and down matrices
    std::vector<std::array<int32_t, 3>> expert_types;
    int64_t n_slots = 0;                   ///< GPU expert slots (0: nothing cached, everything on the CPU)
    ggml_backend_dev_t device = nullptr;   ///< accelerator holding the slot pool (needed when n_slots > 0)
    CostModel cost;                        ///< planner cost model (seconds, bytes/s)
    int prefetch_layers = 3;               ///< predicted MoE layers ahead (0: no prefetch)
    bool fill_on_miss = true;              ///< offer CPU-computed misses to the cache while the copy queue idles
    std::vector<double> confidence = {0.8, 0.65, 0.5};  ///< assumed prediction confidence per distance
    /// per MoE layer: router weights F32 [n_expert, n_embd] row-major (empty: no prediction for that layer)
    std::vector<std::vector<float>> routers;
    /// per MoE layer: selection bias added to sigmoid scores (DeepSeek-V3 exp_probs_b) or empty
    std::vector<std::vector<float>> router_bias;
    bool sigmoid_gating = false;           ///< router probabilities by sigmoid (else softmax)
};

/// Per MoE layer counters (read between decodes).
struct EngineLayerStats {
    uint64_t runs = 0, tokens = 0;
    uint64_t cpu_experts = 0, gpu_experts = 0;       ///< distinct experts per run, summed
    uint64_t demand_copies = 0, prefetch_copies = 0, fill_copies = 0;
    uint64_t declined_loads = 0;                     ///< planned loads the cache refused (ran on the CPU)
    uint64_t gpu_runs = 0, gpu_launches = 0;         ///< runs with a GPU share; GPU graph launches (1 or 2 per run)
    double bytes_demand = 0, bytes_prefetch = 0, bytes_fill = 0;
    double plan_s = 0, wait_s = 0, layer_s = 0;      ///< seconds in plan, waiting for the GPU, plan start to wait end
    double predicted_s = 0;                          ///< planner's predicted makespans, summed
};

/// The engine. Thread-safety: its ops run on ggml's thread 0 of the context's CPU backend, one at a time;
/// Python reads statistics between decodes.
class Engine {
public:
    /// Allocates the slot pool on cfg.device (n_slots + 1 slots; the last is an all-zero null slot).
    /// Throws std::invalid_argument on inconsistent facts, std::runtime_error when the device cannot be
    /// initialised or the pool cannot be allocated (message names the device and the bytes).
    Engine(EngineConfig cfg, std::shared_ptr<ExpertCache> cache, std::shared_ptr<SchedulePolicy> scheduler,
           std::shared_ptr<PrefetchPolicy> prefetcher);
    ~Engine();
    /// Waits for queued device work and frees the slot pool, the GPU graphs and the device backends now (the
    /// engine then runs every layer on the CPU). Call before the llama context and the device go away; the
    /// destructor does it otherwise.
    void release();
    Engine(const Engine &) = delete;
    Engine & operator=(const Engine &) = delete;

    /// Per-slot stride of the gate, up and down regions of the pool (bytes): the largest matrix of that kind over
    /// the MoE layers, rounded up to a multiple of 16 and of every ggml block size used for that kind (kernels,
    /// CUDA's among them, index an expert as stride / block size). Throws std::invalid_argument on mismatched
    /// lengths or an unknown type.
    static std::array<int64_t, 3> region_strides(const std::vector<std::array<int64_t, 3>> & expert_bytes,
                                                 const std::vector<std::array<int32_t, 3>> & expert_types);
    /// Bytes of one slot: the sum of the region strides.
    static int64_t slot_bytes_for(const std::vector<std::array<int64_t, 3>> & expert_bytes,
                                  const std::vector<std::array<int32_t, 3>> & expert_types);
    int64_t slot_bytes() const { return slot_bytes_; }
    int64_t n_slots() const { return cfg_.n_slots; }
    const EngineConfig & config() const { return cfg_; }

    /// Builds the layer's replacement subgraph (called by MoeHook::build for supported layers).
    /// `counters` receives run counts for the hook's statistics.
    ggml_tensor * build(const llama_moe_hook_args & a, void * counters);

    std::vector<EngineLayerStats> layer_stats() const;
    void reset_stats();
    /// First error since the last call ("" if none): a policy that raised, a failed GPU computation. After an
    /// error the engine runs every layer on the CPU (upstream's numbers) until reset_error().
    std::string take_error();
    bool failed() const { return failed_; }
    void clear_failure();
    /// MoE layer index of model layer il, or -1.
    int moe_index(int il) const { return il >= 0 && il < (int) moe_index_.size() ? moe_index_[il] : -1; }
    /// Slot of a resident (MoE layer, expert) or -1 (tests: slot bookkeeping agrees with the cache).
    int slot_of(int layer, int expert) const;
    /// Keep a DecisionRecord per (MoE layer, ubatch) from now on (off: stop and drop them).
    void set_logging(bool on);
    /// The records kept since the last call.
    std::vector<DecisionRecord> take_log();
    /// Negative control for tests: the GPU share's outputs are replaced by zeros (results must then differ).
    void set_drop_gpu_share(bool on) { drop_gpu_ = on; }
    /// (layer, expert) keys pinned now; 0 between decodes unless prefetched experts wait for their layer.
    int pinned_count() const;
    /// Slots holding an expert; equals the cache's resident count when the bookkeeping agrees.
    int slots_in_use() const;

    // ---- custom-op bodies (public for the C trampolines) ----
    struct LayerRun;
    void op_plan(ggml_tensor * dst, LayerRun & run);
    void op_wait(ggml_tensor * dst, LayerRun & run);

private:
    struct LayerTensors {
        ggml_tensor * gate = nullptr;
        ggml_tensor * up = nullptr;
        ggml_tensor * down = nullptr;
    };
    struct GpuGraph;

    GpuGraph & gpu_graph(int ml, int64_t k, int64_t n_tokens, int part);
    bool assign_slot(int ml, int e);
    /// Queues the copy of (ml, e)'s weights into its slot; returns the bytes (0: no slot, or already copied).
    double copy_expert(int ml, int e);
    /// Makes the compute queue wait until the copy with sequence number `seq` is done (0: nothing to wait for).
    void wait_for_copy(uint64_t seq);
    /// Predicted routing of the MoE layers after `ml` (their routers applied to the hidden state `cur`).
    void predict(int ml, int n_tokens, const float * cur, size_t cur_row_stride, double makespan_s,
                 double layer_est, std::vector<Prediction> & out);
    void fail(const std::string & msg);

    EngineConfig cfg_;
    std::shared_ptr<ExpertCache> cache_;
    std::shared_ptr<SchedulePolicy> scheduler_;
    std::shared_ptr<PrefetchPolicy> prefetcher_;
    std::vector<int> moe_index_;
    std::vector<LayerTensors> tensors_;
    std::vector<std::unique_ptr<LayerRun>> runs_;

    // slot pool
    int64_t slot_bytes_ = 0;
    std::array<int64_t, 3> strides_{};      // gate, up, down: bytes per slot in that region of the pool
    std::array<int64_t, 3> bases_{};        // gate, up, down: offset of the region in the pool
    ggml_backend_t compute_ = nullptr;
    ggml_backend_t copy_ = nullptr;
    // copy queue: each expert copy gets a sequence number and an event recorded after it (a ring: a reused event
    // marks a later point of the same in-order queue, so waiting on it still covers the earlier copy)
    static constexpr int kEvents = 64;
    std::vector<ggml_backend_event_t> events_;
    uint64_t copy_seq_ = 0;
    std::vector<uint64_t> key_copy_seq_;    // key -> sequence number of its last copy
    ggml_context * pool_ctx_ = nullptr;
    ggml_backend_buffer_t pool_buf_ = nullptr;
    ggml_tensor * pool_ = nullptr;
    std::vector<int32_t> slot_key_;         // slot -> key (ml * n_expert + e) or -1
    std::vector<int32_t> key_slot_;         // key -> slot or -1
    std::vector<uint8_t> key_loaded_;       // key's slot holds its weights (copy issued)
    std::vector<int32_t> free_slots_;
    std::map<std::tuple<int, int, int, int64_t, int64_t, int>, std::unique_ptr<GpuGraph>> graphs_;

    // per-run scratch
    /// the decision rules shared with the simulator's replay (policy/decision.h); the engine is their placement
    struct Placement : ExpertPlacement {
        Engine * engine = nullptr;
        double load(int layer, int expert, Kind kind) override;
        bool holds(int layer) const override;
        void evicted(const std::vector<int64_t> & keys) override;
    };
    std::unique_ptr<LayerDecider> decider_;
    Placement placement_;
    std::vector<Prediction> predictions_;
    std::vector<float> scores_;              // [T, E] router probabilities of the layer being planned
    std::array<uint64_t, 4> copies_{};       // copies queued by the plan being made, per ExpertPlacement::Kind
    std::array<double, 4> copy_bytes_{};
    std::vector<int32_t> ids_;               // [T, k] contiguous
    std::vector<int32_t> expert_pos_;
    std::vector<float> logits_;
    std::vector<float> scratch_;
    std::vector<float> stage_x_, stage_w_;   // hidden state [T, n_embd] and routing weights [T, k] for the GPU

    using clock = std::chrono::steady_clock;
    clock::time_point t0_ = clock::now();
    double now() const { return std::chrono::duration<double>(clock::now() - t0_).count(); }
    double link_free_ = 0.0;                 // estimated end of queued copies (engine clock, seconds)
    double layer_est_ = -1.0;

    mutable std::mutex stats_mu_;
    std::vector<EngineLayerStats> stats_;
    std::string error_;
    bool failed_ = false;
    bool drop_gpu_ = false;
    bool logging_ = false;
    int64_t ubatch_ = -1;
    int last_ml_ = 1 << 30;                  // MoE layer of the previous plan (a lower or equal one: new ubatch)
    std::vector<DecisionRecord> log_;
};

/// What one layer's ops share within one ubatch (owned by the Engine, one per MoE layer).
struct Engine::LayerRun {
    Engine * engine = nullptr;
    int ml = -1;                 ///< MoE layer index
    int il = -1;                 ///< model layer index
    void * counters = nullptr;   ///< hook counters (LayerCounters)
    bool gpu_launched = false;
    /// launch 0: experts resident and (by the estimate) copied before this layer; launch 1: this layer's demand
    /// loads and experts whose copy is still in flight, which waits only for their copies
    GpuGraph * graph[2] = {nullptr, nullptr};
    std::vector<uint8_t> pair_part;  ///< [T * k]: 0 CPU, 1 launch 0, 2 launch 1
    double t_start = 0.0;
    double plan_s = 0.0;
};

}  // namespace hybrimoe
