#include "runtime/expert_ffn.h"

namespace hybrimoe {

ggml_tensor * build_expert_ffn(ggml_context * ctx, const ExpertMatrices & m, ggml_tensor * x, ggml_tensor * ids,
                               ggml_tensor * weights, const char * prefix, int il) {
    // upstream's order (build_moe_ffn): up (+ bias by expert id), then gate (+ bias), then the GLU, then down
    // (+ bias); the biases go in with ggml_add_id, indexed by the same ids as mul_mat_id
    ggml_tensor * up = ggml_mul_mat_id(ctx, m.up, x, ids);  // [n_ff, k, T]
    ggml_format_name(up, "%s_up-%d", prefix, il);
    if (m.up_b) {
        up = ggml_add_id(ctx, up, m.up_b, ids);
        ggml_format_name(up, "%s_up_biased-%d", prefix, il);
    }
    ggml_tensor * gate = ggml_mul_mat_id(ctx, m.gate, x, ids);  // [n_ff, k, T]
    ggml_format_name(gate, "%s_gate-%d", prefix, il);
    if (m.gate_b) {
        gate = ggml_add_id(ctx, gate, m.gate_b, ids);
        ggml_format_name(gate, "%s_gate_biased-%d", prefix, il);
    }
    ggml_tensor * h = nullptr;  // [n_ff, k, T]
    switch (m.act) {
        case ExpertAct::kSwiGluOai:
            h = ggml_swiglu_oai(ctx, gate, up, kSwiGluOaiAlpha, kSwiGluOaiLimit);
            break;
        case ExpertAct::kSwiGlu:
        default:
            h = ggml_swiglu_split(ctx, gate, up);
            break;
    }
    ggml_format_name(h, "%s_glu-%d", prefix, il);
    ggml_tensor * out = ggml_mul_mat_id(ctx, m.down, h, ids);  // [n_embd, k, T]
    ggml_format_name(out, "%s_down-%d", prefix, il);
    if (m.down_b) {
        out = ggml_add_id(ctx, out, m.down_b, ids);
        ggml_format_name(out, "%s_down_biased-%d", prefix, il);
    }
    if (weights) {
        out = ggml_mul(ctx, out, weights);
        ggml_format_name(out, "%s_weighted-%d", prefix, il);
    }
    return out;
}

}  // namespace hybrimoe
