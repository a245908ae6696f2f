#include "runtime/fused_moe.h"

#include "runtime/cpu_layout.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#define HYBRIMOE_PAUSE() _mm_pause()
#else
#define HYBRIMOE_PAUSE() ((void) 0)
#endif

namespace hybrimoe {

namespace {

// column blocks of a phase's units: small enough that the threads' shares come out even, large enough that claiming
// one costs nothing beside its rows (64 rows of a 2048-wide Q4_K matrix are 73 KB)
constexpr int64_t kBlockCols = 64;
// a ubatch of at most this many activation values is quantized by the plan op (one thread): decode
constexpr int64_t kPlanQuantizeValues = 8192;
// threads that may gather activation rows for a repacked gemm at once (more: gemv only, as exact)
constexpr int kMaxGatherThreads = 64;
// activation rows handed to patch 0011's multi-row kernels per call (each takes them in passes of its own: 8 rows
// per pass over the weights for Q5_0 and Q8_0, 4 for the K-quants, plain and repacked)
constexpr int kRowsPerPass = 8;

// Columns [c0, c1) of matrix mk (expert e) for pairs [q0, q1), pair q's activation row act(q) and its outputs at
// out + (q - q0) * ld: patch 0011's multi-row kernel, up to kRowsPerPass pairs per call, where mk has one; else gemv
// per pair. The numbers are gemv's either way.
template <class Act>
void pairs_gemv(const MatrixKernel & mk, int64_t e, int32_t q0, int32_t q1, Act act, float * out, size_t ld,
                int64_t c0, int64_t c1) {
    int32_t q = q0;
    if (mk.multi_row()) {
        const void * rows[kRowsPerPass];
        while (q1 - q >= 2) {
            const int nr = std::min<int32_t>(kRowsPerPass, q1 - q);
            for (int r = 0; r < nr; ++r) rows[r] = act(q + r);
            mk.gemv_rows(e, rows, nr, out + (size_t) (q - q0) * ld, ld, c0, c1);
            q += nr;
        }
    }
    for (; q < q1; ++q) mk.gemv(e, act(q), out + (size_t) (q - q0) * ld, c0, c1);
}

// The K-quant (and IQ) types ggml-cpu's tiled kernel takes over in mul_mat_id from 8 rows of an expert
// (ggml-cpu/tiled/tiled.cpp, ggml_tiled_supported and ggml_compute_forward_mul_mat_id_tiled): other arithmetic than
// the type's vec_dot.
bool tiled_type(ggml_type t) {
    switch (t) {
        case GGML_TYPE_Q6_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q2_K:
        case GGML_TYPE_IQ4_XS: case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ2_S:
        case GGML_TYPE_IQ3_XXS: case GGML_TYPE_IQ3_S: case GGML_TYPE_IQ1_S: case GGML_TYPE_IQ1_M:
            return true;
        default:
            return false;
    }
}

// Whether a repacked layout's gemm gives its gemv's numbers on this CPU, checked once per kernel (a structural
// property of the two kernels' arithmetic: Q4_0's gemm is four of its gemvs, Q4_K's sums its blocks in another
// order). The check: a seeded random matrix of the type, 4096 values wide (16 K-quant blocks: a different order
// shows in most outputs) and 64 columns, repacked by the CPU_REPACK buffer, times 8 seeded activation rows quantized
// per row (gemv) and 4 by 4 (gemm); every output bit compared. False when it cannot be run.
bool gemm_matches_gemv(const CpuMoeKernels & kern, ggml_type type, const CpuRepackKernels & rk) {
    static std::mutex mu;
    static std::map<void *, bool> known;
    std::lock_guard<std::mutex> lock(mu);
    auto it = known.find((void *) rk.gemm);
    if (it != known.end()) return it->second;
    bool same = false;
    const int64_t n = 4096, cols = 64, rows = 8;
    ggml_backend_buffer_type_t buft = repack_buffer_type();
    ggml_init_params ip = {ggml_tensor_overhead() * 2, nullptr, true};
    ggml_context * ctx = buft && n % ggml_blck_size(type) == 0 ? ggml_init(ip) : nullptr;
    ggml_backend_buffer_t buf = nullptr;
    if (ctx) {
        ggml_tensor * t = ggml_new_tensor_2d(ctx, type, n, cols);
        buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
        CpuRepackKernels k;
        if (buf && !ggml_quantize_requires_imatrix(type)) {
            std::mt19937 rng(20251206);
            std::normal_distribution<float> nd(0.0f, 1.0f);
            std::vector<float> w((size_t) (n * cols)), x((size_t) (n * rows));
            for (float & v : w) v = 0.02f * nd(rng);
            for (float & v : x) v = nd(rng);
            std::vector<uint8_t> q(ggml_row_size(type, n) * (size_t) cols);
            ggml_quantize_chunk(type, w.data(), q.data(), 0, cols, n, nullptr);
            ggml_backend_tensor_set(t, q.data(), 0, q.size());  // repacks
            if (kern.repack_kernels_of(t, &k) && k.gemm == rk.gemm && k.gemv == rk.gemv) {
                const size_t ab = ggml_row_size(k.act_type, n);
                ggml_from_float_t from_float = ggml_get_type_traits_cpu(k.act_type)->from_float;
                std::vector<uint8_t> per_row((size_t) rows * ab), blocks((size_t) rows * ab);
                std::vector<float> a((size_t) (rows * cols)), b((size_t) (rows * cols));
                for (int64_t r = 0; r < rows; ++r) {
                    from_float(x.data() + r * n, per_row.data() + r * ab, n);
                    k.gemv((int) n, a.data() + r * cols, (size_t) cols, t->data, per_row.data() + r * ab, 1,
                           (int) cols);
                }
                for (int64_t r = 0; r < rows; r += 4) k.quantize_mat(x.data() + r * n, blocks.data() + r * ab, 4, n);
                k.gemm((int) n, b.data(), (size_t) cols, t->data, blocks.data(), (int) rows, (int) cols);
                same = std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
            }
        }
    }
    if (buf) ggml_backend_buffer_free(buf);
    if (ctx) ggml_free(ctx);
    known[(void *) rk.gemm] = same;
    return same;
}

MatrixKernel make_kernel(const CpuMoeKernels & kern, const ggml_tensor * w, bool any_gemm) {
    MatrixKernel mk;
    mk.w = w;
    mk.n_in = w->ne[0];
    mk.n_out = w->ne[1];
    mk.nb1 = w->nb[1];
    mk.nb2 = w->nb[2];
    mk.repacked = kern.repack_kernels_of(w, &mk.rk);
    if (mk.repacked) {
        mk.act_type = mk.rk.act_type;
        mk.align = std::max<int64_t>(1, mk.rk.n_cols);
    } else {
        const auto * tr = ggml_get_type_traits_cpu(w->type);
        mk.act_type = tr->vec_dot_type;
        mk.vec_dot = tr->vec_dot;
        if (kern.version >= 2 && kern.vec_dot_rows_of) mk.vec_dot_rows = kern.vec_dot_rows_of(w->type);
    }
    mk.from_float = ggml_get_type_traits_cpu(mk.act_type)->from_float;
    mk.act_bytes = ggml_row_size(mk.act_type, mk.n_in);
    if (!mk.from_float || (!mk.repacked && !mk.vec_dot) || (mk.repacked && !mk.rk.gemv)) {
        throw std::runtime_error(std::string("engine: no CPU kernel for ") + ggml_type_name(w->type) + " experts");
    }
    mk.gemm = mk.repacked && mk.rk.gemm && mk.rk.quantize_mat && mk.n_out % (4 * mk.align) == 0 &&
              (any_gemm || gemm_matches_gemv(kern, w->type, mk.rk));
    return mk;
}

}  // namespace

const CpuMoeKernels * cpu_moe_kernels() {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
    if (!reg) return nullptr;
    const auto * k = (const CpuMoeKernels *) ggml_backend_reg_get_proc_address(reg, "ggml_backend_cpu_moe_kernels");
    return k && k->version >= 1 && k->repack_kernels_of && k->swiglu ? k : nullptr;
}

void MatrixKernel::gemv(int64_t e, const void * act, float * out, int64_t c0, int64_t c1) const {
    const char * base = (const char *) w->data + (size_t) e * nb2;
    if (repacked) {
        // repack.cpp forward_mul_mat_id: the layout's gemv over the columns [c0, c1), c0 a multiple of the interleave
        rk.gemv((int) n_in, out, (size_t) n_out, base + (size_t) c0 * nb1, act, 1, (int) (c1 - c0));
        return;
    }
    // ggml_compute_forward_mul_mat_id_one_chunk: the type's vec_dot per output element
    for (int64_t c = c0; c < c1; ++c) vec_dot((int) n_in, out + (c - c0), 0, base + (size_t) c * nb1, 0, act, 0, 1);
}

void MatrixKernel::gemv_rows(int64_t e, const void * const * acts, int nr, float * out, size_t ld, int64_t c0,
                             int64_t c1) const {
    const char * base = (const char *) w->data + (size_t) e * nb2;
    if (repacked) {
        // patch 0011: the layout's gemv for every row, each interleaved block unpacked once
        rk.gemv_rows((int) n_in, out, ld, base + (size_t) c0 * nb1, acts, nr, (int) (c1 - c0));
        return;
    }
    // patch 0011: per output column, the type's vec_dot for every row, the weight row unpacked once
    for (int64_t c = c0; c < c1; ++c) vec_dot_rows((int) n_in, out + (c - c0), ld, base + (size_t) c * nb1, acts, nr);
}

void MatrixKernel::gemm4(int64_t e, const void * act, int nr, float * out, size_t ld, int64_t c0, int64_t c1) const {
    // repack.cpp forward_mul_mat_one_chunk: the layout's gemm over 4-row groups of activations
    const char * base = (const char *) w->data + (size_t) e * nb2;
    rk.gemm((int) n_in, out, ld, base + (size_t) c0 * nb1, act, nr, (int) (c1 - c0));
}

const char * FusedCpuShare::unsupported(const ExpertMatrices & m, int64_t T) {
    if (!m.gated() || m.act != ExpertAct::kSilu) return "an activation other than SwiGLU";
    if (m.clamp > 1e-6f) return "a SwiGLU clamp";
    if (m.gate_b || m.up_b || m.down_b || m.gate_up_b) return "expert biases";
    if (m.gate_s || m.up_s || m.down_s) return "per-expert scales";
    if (m.weight_before) return "routing weights before the FFN";
    if (m.swap_gate_up) return "a negative control";
    const CpuMoeKernels * kern = cpu_moe_kernels();
    if (!kern) return "a CPU backend without hybrimoe's kernel table (patch 0009)";
    for (const ggml_tensor * w : m.slot_matrices()) {
        if (!w) continue;
        if (w->type == GGML_TYPE_F32 || !w->data || w->nb[0] != ggml_type_size(w->type)) return "an unusual layout";
        CpuRepackKernels rk;
        if (!kern->repack_kernels_of(w, &rk) && T >= 8 && tiled_type(w->type)) {
            return "a plain K-quant matrix in a ubatch of 8 or more (upstream's tiled kernel)";
        }
    }
    if (m.gate_up && m.gate_up->ne[1] % 2 != 0) return "an odd fused gate_up";
    return nullptr;
}

void FusedCpuShare::prepare(int ml, const ExpertMatrices & m, int64_t n_embd, int64_t k, int64_t T) {
    kern_ = cpu_moe_kernels();
    if (!kern_) throw std::runtime_error("engine: the fused CPU share needs hybrimoe's ggml-cpu (patch 0009)");
    if ((int) layers_.size() <= ml) layers_.resize((size_t) ml + 1);
    Layer & L = layers_[(size_t) ml];
    L.fused_gate_up = m.gate_up != nullptr;
    L.gate = make_kernel(*kern_, m.gate_up ? m.gate_up : m.gate, any_gemm_);
    L.up = m.gate_up ? L.gate : make_kernel(*kern_, m.up, any_gemm_);
    L.down = make_kernel(*kern_, m.down, any_gemm_);
    L.n_ff = m.gate_up ? m.gate_up->ne[1] / 2 : m.gate->ne[1];
    L.n_embd = n_embd;
    if (L.n_ff % L.gate.align != 0 || L.down.n_in != L.n_ff || L.down.n_out != n_embd || L.gate.n_in != n_embd) {
        throw std::runtime_error("engine: expert matrices of shapes the fused CPU share does not take");
    }
    const size_t pairs = (size_t) (k * T);
    auto grow = [](auto & v, size_t n) {
        if (v.size() < n) v.resize(n);
    };
    grow(xq_gate_, (size_t) T * L.gate.act_bytes);
    grow(xq_up_, (size_t) T * L.up.act_bytes);
    grow(xq4_gate_, pairs * L.gate.act_bytes);
    grow(xq4_up_, pairs * L.up.act_bytes);
    grow(g_, pairs * (size_t) L.n_ff);
    grow(u_, pairs * (size_t) L.n_ff);
    grow(hq_, pairs * L.down.act_bytes);
    grow(d_, pairs * (size_t) n_embd);
    grow(gather_, (size_t) kMaxGatherThreads * 4 * (size_t) n_embd);
    L.ready = true;
}

void FusedCpuShare::quantize_token(const MatrixKernel & mk, uint8_t * dst, const float * x) const {
    mk.from_float(x, dst, mk.n_in);
}

const uint8_t * FusedCpuShare::gate_row(const Layer & L, int32_t q) const {
    return xq_gate_.data() + (size_t) pair_tok_[(size_t) q] * L.gate.act_bytes;
}

const uint8_t * FusedCpuShare::up_row(const Layer & L, int32_t q) const {
    if (L.up.act_type == L.gate.act_type) return gate_row(L, q);
    return xq_up_.data() + (size_t) pair_tok_[(size_t) q] * L.up.act_bytes;
}

const uint8_t * FusedCpuShare::down_row(const Layer & L, int32_t q) const {
    return hq_.data() + (size_t) q * L.down.act_bytes;
}

void FusedCpuShare::make_units(std::vector<Unit> & units, int64_t n_out, int64_t align) {
    units.clear();
    const int64_t block = std::max(align, (kBlockCols + align - 1) / align * align);
    for (size_t g = 0; g + 1 < group_start_.size(); ++g) {
        for (int64_t c0 = 0; c0 < n_out; c0 += block) {
            units.push_back({(int32_t) g, (int32_t) c0, (int32_t) std::min(n_out, c0 + block)});
        }
    }
}

void FusedCpuShare::plan(int ml, const int32_t * ids, size_t ids_nb1, int64_t k, int64_t T, const float * x,
                         size_t x_nb1) {
    const Layer & L = layers_[(size_t) ml];
    T_ = T;
    k_ = k;
    // the CPU pairs grouped by expert, in (token, rank) order within an expert (upstream's grouping order)
    const int64_t n_ids = L.down.w->ne[2];
    std::vector<int32_t> & count = count_;  // members: no allocation per layer once grown
    count.assign((size_t) n_ids, 0);
    tok_needed_.assign((size_t) T, 0);
    for (int64_t t = 0; t < T; ++t) {
        const int32_t * row = (const int32_t *) ((const char *) ids + (size_t) t * ids_nb1);
        for (int64_t j = 0; j < k; ++j) {
            if (row[j] >= 0 && row[j] < n_ids) {
                ++count[(size_t) row[j]];
                tok_needed_[(size_t) t] = 1;
            }
        }
    }
    group_expert_.clear();
    group_start_.assign(1, 0);
    std::vector<int32_t> & slot = next_pos_;
    slot.assign((size_t) n_ids, -1);
    for (int64_t e = 0; e < n_ids; ++e) {
        if (count[(size_t) e] == 0) continue;
        slot[(size_t) e] = group_start_.back();
        group_expert_.push_back((int32_t) e);
        group_start_.push_back(group_start_.back() + count[(size_t) e]);
    }
    const int32_t n_pairs = group_start_.back();
    pair_tok_.resize((size_t) n_pairs);
    pair_rank_.resize((size_t) n_pairs);
    for (int64_t t = 0; t < T; ++t) {
        const int32_t * row = (const int32_t *) ((const char *) ids + (size_t) t * ids_nb1);
        for (int64_t j = 0; j < k; ++j) {
            if (row[j] < 0 || row[j] >= n_ids) continue;
            const int32_t p = slot[(size_t) row[j]]++;
            pair_tok_[(size_t) p] = (int32_t) t;
            pair_rank_[(size_t) p] = (int32_t) j;
        }
    }
    // a decode-sized ubatch: its activations quantized here, once per layer (gate and up share them when their
    // kernels read the same quantized type)
    x_ready_ = T * L.n_embd <= kPlanQuantizeValues;
    if (x_ready_) {
        for (int64_t t = 0; t < T; ++t) {
            if (!tok_needed_[(size_t) t]) continue;
            const float * xr = (const float *) ((const char *) x + (size_t) t * x_nb1);
            quantize_token(L.gate, xq_gate_.data() + (size_t) t * L.gate.act_bytes, xr);
            if (L.up.act_type != L.gate.act_type) quantize_token(L.up, xq_up_.data() + (size_t) t * L.up.act_bytes, xr);
        }
    }
    for (auto & n : next_) n.store(0, std::memory_order_relaxed);
    arrived_.store(0, std::memory_order_relaxed);
}

void FusedCpuShare::barrier(int nth) {
    if (nth <= 1) return;
    const int gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == nth - 1) {
        arrived_.store(0, std::memory_order_relaxed);
        generation_.store(gen + 1, std::memory_order_release);
        return;
    }
    for (int spin = 0; generation_.load(std::memory_order_acquire) == gen; ++spin) {
        if (spin < 4096) {
            HYBRIMOE_PAUSE();
        } else {
            std::this_thread::yield();
        }
    }
}

