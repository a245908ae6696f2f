#include "runtime/moe_hook.h"

#include "runtime/engine.h"
#include "runtime/expert_ffn.h"

#include "ggml.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

namespace hybrimoe {

namespace {

// Runs on one CPU thread (n_tasks = 1) once per layer and ubatch. dst: I32 [k, n_tokens], a contiguous copy
// of the routing ids (src[0], possibly a strided view). src[1] (routing weights) and src[2] (router
// probabilities) are inputs so the scheduler brings them to the host in the same split as the ids.
void moe_plan_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith != 0) {
        return;
    }
    const ggml_tensor * ids = dst->src[0];
    const int64_t k = ids->ne[0];
    const int64_t n_tokens = ids->ne[1];
    for (int64_t t = 0; t < n_tokens; ++t) {
        const char * row = (const char *) ids->data + t * ids->nb[1];
        int32_t * out = (int32_t *) ((char *) dst->data + t * dst->nb[1]);
        for (int64_t j = 0; j < k; ++j) {
            out[j] = *(const int32_t *) (row + j * ids->nb[0]);
        }
    }
    note_plan_run(*static_cast<LayerCounters *>(userdata), (const int32_t *) dst->data, k, n_tokens);
}

bool f32_rows(const ggml_tensor * t, int64_t n_expert) {  // ggml_add_id's bias: F32 [n_out, n_expert]
    return t->type == GGML_TYPE_F32 && ggml_n_dims(t) <= 2 && t->ne[1] == n_expert && ggml_is_contiguous(t);
}

bool f32_scales(const ggml_tensor * t, int64_t n_expert) {  // build_lora_mm_id's w_s: F32 [n_expert]
    return t->type == GGML_TYPE_F32 && ggml_n_dims(t) == 1 && t->ne[0] == n_expert && ggml_is_contiguous(t);
}

// Why build_expert_ffn cannot mirror this layer's build_moe_ffn (nullptr: it can).
const char * unsupported_reason(const llama_moe_hook_args & a) {
    if (a.act == LLAMA_MOE_ACT_OTHER) return "an expert activation the hook is not told of";
    if (!a.down_exps || (!a.up_exps && !a.gate_up_exps)) return "no up and down expert tensors";
    if (a.gate_up_exps && (a.gate_exps || a.up_exps)) return "both fused gate_up and separate gate/up experts";
    if (a.gate_up_exps_b && !a.gate_up_exps) return "a fused gate_up bias without fused gate_up experts";
    const bool gated = a.gate_exps || a.gate_up_exps;
    if (a.act == LLAMA_MOE_ACT_RELU_SQR && gated) return "gated squared ReLU (upstream aborts on it)";
    if ((a.act == LLAMA_MOE_ACT_SWIGLU_OAI || a.act == LLAMA_MOE_ACT_SITU) && !gated) {
        return "SwiGLU-OAI or SITU without a gate";
    }
    if (a.act == LLAMA_MOE_ACT_SITU && !(a.situ_beta != 0.0f)) return "SITU with beta 0";
    for (const ggml_tensor * b : {a.up_exps_b, a.gate_exps_b, a.down_exps_b, a.gate_up_exps_b}) {
        // ggml_add_id reads one F32 row per expert id; anything else stays on upstream's path
        if (b && !f32_rows(b, a.n_expert)) return "expert biases that are not F32 [n_out, n_expert]";
    }
    for (const ggml_tensor * sc : {a.up_exps_s, a.gate_exps_s, a.down_exps_s}) {
        if (sc && !f32_scales(sc, a.n_expert)) return "per-expert scales that are not F32 [n_expert]";
    }
    if (a.gate_exps_s && !a.gate_exps) return "a gate scale without gate experts";
    if (a.has_lora) return "LoRA adapters";
    if (a.n_expert_used_sum < 1 || a.n_expert_used_sum > a.n_expert_used) return "unexpected top-k";
    return nullptr;
}

ExpertAct act_of(llama_moe_act act) {
    switch (act) {
        case LLAMA_MOE_ACT_SWIGLU_OAI: return ExpertAct::kSwiGluOai;
        case LLAMA_MOE_ACT_GELU: return ExpertAct::kGelu;
        case LLAMA_MOE_ACT_RELU: return ExpertAct::kRelu;
        case LLAMA_MOE_ACT_RELU_SQR: return ExpertAct::kReluSqr;
        case LLAMA_MOE_ACT_SITU: return ExpertAct::kSitu;
        case LLAMA_MOE_ACT_SILU:
        default: return ExpertAct::kSilu;
    }
}

} // namespace

ExpertMatrices expert_matrices(const llama_moe_hook_args & a) {
    ExpertMatrices m;
    m.gate = a.gate_exps;
    m.up = a.up_exps;
    m.gate_up = a.gate_up_exps;
    m.down = a.down_exps;
    m.gate_b = a.gate_exps_b;
    m.up_b = a.up_exps_b;
    m.gate_up_b = a.gate_up_exps_b;
    m.down_b = a.down_exps_b;
    m.gate_s = a.gate_exps_s;
    m.up_s = a.up_exps_s;
    m.down_s = a.down_exps_s;
    m.act = act_of(a.act);
    // build_moe_ffn reads swiglu_clamp_exp for SiLU only (SwiGLU-OAI's limit is a constant of its call)
    m.clamp = a.act == LLAMA_MOE_ACT_SILU ? a.swiglu_limit : 0.0f;
    m.clamp_fused = a.swiglu_clamp_fused;
    m.situ_beta = a.situ_beta;
    m.situ_linear_beta = a.situ_linear_beta;
    m.prec_up = a.prec_up;
    m.prec_gate = a.prec_gate;
    m.prec_down = a.prec_down;
    m.weight_before = a.weight_before_ffn;
    return m;
}

