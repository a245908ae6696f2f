// The routed-expert FFN of a MoE layer, built with upstream's own ggml ops, in one place for every caller: the
// engine's CPU share (over the file's expert tensors in host memory), its GPU share (over views of the GPU slot
// pool) and the hook's CPU-only path. It mirrors llm_graph_context::build_moe_ffn (src/llama-graph.cpp, the nodes
// "ffn_moe_up" .. "ffn_moe_weighted") op for op, so ggml picks the same kernels and the results are upstream's.
#pragma once

#include "ggml.h"

namespace hybrimoe {

/// The expert activations the builder handles (build_moe_ffn's type_op).
enum class ExpertAct {
    kSwiGlu,     ///< LLM_FFN_SILU with a gate: ggml_swiglu_split(gate, up)
    kSwiGluOai,  ///< LLM_FFN_SWIGLU_OAI_MOE (gpt-oss): ggml_swiglu_oai(gate, up, alpha 1.702, limit 7)
};

/// SwiGLU-OAI's constants as the pinned build_moe_ffn passes them to ggml_swiglu_oai (they are not hparams there:
/// the model's swiglu_clamp_exp does not reach this activation).
constexpr float kSwiGluOaiAlpha = 1.702f;
constexpr float kSwiGluOaiLimit = 7.0f;

/// The expert matrices one FFN reads: 3-D [n_in, n_out, n_expert-or-slots] tensors (ggml ne order), and optional
/// biases: F32 2-D [n_out, n_expert-or-slots] tensors indexed by the same ids as the matrices (ggml_add_id).
struct ExpertMatrices {
    ggml_tensor * gate = nullptr;    ///< [n_embd, n_ff, n]
    ggml_tensor * up = nullptr;      ///< [n_embd, n_ff, n]
    ggml_tensor * down = nullptr;    ///< [n_ff, n_embd, n]
    ggml_tensor * gate_b = nullptr;  ///< F32 [n_ff, n] or nullptr
    ggml_tensor * up_b = nullptr;    ///< F32 [n_ff, n] or nullptr
    ggml_tensor * down_b = nullptr;  ///< F32 [n_embd, n] or nullptr
    ExpertAct act = ExpertAct::kSwiGlu;
};

/// Node names carry the layer: "<prefix>_up-<il>" etc., as upstream's cb(t, "ffn_moe_up", il) does.
/// x: F32 [n_embd, 1 or k, n_tokens] (ne1 = 1 broadcasts one row to every rank); ids: I32 [k, n_tokens] of rows
/// of the matrices' last dimension (a negative id: a pair this FFN must not compute; only ggml-cpu builds with
/// hybrimoe's patch 0005 accept it, in mul_mat_id and add_id). weights: F32 [1, k, n_tokens] routing weights
/// multiplied into the outputs (ggml_mul, upstream's "ffn_moe_weighted"), or nullptr to leave the outputs
/// unweighted (the caller weights them). Returns F32 [n_embd, k, n_tokens]: one output row per (rank, token) pair.
/// Order as build_moe_ffn's separate gate/up path: up (+ up bias), gate (+ gate bias), the activation, down
/// (+ down bias), the weights. Variants it does not cover (fused gate_up, scales, other activations, weights
/// before the FFN) stay on upstream's path (the hook's unsupported_reason).
ggml_tensor * build_expert_ffn(ggml_context * ctx, const ExpertMatrices & m, ggml_tensor * x, ggml_tensor * ids,
                               ggml_tensor * weights, const char * prefix, int il);

}  // namespace hybrimoe
