// The routed-expert FFN of a MoE layer, built with upstream's own ggml ops, in one place for every caller: the
// engine's CPU share (over the file's expert tensors in host memory), its GPU share (over views of the GPU slot
// pool) and the hook's CPU-only path. It mirrors llm_graph_context::build_moe_ffn (src/llama-graph.cpp, the nodes
// "ffn_moe_weighted" (before the FFN) .. "ffn_moe_weighted" (after it)) and build_lora_mm_id op for op, so ggml
// picks the same kernels and the results are upstream's.
#pragma once

#include "ggml.h"

#include <array>

namespace hybrimoe {

/// The expert activations of build_moe_ffn (its type_op). Gated (a gate matrix or a fused gate_up one exists):
/// act(gate) * up by ggml's GLU ops; ungated: act(up).
enum class ExpertAct {
    kSilu,       ///< LLM_FFN_SILU: ggml_swiglu_split / ggml_silu; with swiglu_clamp_exp > 0 (separate gate) clamped
    kSwiGluOai,  ///< LLM_FFN_SWIGLU_OAI_MOE (gpt-oss): ggml_swiglu_oai(gate, up, alpha 1.702, limit 7); gated only
    kGelu,       ///< LLM_FFN_GELU: ggml_geglu_split / ggml_gelu
    kRelu,       ///< LLM_FFN_RELU: ggml_reglu_split / ggml_relu
    kReluSqr,    ///< LLM_FFN_RELU_SQR: ggml_sqr(ggml_relu(up)); ungated only (upstream aborts on a gated one)
    kSitu,       ///< LLM_FFN_SITU: beta*tanh(gate/beta)*sigmoid(gate) * lb*tanh(up/lb) (lb = 0: up); gated only
};

/// SwiGLU-OAI's constants as the pinned build_moe_ffn passes them to ggml_swiglu_oai (they are not hparams there:
/// the model's swiglu_clamp_exp does not reach this activation).
constexpr float kSwiGluOaiAlpha = 1.702f;
constexpr float kSwiGluOaiLimit = 7.0f;

/// The expert tensors one FFN reads, indexed by expert id (the file's tensors) or by slot (the slot pool's views):
/// 3-D matrices [n_in, n_out, n] (ggml ne order), optional F32 biases [n_out, n] (ggml_add_id rows) and F32
/// per-expert scales [n] (build_lora_mm_id's w_s), and the op details build_moe_ffn takes from the model.
struct ExpertMatrices {
    ggml_tensor * gate = nullptr;       ///< [n_embd, n_ff, n], or nullptr (fused gate_up, or an ungated FFN)
    ggml_tensor * up = nullptr;         ///< [n_embd, n_ff, n], or nullptr with gate_up
    ggml_tensor * gate_up = nullptr;    ///< fused [n_embd, 2*n_ff, n]: gate rows [0, n_ff), up rows [n_ff, 2*n_ff)
    ggml_tensor * down = nullptr;       ///< [n_ff, n_embd, n]
    ggml_tensor * gate_b = nullptr;     ///< F32 [n_ff, n] or nullptr
    ggml_tensor * up_b = nullptr;       ///< F32 [n_ff, n] or nullptr
    ggml_tensor * gate_up_b = nullptr;  ///< F32 [2*n_ff, n] or nullptr (with gate_up)
    ggml_tensor * down_b = nullptr;     ///< F32 [n_embd, n] or nullptr
    ggml_tensor * gate_s = nullptr;     ///< F32 [n] or nullptr
    ggml_tensor * up_s = nullptr;       ///< F32 [n] or nullptr; scales the fused gate_up product too (as upstream)
    ggml_tensor * down_s = nullptr;     ///< F32 [n] or nullptr
    ExpertAct act = ExpertAct::kSilu;
    float clamp = 0.0f;                 ///< kSilu with a separate gate: swiglu_clamp_exp of the layer (0: none)
    bool clamp_fused = false;           ///< the clamp by ggml_swiglu_clamp (else clamp(up), clamp(silu(gate)), mul)
    float situ_beta = 1.0f, situ_linear_beta = 0.0f;  ///< kSitu: hparams.situ_beta, situ_linear_beta
    int prec_up = 0, prec_gate = 0, prec_down = 0;    ///< enum ggml_prec for src1 of each mul_mat_id (0: unset)
    bool weight_before = false;         ///< Llama 4: routing weights multiply the input, not the output
    bool swap_gate_up = false;          ///< the fused product's halves swapped: set only by NegativeControls

    /// The matrix of each slot region (0 gate or fused gate_up, 1 up, 2 down; nullptr: none), the bias of each
    /// bias region (0 gate or gate_up, 1 up, 2 down) and the scale of each scale region (gate, up, down).
    std::array<ggml_tensor *, 3> slot_matrices() const { return {gate_up ? gate_up : gate, up, down}; }
    std::array<ggml_tensor *, 3> slot_biases() const { return {gate_up ? gate_up_b : gate_b, up_b, down_b}; }
    std::array<ggml_tensor *, 3> slot_scales() const { return {gate_s, up_s, down_s}; }
    bool gated() const { return gate != nullptr || gate_up != nullptr; }
};

/// Node names carry the layer: "<prefix>_up-<il>" etc., as upstream's cb(t, "ffn_moe_up", il) does.
/// x: F32 [n_embd, 1 or k, n_tokens] (ne1 = 1 broadcasts one row to every rank); ids: I32 [k, n_tokens] of rows
/// of the matrices' last dimension (a negative id: a pair this FFN must not compute; only ggml-cpu builds with
/// hybrimoe's patch 0005 accept it, in mul_mat_id and add_id). weights: F32 [1, k, n_tokens] routing weights, multiplied
/// (ggml_mul, upstream's "ffn_moe_weighted") into the outputs, or with m.weight_before into the input repeated to
/// [n_embd, k, n_tokens] (ggml_repeat_4d); nullptr (only without weight_before) leaves the outputs unweighted
/// (the caller weights them). Returns F32 [n_embd, k, n_tokens]: one output row per (rank, token) pair.
/// Order as build_moe_ffn: weights before, gate_up (+ scale, + bias) split into views, or up (+ scale, + bias) and
/// gate (+ scale, + bias); the activation; down (+ scale, + bias); weights after. Throws std::invalid_argument for a
/// combination upstream does not build (a gated ReLU², an ungated SwiGLU-OAI or SITU, no up matrix).
/// scale_ids: I32 [k, n_tokens] the per-expert scales are gathered by (ggml_get_rows, which aborts on a negative
/// id: the engine's CPU share passes the routing's own ids there), nullptr: `ids`.
ggml_tensor * build_expert_ffn(ggml_context * ctx, const ExpertMatrices & m, ggml_tensor * x, ggml_tensor * ids,
                               ggml_tensor * weights, const char * prefix, int il, ggml_tensor * scale_ids = nullptr);

}  // namespace hybrimoe