void note_plan_run(LayerCounters & c, const int32_t * ids, int64_t k, int64_t n_tokens) {
    if (c.record) {
        c.k = (int32_t) k;
        c.recorded.insert(c.recorded.end(), ids, ids + k * n_tokens);
    }
    c.runs.fetch_add(1, std::memory_order_relaxed);
    c.tokens.fetch_add((uint64_t) n_tokens, std::memory_order_relaxed);
}

void MoeHook::set_engine(std::shared_ptr<Engine> engine) {
    engine_ = std::move(engine);
    if (ctx_) {
        llama_set_moe_hook(ctx_, &MoeHook::hook, this);  // rebuild the graphs with (or without) the engine
    }
}

std::vector<std::pair<int, std::string>> MoeHook::engine_skipped() const {
    std::lock_guard<std::mutex> lock(mu_);
    return engine_skipped_;
}

MoeHook::MoeHook(int max_layers) : counters_((size_t) (max_layers > 0 ? max_layers : 1)) {}

void MoeHook::attach(llama_context * ctx) {
    if (ctx_ && ctx_ != ctx) {
        throw std::runtime_error("MoeHook is already attached to another context");
    }
    ctx_ = ctx;
    llama_set_moe_hook(ctx, &MoeHook::hook, this);
}

void MoeHook::detach() {
    if (ctx_) {
        llama_set_moe_hook(ctx_, nullptr, nullptr);
        ctx_ = nullptr;
    }
}

void MoeHook::reset_counters() {
    for (auto & c : counters_) {
        c.runs = 0;
        c.tokens = 0;
        c.hook_calls = 0;
    }
}

void MoeHook::set_recording(bool on) {
    for (auto & c : counters_) {
        c.record = on;
        c.recorded.clear();
        c.k = 0;
    }
}

std::vector<int32_t> MoeHook::recorded(int il, int32_t * k) const {
    const LayerCounters & c = counters_.at((size_t) il);
    *k = c.k;
    return c.recorded;
}

std::vector<std::pair<int, std::string>> MoeHook::unsupported() const {
    std::lock_guard<std::mutex> lock(mu_);
    return unsupported_;
}

ggml_tensor * MoeHook::hook(const llama_moe_hook_args * args, void * user_data) {
    auto * self = static_cast<MoeHook *>(user_data);
    if (!self || !args || args->il < 0 || args->il >= self->max_layers()) {
        return nullptr;
    }
    try {
        return self->build(*args);
    } catch (...) {
        return nullptr; // never let an exception cross into llama.cpp: keep upstream's path
    }
}

ggml_tensor * MoeHook::build(const llama_moe_hook_args & a) {
    LayerCounters & c = counters_[(size_t) a.il];
    c.hook_calls.fetch_add(1, std::memory_order_relaxed);

    if (const char * why = unsupported_reason(a)) {
        std::lock_guard<std::mutex> lock(mu_);
        for (const auto & u : unsupported_) {
            if (u.first == a.il) return nullptr;
        }
        unsupported_.emplace_back(a.il, why);
        return nullptr;
    }

    if (engine_ && engine_->moe_index(a.il) >= 0) {
        if (ggml_tensor * out = engine_->build(a, &c)) return out;
        std::lock_guard<std::mutex> lock(mu_);
        bool known = false;
        for (const auto & u : engine_skipped_) known = known || u.first == a.il;
        if (!known) {
            engine_skipped_.emplace_back(a.il, "expert tensors are neither in host memory nor in upstream's "
                                               "repacked CPU buffer (or repacked where the engine cannot use it), "
                                               "or differ from the facts the engine was given");
        }
    }

    ggml_context * ctx = a.ctx;
    const int64_t n_embd = a.cur->ne[0];
    const int64_t n_tokens = a.cur->ne[1];
    const int64_t k = a.n_expert_used;

    ggml_tensor * srcs[3] = { a.selected_experts, a.weights, a.probs };
    ggml_tensor * ids = ggml_custom_4d(ctx, GGML_TYPE_I32, k, n_tokens, 1, 1, srcs, 3, moe_plan_op, 1, &c);
    ggml_format_name(ids, "hybrimoe_plan-%d", a.il);

    // the routed experts, op for op as build_moe_ffn computes them (so ggml picks the same kernels)
    ggml_tensor * x = ggml_reshape_3d(ctx, a.cur, n_embd, 1, n_tokens);
    ggml_tensor * experts = build_expert_ffn(ctx, expert_matrices(a), x, ids, a.weights, "hybrimoe_seed",
                                             a.il);  // [n_embd, k, T]

    // sum the ranks in upstream's order (rank 0 + rank 1 + ...): floating-point addition is not associative
    ggml_tensor * out = ggml_view_2d(ctx, experts, n_embd, n_tokens, experts->nb[2], 0);
    for (int64_t i = 1; i < a.n_expert_used_sum; ++i) {
        out = ggml_add(ctx, out, ggml_view_2d(ctx, experts, n_embd, n_tokens, experts->nb[2], i * experts->nb[1]));
    }
    if (a.n_expert_used_sum == 1) {
        out = ggml_cont(ctx, out);
    }
    return out;
}

} // namespace hybrimoe
