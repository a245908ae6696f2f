#include "runtime/gpu_share.h"

#include "runtime/expert_ffn.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace hybrimoe {

namespace {

constexpr size_t kRegionAlign = 256;

size_t align_up(size_t n) { return (n + kRegionAlign - 1) / kRegionAlign * kRegionAlign; }

// a tensor header of `type` over bytes [off, ...) of `packed` (one allocation for every input of a launch)
ggml_tensor * input_at(ggml_context * ctx, const ggml_tensor * packed, ggml_type type, int64_t ne0, int64_t ne1,
                       int64_t ne2, size_t off) {
    ggml_tensor * t = ggml_new_tensor_3d(ctx, type, ne0, ne1, ne2);
    t->data = (char *) packed->data + off;
    t->buffer = packed->buffer;
    return t;
}

}  // namespace

GpuShare::Launch::~Launch() {
    if (galloc) ggml_gallocr_free(galloc);
    if (host_buf) ggml_backend_buffer_free(host_buf);
    if (in_buf) ggml_backend_buffer_free(in_buf);
    if (in_ctx) ggml_free(in_ctx);
    if (ctx) ggml_free(ctx);
}

GpuShare::GpuShare(SlotPool & pool, int n_embd) : pool_(pool), n_embd_(n_embd) {}

GpuShare::~GpuShare() { clear(); }

void GpuShare::clear() { graphs_.clear(); }

int64_t GpuShare::bucket(int64_t n) {
    int64_t b = 1;
    while (b < n) b *= 2;
    return b;
}

int64_t GpuShare::pairs(const Launch & l) const { return l.n_pairs; }

std::string GpuShare::signature(const ExpertMatrices & m) {
    // every fact of `m` the graph's nodes depend on: types and shapes of the matrices, bias lengths, which scales
    // exist, the activation and its constants, src1 precisions, where the weights go in
    std::string sig;
    auto put = [&sig](double v) { sig += std::to_string(v) + ","; };
    for (const ggml_tensor * t : m.slot_matrices()) {
        if (t) { put(t->type); put((double) t->ne[0]); put((double) t->ne[1]); } else { put(-1); }
    }
    for (const ggml_tensor * t : m.slot_biases()) put(t ? (double) t->ne[0] : -1);
    for (const ggml_tensor * t : m.slot_scales()) put(t ? 1 : 0);
    put(m.gate_up ? 1 : 0);
    put((double) m.act);
    put(m.clamp);
    put(m.clamp_fused ? 1 : 0);
    put(m.situ_beta);
    put(m.situ_linear_beta);
    put(m.prec_up);
    put(m.prec_gate);
    put(m.prec_down);
    put(m.weight_before ? 1 : 0);
    put(m.swap_gate_up ? 1 : 0);
    return sig;
}

