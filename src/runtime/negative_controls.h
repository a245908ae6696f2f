// Test-only negative controls of the engine: each makes the hybrid path compute something wrong on purpose, so that
// a test comparing hybrimoe with upstream proves it would notice that mistake (results must then differ). All of
// them live here; the engine, its slot copies and the GPU share's FFN read them, nothing else sets them.
#pragma once

#include "runtime/expert_ffn.h"

#include <string>

namespace hybrimoe {

struct NegativeControls {
    /// One variant's op the GPU share leaves out (Engine::set_negative_control's names).
    enum class Variant {
        kNone,          ///< ""
        kWeightBefore,  ///< "weight_before": routing weights after the FFN instead of before it
        kGateUp,        ///< "gate_up": the fused gate_up product's halves swapped
        kActivation,    ///< "activation": SiLU in place of GELU, ReLU, SITU or SwiGLU-OAI; GELU in place of SiLU
        kScales,        ///< "scales": no per-expert scales
        kClamp,         ///< "clamp": no SwiGLU clamp
    };
    Variant variant = Variant::kNone;
    /// The GPU share's outputs are replaced by zeros.
    bool drop_gpu_share = false;
    /// Copies into the slot pool take each bias row and scale from the next expert ((expert + 1) mod n_expert);
    /// takes effect for copies made after it is set.
    bool wrong_bias_rows = false;
    /// Copies of repacked experts into the slot pool take the repacked host bytes instead of the file's (the layout
    /// the device kernels do not read); takes effect for copies made after it is set.
    bool repacked_copies = false;
    /// The fused CPU share computes silu(up) * gate instead of silu(gate) * up.
    bool fused_swap = false;

    /// Sets `variant` by name ("" for none). Throws std::invalid_argument for another name (the message lists them).
    void set_variant(const std::string & name);
    /// The GPU share's matrices and op details with `variant` applied (unchanged for kNone).
    ExpertMatrices gpu_share_matrices(ExpertMatrices m) const;
    /// The expert whose bias rows and scales a slot copy of `expert` takes (SlotPool::copy's bias_expert): -1
    /// (its own) unless wrong_bias_rows.
    int bias_expert(int expert, int n_expert) const {
        return wrong_bias_rows ? (expert + 1) % n_expert : -1;
    }
};

}  // namespace hybrimoe