void FusedCpuShare::gate_up_unit(const Layer & L, const Unit & u, bool gemm) {
    const int32_t s = group_start_[(size_t) u.group], p = group_start_[(size_t) u.group + 1] - s;
    const int64_t e = group_expert_[(size_t) u.group];
    const bool shared = L.up.act_type == L.gate.act_type;
    const int64_t up_off = L.fused_gate_up ? L.n_ff : 0;  // the up rows of a fused gate_up matrix
    const size_t ff = (size_t) L.n_ff;
    // gate and up over the same columns, one after the other, for the expert's pairs: the quantized activation rows
    // are read while they are in the cache
    int32_t done = 0;
    if (gemm && p >= 4) {
        done = p / 4 * 4;
        const uint8_t * ag = xq4_gate_.data() + (size_t) s * L.gate.act_bytes;
        const uint8_t * au = shared ? ag : xq4_up_.data() + (size_t) s * L.up.act_bytes;
        L.gate.gemm4(e, ag, done, g_.data() + (size_t) s * ff + u.c0, ff, u.c0, u.c1);
        L.up.gemm4(e, au, done, u_.data() + (size_t) s * ff + u.c0, ff, up_off + u.c0, up_off + u.c1);
    }
    const int32_t q0 = s + done, q1 = s + p;
    pairs_gemv(L.gate, e, q0, q1, [&](int32_t q) { return gate_row(L, q); }, g_.data() + (size_t) q0 * ff + u.c0, ff,
               u.c0, u.c1);
    pairs_gemv(L.up, e, q0, q1, [&](int32_t q) { return up_row(L, q); }, u_.data() + (size_t) q0 * ff + u.c0, ff,
               up_off + u.c0, up_off + u.c1);
}

