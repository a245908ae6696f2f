#include "runtime/negative_controls.h"

#include <stdexcept>

namespace hybrimoe {

void NegativeControls::set_variant(const std::string & name) {
    static const struct {
        const char * name;
        Variant variant;
    } known[] = {{"", Variant::kNone},           {"weight_before", Variant::kWeightBefore},
                 {"gate_up", Variant::kGateUp},  {"activation", Variant::kActivation},
                 {"scales", Variant::kScales},   {"clamp", Variant::kClamp}};
    for (const auto & k : known) {
        if (name == k.name) {
            variant = k.variant;
            return;
        }
    }
    throw std::invalid_argument("engine: unknown negative control '" + name +
                                "' (weight_before, gate_up, activation, scales, clamp or '')");
}

ExpertMatrices NegativeControls::gpu_share_matrices(ExpertMatrices m) const {
    switch (variant) {
        case Variant::kNone: break;
        case Variant::kWeightBefore: m.weight_before = false; break;
        case Variant::kGateUp: m.swap_gate_up = true; break;
        case Variant::kActivation: m.act = m.act == ExpertAct::kSilu ? ExpertAct::kGelu : ExpertAct::kSilu; break;
        case Variant::kScales: m.gate_s = m.up_s = m.down_s = nullptr; break;
        case Variant::kClamp: m.clamp = 0.0f; break;
    }
    return m;
}

}  // namespace hybrimoe