GpuShare::Launch & GpuShare::prepare(const ExpertMatrices & like, int64_t max_pairs, int index, int buffer) {
    const int64_t cap = bucket(max_pairs);
    const auto key = std::make_tuple(signature(like), cap, index, buffer);
    auto it = graphs_.find(key);
    if (it != graphs_.end()) {
        it->second->n_pairs = it->second->n_rows = 0;
        return *it->second;
    }
    std::unique_ptr<Launch> l(new Launch());
    l->cap = cap;
    l->buffer = buffer;
    const int64_t D = n_embd_;
    // packed inputs: slot ids I32 [cap] | row of each pair I32 [cap] | weights F32 [cap] | hidden rows F32 [D, cap]
    l->off_rows = align_up(sizeof(int32_t) * (size_t) cap);
    l->off_w = l->off_rows + align_up(sizeof(int32_t) * (size_t) cap);
    l->off_x = l->off_w + align_up(sizeof(float) * (size_t) cap);
    const size_t total = l->off_x + sizeof(float) * (size_t) (D * cap);
    ggml_init_params ipi = {ggml_tensor_overhead() * 2, nullptr, true};
    l->in_ctx = ggml_init(ipi);
    l->packed = ggml_new_tensor_1d(l->in_ctx, GGML_TYPE_I8, (int64_t) total);
    ggml_set_name(l->packed, "hybrimoe_gpu_inputs");
    l->in_buf = ggml_backend_alloc_ctx_tensors(l->in_ctx, pool_.compute());
    if (!l->in_buf) {
        throw std::runtime_error("engine: cannot allocate the GPU share's inputs on " + pool_.device_name());
    }
    if (ggml_backend_buffer_type_t hb = pool_.host_buffer_type()) {
        l->host_buf = ggml_backend_buft_alloc_buffer(hb, total);
    }
    if (l->host_buf) {
        l->stage = (uint8_t *) ggml_backend_buffer_get_base(l->host_buf);
    } else {
        l->host_vec.assign(total, 0);
        l->stage = l->host_vec.data();
    }
    std::memset(l->stage, 0, total);

    ggml_init_params ip = {ggml_tensor_overhead() * 64 + ggml_graph_overhead(), nullptr, true};
    l->ctx = ggml_init(ip);
    ggml_context * ctx = l->ctx;
    ggml_tensor * ids = input_at(ctx, l->packed, GGML_TYPE_I32, 1, cap, 1, 0);
    ggml_tensor * rows = input_at(ctx, l->packed, GGML_TYPE_I32, cap, 1, 1, l->off_rows);
    ggml_tensor * w = input_at(ctx, l->packed, GGML_TYPE_F32, 1, 1, cap, l->off_w);
    ggml_tensor * x = input_at(ctx, l->packed, GGML_TYPE_F32, D, cap, 1, l->off_x);
    ggml_tensor * xp = ggml_get_rows(ctx, x, rows);  // [D, cap]: each pair's hidden-state row
    ggml_tensor * xr = ggml_reshape_3d(ctx, xp, D, 1, cap);
    // the slot pool's views: mul_mat_id and ggml_add_id index them with local slot numbers, as build_moe_ffn
    // indexes the file's tensors with expert ids
    // (regions 0..2: gate or fused gate_up, up, down; the same for biases; scales of gate, up, down)
    ExpertMatrices m = like;  // the op details; every tensor is replaced by a view of the pool below
    const auto mats = like.slot_matrices(), biases = like.slot_biases(), scales = like.slot_scales();
    ggml_tensor * mv[3] = {nullptr, nullptr, nullptr}, * bv[3] = {nullptr, nullptr, nullptr};
    ggml_tensor * sv[3] = {nullptr, nullptr, nullptr};
    for (int i = 0; i < 3; ++i) {
        if (mats[(size_t) i]) mv[i] = pool_.region_view(ctx, mats[(size_t) i], i, buffer);
        if (biases[(size_t) i]) bv[i] = pool_.bias_view(ctx, biases[(size_t) i], i, buffer);
        if (scales[(size_t) i]) sv[i] = pool_.scale_view(ctx, i, buffer);
    }
    (like.gate_up ? m.gate_up : m.gate) = mv[0];
    (like.gate_up ? m.gate_up_b : m.gate_b) = bv[0];
    m.up = mv[1];
    m.up_b = bv[1];
    m.down = mv[2];
    m.down_b = bv[2];
    m.gate_s = sv[0];
    m.up_s = sv[1];
    m.down_s = sv[2];
    l->out = build_expert_ffn(ctx, m, xr, ids, w, "hybrimoe_gpu", (int) cap);  // [D, 1, cap]
    ggml_set_output(l->out);
    l->gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(l->gf, l->out);
    for (int i = 0; i < ggml_graph_n_nodes(l->gf); ++i) {
        // a type or op the device cannot compute is a clear error (the engine then runs the layer on the CPU)
        ggml_tensor * node = ggml_graph_node(l->gf, i);
        if (!ggml_backend_supports_op(pool_.compute(), node)) {
            throw std::runtime_error(std::string("engine: ") + pool_.device_name() + " cannot compute " +
                                     ggml_op_desc(node) + " on " + ggml_type_name(node->src[0] ? node->src[0]->type
                                                                                               : node->type) +
                                     " for the GPU share");
        }
    }
    l->galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(pool_.compute()));
    if (!ggml_gallocr_alloc_graph(l->galloc, l->gf)) {
        throw std::runtime_error("engine: cannot allocate the GPU share's work buffers on " + pool_.device_name());
    }
    Launch & ref = *l;
    graphs_[key] = std::move(l);
    return ref;
}

int32_t GpuShare::add_row(Launch & l, const float * x) {
    if (l.n_rows >= l.cap) throw std::logic_error("engine: more GPU rows than the launch was prepared for");
    std::memcpy(l.stage + l.off_x + sizeof(float) * (size_t) (l.n_rows * n_embd_), x, sizeof(float) * (size_t) n_embd_);
    return (int32_t) l.n_rows++;
}

void GpuShare::add_pair(Launch & l, int32_t row, int32_t slot, float weight) {
    if (l.n_pairs >= l.cap) throw std::logic_error("engine: more GPU pairs than the launch was prepared for");
    const size_t i = (size_t) l.n_pairs++;
    std::memcpy(l.stage + sizeof(int32_t) * i, &slot, sizeof(slot));
    std::memcpy(l.stage + l.off_rows + sizeof(int32_t) * i, &row, sizeof(row));
    std::memcpy(l.stage + l.off_w + sizeof(float) * i, &weight, sizeof(weight));
}

size_t GpuShare::run(Launch & l) {
    // padded pairs: row 0 through the null slot, weight 0 (finite: the null slot's zeros give zeros)
    const int32_t null_slot = pool_.null_slot(l.buffer), zero_row = 0;
    const float zero = 0.0f;
    for (int64_t i = l.n_pairs; i < l.cap; ++i) {
        std::memcpy(l.stage + sizeof(int32_t) * (size_t) i, &null_slot, sizeof(null_slot));
        std::memcpy(l.stage + l.off_rows + sizeof(int32_t) * (size_t) i, &zero_row, sizeof(zero_row));
        std::memcpy(l.stage + l.off_w + sizeof(float) * (size_t) i, &zero, sizeof(zero));
    }
    // only the staged hidden rows travel; rows past them are never read (every pair's row is below n_rows)
    const size_t bytes = l.off_x + sizeof(float) * (size_t) (std::max<int64_t>(l.n_rows, 1) * n_embd_);
    ggml_backend_tensor_set_async(pool_.compute(), l.packed, l.stage, 0, bytes);
    if (ggml_backend_graph_compute_async(pool_.compute(), l.gf) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error("the GPU share failed on " + pool_.device_name());
    }
    return bytes;
}

size_t GpuShare::read(Launch & l, float * dst) {
    const size_t bytes = sizeof(float) * (size_t) (l.n_pairs * n_embd_);
    if (bytes) ggml_backend_tensor_get_async(pool_.compute(), l.out, dst, 0, bytes);
    return bytes;
}

}  // namespace hybrimoe
