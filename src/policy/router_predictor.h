// Look-ahead routing prediction for prefetching (HybriMoE §IV.C; docs/design.md §3 step 1).
//
// Hidden states change little between consecutive layers (the residual stream), so the routers of the next MoE
// layers applied to the current layer's hidden state predict which experts those layers will activate. This is
// the engine's predictor; the simulator, which has no hidden states, uses TracePredictor (simulator.h).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "policy/prefetcher.h"

namespace hybrimoe {

/// The engine's assumed probability that an expert its router predictor names for the MoE layer at look-ahead
/// distance d = 1, 2, 3 is really activated there (EngineConfig::confidence; each Prediction's confidence, by
/// which the impact prefetcher weighs a prefetch's gain; the last value repeats beyond 3). An assumption the
/// engine acts on, not a measurement, and not the simulator's kDefaultPredictorRecall (simulator.h), which sets
/// how often its stand-in predictor is right. Python: hybrimoe._core.DEFAULT_PREDICTION_CONFIDENCE.
inline constexpr std::array<double, 3> kDefaultPredictionConfidence = {0.8, 0.65, 0.5};

/// Applies the routers of the next MoE layers to a hidden state. Plain arrays in, Predictions out (no ggml).
class RouterPredictor {
public:
    /// tokens of a ubatch scored at most (evenly spaced)
    static constexpr int kSampleTokens = 8;
    /// routers: per MoE layer, F32 [n_expert, n_embd] row-major router weights, or empty (no prediction for that
    /// layer); router_bias: per MoE layer, F32 [n_expert] selection bias added after the gating function
    /// (DeepSeek-V3 exp_probs_b) or empty; sigmoid_gating: scores by sigmoid (else softmax, which ranks like the
    /// raw logits); confidence: the assumed probability that a predicted expert is really used, per distance
    /// 1..D (the last value repeats beyond D); expert_bytes: per MoE layer, bytes of one expert.
    /// Throws std::invalid_argument on sizes that disagree (router not n_expert x n_embd, bias not n_expert,
    /// fewer expert sizes than layers) or non-positive model facts.
    RouterPredictor(int n_expert, int top_k, int n_embd, std::vector<std::vector<float>> routers,
                    std::vector<std::vector<float>> router_bias, bool sigmoid_gating, std::vector<double> confidence,
                    std::vector<double> expert_bytes);

    int n_layers() const { return (int) routers_.size(); }
    bool has_router(int layer) const {
        return layer >= 0 && layer < n_layers() && !routers_[(size_t) layer].empty();
    }

    /// Predictions for MoE layers layer+1 .. layer+depth (layers without a router are skipped). x: the hidden state
    /// of `n_tokens` tokens, F32 rows of n_embd at `row_stride_bytes`; at most kSampleTokens tokens, evenly spaced, are scored
    /// and the predicted per-expert loads are scaled to the ubatch (clamped to 1..n_tokens). Times: the layer at
    /// distance d starts at `makespan_s + (d - 1) * layer_s + non_expert_s` seconds after now (Prediction::start_s,
    /// relative; LayerDecider::prefetch converts). Cost: O(depth * 8 * n_expert * n_embd) multiply-adds.
    void predict(int layer, int depth, int n_tokens, const float * x, size_t row_stride_bytes, double makespan_s,
                 double layer_s, double non_expert_s, std::vector<Prediction> & out);

private:
    int n_expert_, top_k_, n_embd_;
    std::vector<std::vector<float>> routers_;
    std::vector<std::vector<float>> bias_;
    bool sigmoid_;
    std::vector<double> confidence_;
    std::vector<double> expert_bytes_;
    std::vector<float> logits_;
    std::vector<int32_t> order_, counts_;
};

}  // namespace hybrimoe
