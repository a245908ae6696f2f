#include "policy/trace.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace hybrimoe {

void Trace::validate() const {
    if (n_tokens < 0 || n_layers < 1 || top_k < 1 || n_experts < 1 || top_k > n_experts || n_dense_layers < 0) {
        throw std::invalid_argument("Trace: need n_tokens >= 0, n_layers >= 1, 1 <= top_k <= n_experts, got "
                                    "n_tokens=" + std::to_string(n_tokens) + " n_layers=" + std::to_string(n_layers) +
                                    " top_k=" + std::to_string(top_k) + " n_experts=" + std::to_string(n_experts));
    }
    const size_t want = static_cast<size_t>(n_tokens) * n_layers * top_k;
    if (ids.size() != want) {
        throw std::invalid_argument("Trace: expert ids hold " + std::to_string(ids.size()) + " values, expected " +
                                    "n_tokens*n_layers*top_k = " + std::to_string(want));
    }
    for (size_t r = 0; r < ids.size(); r += top_k) {
        for (int j = 0; j < top_k; ++j) {
            const int e = ids[r + j];
            if (e < 0 || e >= n_experts) {
                throw std::invalid_argument("Trace: expert id " + std::to_string(e) + " at token " +
                                            std::to_string(r / top_k / n_layers) + ", MoE layer " +
                                            std::to_string(r / top_k % n_layers) + " is outside 0.." +
                                            std::to_string(n_experts - 1));
            }
            for (int i = 0; i < j; ++i) {
                if (ids[r + i] == e) {
                    throw std::invalid_argument("Trace: expert " + std::to_string(e) + " repeated at token " +
                                                std::to_string(r / top_k / n_layers));
                }
            }
        }
    }
    if (prompt_offsets.size() < 2 || prompt_offsets.front() != 0 || prompt_offsets.back() != n_tokens) {
        throw std::invalid_argument("Trace: prompt_offsets must start at 0 and end at n_tokens (" +
                                    std::to_string(n_tokens) + ")");
    }
    for (size_t i = 1; i < prompt_offsets.size(); ++i) {
        if (prompt_offsets[i] < prompt_offsets[i - 1]) {
            throw std::invalid_argument("Trace: prompt_offsets decrease at index " + std::to_string(i));
        }
    }
    if (expert_bytes.size() != static_cast<size_t>(n_layers)) {
        throw std::invalid_argument("Trace: expert_bytes needs one value per MoE layer (" + std::to_string(n_layers) +
                                    "), got " + std::to_string(expert_bytes.size()));
    }
    for (double b : expert_bytes) {
        if (!std::isfinite(b) || b <= 0.0) {
            throw std::invalid_argument("Trace: expert_bytes must be finite and > 0");
        }
    }
    if (!scores.empty() && scores.size() != static_cast<size_t>(n_tokens) * n_layers * n_experts) {
        throw std::invalid_argument("Trace: scores must be empty or [n_tokens, n_layers, n_experts]");
    }
}

}  // namespace hybrimoe