void FusedCpuShare::act_pair(const Layer & L, int64_t q) {
    const size_t ff = (size_t) L.n_ff;
    float * h = g_.data() + (size_t) q * ff;
    float * u = u_.data() + (size_t) q * ff;
    if (swap_) std::swap(h, u);                      // the negative control: silu(up) * gate
    kern_->swiglu((int) L.n_ff, g_.data() + (size_t) q * ff, h, u);  // silu(gate) * up, as GGML_OP_GLU computes it
}

float * FusedCpuShare::out_row(ggml_tensor * dst, int32_t q) const {
    return (float *) ((char *) dst->data + (size_t) pair_rank_[(size_t) q] * dst->nb[1] +
                      (size_t) pair_tok_[(size_t) q] * dst->nb[2]);
}

void FusedCpuShare::scatter(ggml_tensor * dst, const Layer & L, int32_t q0, int32_t q1, int64_t c0, int64_t c1) const {
    const size_t ne = (size_t) L.n_embd;
    const float * d = d_.data() + (size_t) q0 * ne;
    for (int32_t q = q0; q < q1; ++q) {
        std::memcpy(out_row(dst, q) + c0, d + (size_t) (q - q0) * ne + c0, (size_t) (c1 - c0) * sizeof(float));
    }
}

void FusedCpuShare::down_pairs(const Layer & L, int64_t e, int32_t q0, int32_t q1, int64_t c0, int64_t c1,
                               ggml_tensor * dst) {
    const size_t ne = (size_t) L.n_embd;
    if (L.down.multi_row() && q1 - q0 >= 2) {
        // the multi-row kernel into the scratch rows, then each pair's output row
        pairs_gemv(L.down, e, q0, q1, [&](int32_t q) { return down_row(L, q); }, d_.data() + (size_t) q0 * ne + c0, ne,
                   c0, c1);
        scatter(dst, L, q0, q1, c0, c1);
        return;
    }
    for (int32_t q = q0; q < q1; ++q) L.down.gemv(e, down_row(L, q), out_row(dst, q) + c0, c0, c1);
}

