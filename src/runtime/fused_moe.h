// The fused CPU share: one ggml op computes a MoE layer's CPU experts, with upstream's own kernels.
//
// Upstream's graph (build_moe_ffn) runs a layer's routed experts as separate ops: mul_mat_id for up and for gate
// (each quantizing the activations again and grouping the rows by expert again), the GLU, mul_mat_id for down,
// each followed by a synchronisation of ggml's threads. The fused op runs them as phases of one op: the
// activations quantized once per layer (in the plan op for a decode-sized ubatch), gate and up in one pass over
// them, the activation and down; its threads synchronise between phases only (three times at most), and not at all
// in decode when the layer's CPU experts divide evenly over the threads (each takes whole experts).
//
// Its numbers are upstream's bit for bit: each output element comes from the kernel upstream's mul_mat_id gives it
// (ggml_compute_forward_mul_mat_id: the type's vec_dot over the row and the activation row quantized by the
// vec_dot type's from_float; repack.cpp's forward_mul_mat_id on a repacked matrix: the layout's gemv), the SwiGLU is
// ggml's (ggml_vec_swiglu_f32), and which thread computes which rows does not change a row's arithmetic. Two kernels
// upstream's mul_mat_id does not run are used where they give the same numbers: a repacked layout's gemm for an
// expert with 4 or more rows (used only when it matched the layout's gemv on this CPU, checked once per kernel:
// Q4_0, IQ4_NL and MXFP4 on x86 AVX2 match; Q4_K's gemm rounds differently), and, for plain Q5_0 and Q8_0 matrices
// (the fallbacks of K-quant mixes for rows not a multiple of 256), plain Q4_K and Q6_K (below 8 rows: see below) and
// repacked Q4_K, patch 0011's multi-row kernels: the type's vec_dot (8 rows of an expert per pass for Q5_0 and Q8_0,
// 4 for the K-quants) or the layout's gemv (4 per pass) for several rows at once, each weight block unpacked once
// for all of them, each row's arithmetic the single-row kernel's. The repacked kernels, the
// multi-row dot products and the SwiGLU come from hybrimoe's ggml-cpu (patches 0009 and 0011's table).
//
// What it does not compute (FusedCpuShare::unsupported says which; the layer keeps upstream's ops then): activations
// other than SiLU-gated ones (SwiGLU), expert biases or scales, the SwiGLU clamp, routing weights before the FFN,
// and, in ubatches of 8 tokens or more, plain K-quant matrices, for which upstream's mul_mat_id takes its tiled
// kernel (ggml-cpu/tiled, from 8 rows of an expert) with other arithmetic.
#pragma once

