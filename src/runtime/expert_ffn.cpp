#include "runtime/expert_ffn.h"

namespace hybrimoe {

ggml_tensor * build_expert_ffn(ggml_context * ctx, const ExpertMatrices & m, ggml_tensor * x, ggml_tensor * ids,
                               ggml_tensor * weights, const char * prefix, int il) {
    // upstream's order (build_moe_ffn): up, then gate, then the GLU, then down
    ggml_tensor * up = ggml_mul_mat_id(ctx, m.up, x, ids);  // [n_ff, k, T]
    ggml_format_name(up, "%s_up-%d", prefix, il);
    ggml_tensor * gate = ggml_mul_mat_id(ctx, m.gate, x, ids);  // [n_ff, k, T]
    ggml_format_name(gate, "%s_gate-%d", prefix, il);
    ggml_tensor * h = ggml_swiglu_split(ctx, gate, up);  // [n_ff, k, T]
    ggml_format_name(h, "%s_glu-%d", prefix, il);
    ggml_tensor * out = ggml_mul_mat_id(ctx, m.down, h, ids);  // [n_embd, k, T]
    ggml_format_name(out, "%s_down-%d", prefix, il);
    if (weights) {
        out = ggml_mul(ctx, out, weights);
        ggml_format_name(out, "%s_weighted-%d", prefix, il);
    }
    return out;
}

}  // namespace hybrimoe