void FusedCpuShare::down_unit(const Layer & L, const Unit & u, ggml_tensor * dst) {
    const int32_t s = group_start_[(size_t) u.group], p = group_start_[(size_t) u.group + 1] - s;
    const int64_t e = group_expert_[(size_t) u.group];
    int32_t done = 0;
    if (L.down.gemm && p >= 4) {
        done = p / 4 * 4;
        float * d = d_.data() + (size_t) s * (size_t) L.n_embd;
        L.down.gemm4(e, hq_.data() + (size_t) s * L.down.act_bytes, done, d + u.c0, (size_t) L.n_embd, u.c0, u.c1);
        scatter(dst, L, s, s + done, u.c0, u.c1);
    }
    down_pairs(L, e, s + done, s + p, u.c0, u.c1, dst);
}

void FusedCpuShare::run(int ml, ggml_tensor * dst, const float * x, size_t x_nb1, int ith, int nth) {
    const Layer & L = layers_[(size_t) ml];
    const int n_groups = (int) group_expert_.size();
    if (n_groups == 0) return;
    const size_t ff = (size_t) L.n_ff;
    // decode: whole experts per thread and no synchronisation at all, when they divide evenly over the threads
    // (every thread decides the same from the same figures)
    if (x_ready_ && n_groups >= nth && n_groups % nth == 0) {
        const int64_t up_off = L.fused_gate_up ? L.n_ff : 0;
        for (int g = ith; g < n_groups; g += nth) {
            const int32_t s = group_start_[(size_t) g], e = group_start_[(size_t) g + 1];
            const int64_t ex = group_expert_[(size_t) g];
            // no gemm in a decode-sized ubatch: an expert's rows (several in a batch of sequences or a short
            // prompt chunk) by the matrix's multi-row kernel where it has one, else gemv per row
            pairs_gemv(L.gate, ex, s, e, [&](int32_t q) { return gate_row(L, q); }, g_.data() + (size_t) s * ff, ff, 0,
                       L.n_ff);
            pairs_gemv(L.up, ex, s, e, [&](int32_t q) { return up_row(L, q); }, u_.data() + (size_t) s * ff, ff,
                       up_off, up_off + L.n_ff);
            for (int32_t q = s; q < e; ++q) {
                act_pair(L, q);
                L.down.from_float(g_.data() + (size_t) q * ff, hq_.data() + (size_t) q * L.down.act_bytes, L.n_ff);
            }
            down_pairs(L, ex, s, e, 0, L.n_embd, dst);
        }
        return;
    }
    // phase 0 (thread 0, while the others reach the first barrier): the units of this ubatch
    if (ith == 0) {
        make_units(units_gu_, L.n_ff, std::max(L.gate.align, L.up.align));
        make_units(units_down_, L.n_embd, L.down.align);
    }
    // gate and up by gemm where the activations were quantized 4 pairs at a time (phase A)
    const bool gemm_gu = !x_ready_ && nth <= kMaxGatherThreads && L.gate.gemm && L.up.gemm;
    if (!x_ready_) {
        // phase A: the activations, quantized once: per token for gemv rows, 4 pairs at a time for gemm rows
        const int n_tok = (int) T_;
        const int n_items = n_tok + n_groups;
        const bool shared = L.up.act_type == L.gate.act_type;
        for (int i = claim(0); i < n_items; i = claim(0)) {
            if (i < n_tok) {
                if (!tok_needed_[(size_t) i]) continue;
                const float * xr = (const float *) ((const char *) x + (size_t) i * x_nb1);
                quantize_token(L.gate, xq_gate_.data() + (size_t) i * L.gate.act_bytes, xr);
                if (!shared) quantize_token(L.up, xq_up_.data() + (size_t) i * L.up.act_bytes, xr);
                continue;
            }
            const int g = i - n_tok;
            const int32_t s = group_start_[(size_t) g], p = group_start_[(size_t) g + 1] - s;
            if (!gemm_gu || p < 4) continue;
            float * buf = gather_.data() + (size_t) ith * 4 * (size_t) L.n_embd;
            for (int32_t b = 0; b + 4 <= p; b += 4) {
                for (int r = 0; r < 4; ++r) {
                    const float * xr = (const float *) ((const char *) x + (size_t) pair_tok_[(size_t) (s + b + r)] * x_nb1);
                    std::memcpy(buf + (size_t) r * L.n_embd, xr, (size_t) L.n_embd * sizeof(float));
                }
                L.gate.rk.quantize_mat(buf, xq4_gate_.data() + (size_t) (s + b) * L.gate.act_bytes, 4, L.n_embd);
                if (!shared) L.up.rk.quantize_mat(buf, xq4_up_.data() + (size_t) (s + b) * L.up.act_bytes, 4, L.n_embd);
            }
        }
    }
    barrier(nth);  // the units and the activations are ready
    // phase B: gate and up, column blocks of every expert
    for (int i = claim(1); i < (int) units_gu_.size(); i = claim(1)) gate_up_unit(L, units_gu_[(size_t) i], gemm_gu);
    barrier(nth);
    // phase C: the activation and its quantization for down, one expert at a time
    for (int g = claim(2); g < n_groups; g = claim(2)) {
        const int32_t s = group_start_[(size_t) g], p = group_start_[(size_t) g + 1] - s;
        for (int32_t q = s; q < s + p; ++q) act_pair(L, q);
        int32_t done = 0;
        if (L.down.gemm && p >= 4) {
            done = p / 4 * 4;
            for (int32_t b = 0; b < done; b += 4) {
                L.down.rk.quantize_mat(g_.data() + (size_t) (s + b) * ff, hq_.data() + (size_t) (s + b) * L.down.act_bytes,
                                       4, L.n_ff);
            }
        }
        for (int32_t q = s + done; q < s + p; ++q) {
            L.down.from_float(g_.data() + (size_t) q * ff, hq_.data() + (size_t) q * L.down.act_bytes, L.n_ff);
        }
    }
    barrier(nth);
    // phase D: down, column blocks of every expert, into each pair's output row
    for (int i = claim(3); i < (int) units_down_.size(); i = claim(3)) down_unit(L, units_down_[(size_t) i], dst);
}

}  // namespace hybrimoe