#include "ggml-cpu.h"
#include "ggml.h"
#include "runtime/expert_ffn.h"

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace hybrimoe {

/// Mirror of patches 0009 and 0011's `struct ggml_cpu_repack_kernels`: a repacked layout's kernels.
struct CpuRepackKernels {
    void (*gemv)(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) = nullptr;
    void (*gemm)(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc) = nullptr;
    void (*quantize_mat)(const float * x, void * vy, int64_t nrow, int64_t n_per_row) = nullptr;
    ggml_type act_type = GGML_TYPE_COUNT;
    int64_t n_cols = 0;
    /// patch 0011 (table version 2): gemv for nr activation rows vy[r] at once, row r's outputs at s + r * bs
    void (*gemv_rows)(int n, float * s, size_t bs, const void * vx, const void * const * vy, int nr, int nc) = nullptr;
};

/// Patch 0011's multi-row dot product: s[r * bs] = the type's vec_dot of weight row vx with activation row vy[r],
/// r < nr, bit for bit, the weight row read once.
using VecDotRows = void (*)(int n, float * s, size_t bs, const void * vx, const void * const * vy, int nr);

/// Mirror of patches 0009 and 0011's `struct ggml_cpu_moe_kernels` (version 1; version 2 adds vec_dot_rows_of).
struct CpuMoeKernels {
    int version = 0;
    bool (*repack_kernels_of)(const ggml_tensor * w, CpuRepackKernels * k) = nullptr;
    void (*swiglu)(int n, float * y, const float * x, const float * g) = nullptr;
    VecDotRows (*vec_dot_rows_of)(ggml_type type) = nullptr;  ///< read only when version >= 2
};

/// ggml-cpu's kernel table in this process (the "CPU" registry's proc address "ggml_backend_cpu_moe_kernels"), or
/// nullptr when the CPU backend has none (not hybrimoe's ggml-cpu).
const CpuMoeKernels * cpu_moe_kernels();

/// How one expert matrix ([n_in, n_out, n_expert], ggml order) is computed: upstream's kernel for it.
struct MatrixKernel {
    const ggml_tensor * w = nullptr;
    int64_t n_in = 0, n_out = 0;
    size_t nb1 = 0, nb2 = 0;            ///< bytes per row (output column) and per expert
    bool repacked = false;
    bool gemm = false;                  ///< repacked and its gemm gives its gemv's numbers here
    ggml_type act_type = GGML_TYPE_COUNT;  ///< the activations' quantized type
    size_t act_bytes = 0;               ///< bytes of one quantized activation row
    int64_t align = 1;                  ///< output columns come in groups of this many (a repacked interleave)
    ggml_vec_dot_t vec_dot = nullptr;   ///< plain: the type's dot product
    VecDotRows vec_dot_rows = nullptr;  ///< plain: the same for several activation rows at once (patch 0011), or none
    ggml_from_float_t from_float = nullptr;
    CpuRepackKernels rk;

    /// out[c - c0] for output columns [c0, c1) of expert e, one activation row `act` (act_type, act_bytes).
    void gemv(int64_t e, const void * act, float * out, int64_t c0, int64_t c1) const;
    /// The same for `nr` (a multiple of 4) activation rows quantized 4 by 4 (rk.quantize_mat) at `act`; row r's
    /// columns go to out + r * ld (floats).
    void gemm4(int64_t e, const void * act, int nr, float * out, size_t ld, int64_t c0, int64_t c1) const;
    /// Whether gemv_rows can run: a plain matrix with vec_dot_rows, or a repacked one whose layout has rk.gemv_rows.
    bool multi_row() const { return repacked ? rk.gemv_rows != nullptr : vec_dot_rows != nullptr; }
    /// With multi_row(): output columns [c0, c1) of expert e for the `nr` activation rows acts[r] (act_type), row
    /// r's into out + r * ld (floats), each weight block unpacked once for all of them; the numbers are gemv's.
    void gemv_rows(int64_t e, const void * const * acts, int nr, float * out, size_t ld, int64_t c0, int64_t c1) const;
};

/// The fused CPU share of one engine (one layer at a time runs it: its scratch is shared by every layer).
class FusedCpuShare {
public:
    /// `any_gemm`: take a repacked layout's gemm for experts of 4 rows or more even where it rounds differently from
    /// the layout's gemv (upstream's mul_mat_id kernel): faster prefill, numbers no longer upstream's bit for bit
    /// (Q4_K on x86 AVX2).
    explicit FusedCpuShare(bool any_gemm = false) : any_gemm_(any_gemm) {}

    /// Why `m` cannot run fused at ubatches of `T` tokens (nullptr: it can); `k` is the layer's top-k.
    static const char * unsupported(const ExpertMatrices & m, int64_t T);

    /// Negative control for tests: silu(up) * gate instead of silu(gate) * up (NegativeControls::fused_swap).
    void set_swap(bool on) { swap_ = on; }

    /// Sets up layer `ml` for ubatches of up to `T` tokens and top-k `k` (graph build time; grows the scratch).
    /// Throws std::runtime_error when ggml-cpu has no kernel table (not hybrimoe's ggml-cpu).
    void prepare(int ml, const ExpertMatrices & m, int64_t n_embd, int64_t k, int64_t T);
    bool prepared(int ml) const { return ml >= 0 && ml < (int) layers_.size() && layers_[(size_t) ml].ready; }

    /// The plan op's part (one thread, before the fused op runs): groups layer ml's CPU pairs by expert from
    /// `ids` ([k, T] int32 rows of nb1 bytes; -1: not a CPU pair), quantizes a small ubatch's activation rows from
    /// `x` (F32 [n_embd, T], rows of x_nb1 bytes) and resets the op's counters.
    void plan(int ml, const int32_t * ids, size_t ids_nb1, int64_t k, int64_t T, const float * x, size_t x_nb1);

    /// The op: thread ith of nth. dst: F32 [n_embd, k, T], a CPU pair's output row written (the others left);
    /// x: F32 [n_embd, T] rows of x_nb1 bytes.
    void run(int ml, ggml_tensor * dst, const float * x, size_t x_nb1, int ith, int nth);

private:
    struct Layer {
        bool ready = false;
        bool fused_gate_up = false;     ///< one gate_up matrix: gate rows [0, n_ff), up rows [n_ff, 2 n_ff)
        MatrixKernel gate, up, down;
        int64_t n_ff = 0, n_embd = 0;
    };
    /// Units of work of a phase: (expert group, column block).
    struct Unit {
        int32_t group;
        int32_t c0, c1;
    };

    void barrier(int nth);
    /// Next unit index of phase p (claimed by one thread), or past the end.
    int claim(int p) { return next_[(size_t) p].fetch_add(1, std::memory_order_relaxed); }
    void make_units(std::vector<Unit> & units, int64_t n_out, int64_t align);
    void quantize_token(const MatrixKernel & mk, uint8_t * dst, const float * x) const;
    /// Pair q's quantized activation row for gate, for up (the gate's when they share the type) and for down.
    const uint8_t * gate_row(const Layer & L, int32_t q) const;
    const uint8_t * up_row(const Layer & L, int32_t q) const;
    const uint8_t * down_row(const Layer & L, int32_t q) const;
    void gate_up_unit(const Layer & L, const Unit & u, bool gemm);
    void act_pair(const Layer & L, int64_t pos);
    void down_unit(const Layer & L, const Unit & u, ggml_tensor * dst);
    /// Pair q's output row in dst (F32 [n_embd, k, T]).
    float * out_row(ggml_tensor * dst, int32_t q) const;
    /// Columns [c0, c1) of pairs [q0, q1)'s down outputs, from their scratch rows in d_ to their rows in dst.
    void scatter(ggml_tensor * dst, const Layer & L, int32_t q0, int32_t q1, int64_t c0, int64_t c1) const;
    /// Down's columns [c0, c1) for expert e's pairs [q0, q1) into dst: by the multi-row kernel (through d_) or by
    /// gemv per pair.
    void down_pairs(const Layer & L, int64_t e, int32_t q0, int32_t q1, int64_t c0, int64_t c1, ggml_tensor * dst);

    const CpuMoeKernels * kern_ = nullptr;
    bool any_gemm_ = false;
    bool swap_ = false;
    std::vector<Layer> layers_;

    // the plan's grouping: CPU pairs ordered by expert; group g covers pairs [group_start[g], group_start[g + 1])
    std::vector<int32_t> pair_tok_, pair_rank_, group_expert_, group_start_;
    std::vector<uint8_t> tok_needed_;
    std::vector<int32_t> count_, next_pos_;     // plan(): pairs per expert, next position of each expert's pairs
    int64_t T_ = 0, k_ = 0;
    bool x_ready_ = false;              ///< the plan op quantized the activations already

    // scratch (shared by the layers: one runs at a time), sized by prepare()
    std::vector<uint8_t> xq_gate_, xq_up_;      ///< [T] token rows quantized for gate and for up
    std::vector<uint8_t> xq4_gate_, xq4_up_;    ///< [pairs] rows quantized 4 by 4 per group (gemm)
    std::vector<float> g_, u_;                  ///< [pairs, n_ff] gate and up outputs (then the activation in g_)
    std::vector<uint8_t> hq_;                   ///< [pairs] activation rows quantized for down (gemv or gemm)
    std::vector<float> d_;                      ///< [pairs, n_embd] down outputs of gemm groups
    std::vector<float> gather_;                 ///< [threads][4, n_embd] token rows gathered for quantize_mat

    std::vector<Unit> units_gu_, units_down_;
    std::array<std::atomic<int>, 4> next_{};
    std::atomic<int> arrived_{0};
    std::atomic<int> generation_{0};
};

}  // namespace hybrimoe
