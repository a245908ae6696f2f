#include "runtime/expert_ffn.h"

#include <cmath>
#include <stdexcept>

namespace hybrimoe {

namespace {

// build_lora_mm_id without LoRA: mul_mat_id (src1 precision as the model's prec_policy sets it), then the
// per-expert scale gathered by expert id: w_s F32 [n] -> [1, n, 1] -> repeated over the tokens [1, n, T] ->
// get_rows by ids [1, k, T] -> multiplied into the product [n_out, k, T]
ggml_tensor * mm_id(ggml_context * ctx, ggml_tensor * w, ggml_tensor * b, ggml_tensor * ids, ggml_tensor * w_s,
                    ggml_tensor * s_ids, int prec, const char * prefix, const char * what, int il) {
    ggml_tensor * res = ggml_mul_mat_id(ctx, w, b, ids);
    if (prec != 0) ggml_prec_set_src(res, (ggml_prec) prec, 1);
    ggml_format_name(res, "%s_%s-%d", prefix, what, il);
    if (w_s) {
        ggml_tensor * s = nullptr;  // [1, k, T]: each pair's scale
        if (s_ids->ne[0] == 1 && ggml_is_contiguous(s_ids)) {
            // one rank per column (the GPU share's pairs): the same values gathered without the [1, n, T] repeat,
            // whose size would grow with the slots times the pairs
            s = ggml_get_rows(ctx, ggml_reshape_2d(ctx, w_s, 1, w_s->ne[0]), ggml_reshape_1d(ctx, s_ids, s_ids->ne[1]));
            s = ggml_reshape_3d(ctx, s, 1, 1, s_ids->ne[1]);
        } else {
            s = ggml_reshape_3d(ctx, w_s, 1, w_s->ne[0], 1);
            s = ggml_repeat_4d(ctx, s, 1, w_s->ne[0], b->ne[2], 1);
            s = ggml_get_rows(ctx, s, s_ids);
        }
        res = ggml_mul(ctx, res, s);
        ggml_format_name(res, "%s_%s_scaled-%d", prefix, what, il);
    }
    return res;
}

ggml_tensor * add_bias(ggml_context * ctx, ggml_tensor * t, ggml_tensor * bias, ggml_tensor * ids,
                       const char * prefix, const char * what, int il) {
    if (!bias) return t;
    t = ggml_add_id(ctx, t, bias, ids);
    ggml_format_name(t, "%s_%s_biased-%d", prefix, what, il);
    return t;
}

}  // namespace

ggml_tensor * build_expert_ffn(ggml_context * ctx, const ExpertMatrices & m, ggml_tensor * x, ggml_tensor * ids,
                               ggml_tensor * weights, const char * prefix, int il, ggml_tensor * scale_ids) {
    if (!m.down || (!m.up && !m.gate_up)) throw std::invalid_argument("engine: an expert FFN needs up and down");
    const bool gated = m.gated();
    if ((m.act == ExpertAct::kReluSqr && gated) ||
        ((m.act == ExpertAct::kSwiGluOai || m.act == ExpertAct::kSitu) && !gated)) {
        throw std::invalid_argument("engine: an expert activation and gating upstream's build_moe_ffn does not build");
    }
    if (m.weight_before && !weights) throw std::invalid_argument("engine: weights before the FFN need the weights");
    ggml_tensor * s_ids = scale_ids ? scale_ids : ids;

    if (m.weight_before) {
        // Llama 4: the input repeated to every rank [n_embd, k, T], times the routing weights [1, k, T]
        x = ggml_repeat_4d(ctx, x, x->ne[0], weights->ne[1], weights->ne[2], 1);
        x = ggml_mul(ctx, x, weights);
        ggml_format_name(x, "%s_weighted_in-%d", prefix, il);
    }

    ggml_tensor * cur = nullptr;  // the gate product (gated), else the up product: [n_ff, k, T]
    ggml_tensor * up = nullptr;
    if (m.gate_up) {
        // one product [2*n_ff, k, T] (scaled by the up scale, as upstream), biased, then two views of its halves
        ggml_tensor * gu = mm_id(ctx, m.gate_up, x, ids, m.up_s, s_ids, m.prec_up, prefix, "gate_up", il);
        gu = add_bias(ctx, gu, m.gate_up_b, ids, prefix, "gate_up", il);
        const int64_t n_ff = gu->ne[0] / 2;
        const size_t off_gate = m.swap_gate_up ? n_ff * gu->nb[0] : 0, off_up = n_ff * gu->nb[0] - off_gate;
        cur = ggml_view_3d(ctx, gu, n_ff, gu->ne[1], gu->ne[2], gu->nb[1], gu->nb[2], off_gate);
        up = ggml_view_3d(ctx, gu, n_ff, gu->ne[1], gu->ne[2], gu->nb[1], gu->nb[2], off_up);
    } else {
        up = mm_id(ctx, m.up, x, ids, m.up_s, s_ids, m.prec_up, prefix, "up", il);
        up = add_bias(ctx, up, m.up_b, ids, prefix, "up", il);
        if (m.gate) {
            cur = mm_id(ctx, m.gate, x, ids, m.gate_s, s_ids, m.prec_gate, prefix, "gate", il);
            cur = add_bias(ctx, cur, m.gate_b, ids, prefix, "gate", il);
        } else {
            cur = up;  // ungated: the activation reads the up product
        }
    }

    ggml_tensor * h = nullptr;  // [n_ff, k, T]
    switch (m.act) {
        case ExpertAct::kSilu:
            if (m.gate && m.clamp > 1e-6f) {
                // swiglu_clamp_exp (separate gate only, as upstream): the form the architecture uses
                if (m.clamp_fused) {
                    h = ggml_swiglu_clamp(ctx, cur, up, m.clamp);
                } else {
                    ggml_tensor * u = ggml_clamp(ctx, up, -m.clamp, m.clamp);
                    ggml_tensor * g = ggml_clamp(ctx, ggml_silu(ctx, cur), -INFINITY, m.clamp);
                    h = ggml_mul(ctx, g, u);
                }
            } else {
                h = gated ? ggml_swiglu_split(ctx, cur, up) : ggml_silu(ctx, cur);
            }
            break;
        case ExpertAct::kSwiGluOai:
            h = ggml_swiglu_oai(ctx, cur, up, kSwiGluOaiAlpha, kSwiGluOaiLimit);
            break;
        case ExpertAct::kGelu:
            h = gated ? ggml_geglu_split(ctx, cur, up) : ggml_gelu(ctx, cur);
            break;
        case ExpertAct::kRelu:
            h = gated ? ggml_reglu_split(ctx, cur, up) : ggml_relu(ctx, cur);
            break;
        case ExpertAct::kReluSqr:
            h = ggml_sqr(ctx, ggml_relu(ctx, cur));
            break;
        case ExpertAct::kSitu: {
            const float beta = m.situ_beta, lb = m.situ_linear_beta;
            ggml_tensor * a = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, cur, 1.0f / beta)), beta);
            a = ggml_mul(ctx, a, ggml_sigmoid(ctx, cur));
            ggml_tensor * u = lb > 0.0f ? ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, up, 1.0f / lb)), lb) : up;
            h = ggml_mul(ctx, a, u);
            break;
        }
    }
    ggml_format_name(h, "%s_act-%d", prefix, il);

    ggml_tensor * out = mm_id(ctx, m.down, h, ids, m.down_s, s_ids, m.prec_down, prefix, "down", il);
    out = add_bias(ctx, out, m.down_b, ids, prefix, "down", il);  // [n_embd, k, T]
    if (weights && !m.weight_before) {
        out = ggml_mul(ctx, out, weights);
        ggml_format_name(out, "%s_weighted-%d", prefix, il);
    }
    return out;
}

}  // namespace hybrimoe
