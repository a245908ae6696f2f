// Routing trace held in memory for the simulator (format on disk: hybrimoe/trace.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace hybrimoe {

/// Routed experts of every token at every MoE layer, plus the model facts the simulator needs.
struct Trace {
    int n_tokens = 0;
    int n_layers = 0;                     ///< MoE layers
    int top_k = 0;
    int n_experts = 0;
    int n_dense_layers = 0;               ///< leading dense layers (non-expert cost only)
    std::vector<int16_t> ids;             ///< [n_tokens, n_layers, top_k] expert ids; each row a set
    std::vector<int64_t> prompt_offsets;  ///< n_prompts + 1 entries, 0 .. n_tokens, non-decreasing
    std::vector<double> expert_bytes;     ///< bytes of one routed expert, per MoE layer
    std::vector<float> scores;            ///< optional [n_tokens, n_layers, n_experts] router probabilities

    int n_prompts() const { return prompt_offsets.empty() ? 0 : static_cast<int>(prompt_offsets.size()) - 1; }
    const int16_t * row(int64_t token, int layer) const {
        return ids.data() + (static_cast<size_t>(token) * n_layers + layer) * top_k;
    }
    /// Throws std::invalid_argument naming the problem: sizes that disagree, ids outside 0..n_experts-1, a repeated
    /// id within one row, offsets not starting at 0 / ending at n_tokens / decreasing, bad expert bytes.
    void validate() const;
};

}  // namespace hybrimoe
