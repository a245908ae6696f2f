// The MoE hook that hybrimoe installs through llama_set_moe_hook (vendor/llama.cpp/patches/0001-moe-hook.patch).
//
// For each MoE layer whose routed experts build_expert_ffn builds as build_moe_ffn does (every activation, separate
// or fused gate_up matrices, F32 biases and per-expert scales, the SwiGLU clamp, routing weights before the FFN; not
// LoRA adapters on the context), the hook replaces upstream's routed-expert subgraph with its own. With an Engine
// (engine.h) that is the hybrid CPU+GPU path; without one (the CPU-only path, `moe_hook`), a custom op ("hybrimoe_plan") runs on the CPU once per layer and ubatch,
// bringing the routing ids, routing weights and router probabilities to the host together and counting its runs,
// then build_expert_ffn computes the experts with ggml's own kernels and the ranks are summed in upstream's order,
// so the result is upstream's bit for bit.
#pragma once

#include "llama.h"
#include "runtime/expert_ffn.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace hybrimoe {

/// Per-layer run statistics, written by the custom op (any ggml thread) and read from Python.
struct LayerCounters {
    std::atomic<uint64_t> runs{0};          ///< executions of the layer's plan node (one per ubatch)
    std::atomic<uint64_t> tokens{0};        ///< tokens seen by the layer, summed over runs
    std::atomic<uint64_t> hook_calls{0};    ///< graph builds that called the hook for this layer
    bool record = false;                    ///< keep every routed id seen (tests, traces)
    int32_t k = 0;                          ///< ranks (top-k positions) per token of the recorded rows
    std::vector<int32_t> recorded;          ///< [rows, k] routed ids in execution order (written by thread 0)
};

/// Counts one run of a layer's plan node (and records its ids when recording is on). ids: [n_tokens, k]
/// contiguous. Called on ggml's thread 0.
void note_plan_run(LayerCounters & c, const int32_t * ids, int64_t k, int64_t n_tokens);

class Engine;

/// The expert tensors and op details of a supported layer's hook arguments (the file's tensors, indexed by
/// expert id): matrices (separate or fused gate_up), biases and scales when present, the activation, its clamp,
/// src1 precisions, whether the routing weights go in before the FFN.
ExpertMatrices expert_matrices(const llama_moe_hook_args & a);

/// State shared by every graph of one llama_context. Must outlive the context's graphs (llama.h contract of
/// llama_set_moe_hook); the Python Engine object keeps it alive until detach().
class MoeHook {
public:
    /// max_layers: upper bound on layer indices (the model's n_layer).
    explicit MoeHook(int max_layers);

    /// Install on ctx (llama_set_moe_hook). Forces llama to rebuild its graphs.
    void attach(llama_context * ctx);
    /// Remove from the context it was attached to (no-op if not attached).
    void detach();

    /// llama_moe_hook_t entry point.
    static ggml_tensor * hook(const llama_moe_hook_args * args, void * user_data);

    int max_layers() const { return (int) counters_.size(); }
    const LayerCounters & layer(int il) const { return counters_.at((size_t) il); }
    void reset_counters();

    /// Keep (or stop keeping) every routed id each layer sees, in execution order.
    void set_recording(bool on);
    /// Recorded ids of layer il: rows of k ids; k is 0 while nothing was recorded.
    std::vector<int32_t> recorded(int il, int32_t * k) const;

    /// Use `engine` for the layers it handles (the hybrid CPU+GPU path); nullptr: the CPU-only path.
    /// Forces llama to rebuild its graphs when attached.
    void set_engine(std::shared_ptr<Engine> engine);
    const std::shared_ptr<Engine> & engine() const { return engine_; }
    /// Supported layers the engine left to the CPU-only path, with the reason (e.g. experts not in host
    /// memory).
    std::vector<std::pair<int, std::string>> engine_skipped() const;

    /// Layers whose expert variant the seed does not handle (kept on upstream's path), with the reason.
    std::vector<std::pair<int, std::string>> unsupported() const;

private:
    ggml_tensor * build(const llama_moe_hook_args & a);

    std::vector<LayerCounters> counters_;
    mutable std::mutex mu_;
    std::vector<std::pair<int, std::string>> unsupported_;
    std::vector<std::pair<int, std::string>> engine_skipped_;
    std::shared_ptr<Engine> engine_;
    llama_context * ctx_ = nullptr;
};

} // namespace hybrimoe
