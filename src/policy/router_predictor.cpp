#include "policy/router_predictor.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

namespace hybrimoe {

RouterPredictor::RouterPredictor(int n_expert, int top_k, int n_embd, std::vector<std::vector<float>> routers,
                                 std::vector<std::vector<float>> router_bias, bool sigmoid_gating,
                                 std::vector<double> confidence, std::vector<double> expert_bytes)
    : n_expert_(n_expert), top_k_(top_k), n_embd_(n_embd), routers_(std::move(routers)),
      bias_(std::move(router_bias)), sigmoid_(sigmoid_gating), confidence_(std::move(confidence)),
      expert_bytes_(std::move(expert_bytes)) {
    if (n_expert_ < 1 || top_k_ < 1 || n_embd_ < 1) {
        throw std::invalid_argument("router predictor: n_expert, top_k and n_embd must be positive");
    }
    const size_t L = routers_.size();
    bias_.resize(L);
    if (expert_bytes_.size() < L) {
        throw std::invalid_argument("router predictor: one expert size per MoE layer is needed");
    }
    for (size_t l = 0; l < L; ++l) {
        if (!routers_[l].empty() && routers_[l].size() != (size_t) n_expert_ * n_embd_) {
            throw std::invalid_argument("router predictor: router of MoE layer " + std::to_string(l) +
                                        " must be [n_expert, n_embd]");
        }
        if (!bias_[l].empty() && bias_[l].size() != (size_t) n_expert_) {
            throw std::invalid_argument("router predictor: router bias of MoE layer " + std::to_string(l) +
                                        " must be [n_expert]");
        }
    }
    logits_.resize((size_t) n_expert_);
    order_.resize((size_t) n_expert_);
    counts_.resize((size_t) n_expert_);
}

void RouterPredictor::predict(int layer, int depth, int T, const float * x, size_t row_stride, double makespan_s,
                              double layer_s, double non_expert_s, std::vector<Prediction> & out) {
    out.clear();
    const int L = n_layers();
    const int E = n_expert_, K = std::min(top_k_, n_expert_), D = n_embd_;
    depth = std::min(depth, L - 1 - layer);
    if (T < 1 || depth < 1) return;
    const int n_sample = std::min(T, kSampleTokens);
    for (int d = 1; d <= depth; ++d) {
        const int j = layer + d;
        const auto & W = routers_[(size_t) j];
        if (W.empty()) continue;
        const auto & bias = bias_[(size_t) j];
        std::fill(counts_.begin(), counts_.end(), 0);
        for (int s = 0; s < n_sample; ++s) {
            const int t = n_sample == T ? s : (int) ((int64_t) s * T / n_sample);
            const float * xt = (const float *) ((const char *) x + (size_t) t * row_stride);
            for (int e = 0; e < E; ++e) {
                const float * w = W.data() + (size_t) e * D;
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // independent partial sums: the compiler vectorises
                int i = 0;
                for (; i + 8 <= D; i += 8) {
                    for (int u = 0; u < 8; ++u) acc[u] += w[i + u] * xt[i + u];
                }
                for (; i < D; ++i) acc[0] += w[i] * xt[i];
                float v = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
                if (sigmoid_) v = 1.0f / (1.0f + std::exp(-v));
                if (!bias.empty()) v += bias[(size_t) e];
                logits_[(size_t) e] = v;  // softmax is monotonic: ranking by logits is enough
            }
            std::iota(order_.begin(), order_.end(), 0);
            std::partial_sort(order_.begin(), order_.begin() + K, order_.end(), [&](int32_t a, int32_t b) {
                return logits_[(size_t) a] > logits_[(size_t) b] ||
                       (logits_[(size_t) a] == logits_[(size_t) b] && a < b);
            });
            for (int i = 0; i < K; ++i) counts_[(size_t) order_[(size_t) i]] += 1;
        }
        Prediction p;
        p.layer = j;
        p.distance = d;
        p.confidence = confidence_.empty() ? 1.0
                       : confidence_[(size_t) std::min<int>(d, (int) confidence_.size()) - 1];
        p.expert_bytes = expert_bytes_[(size_t) j];
        p.start_s = makespan_s + (double(d) - 1.0) * layer_s + non_expert_s;
        for (int e = 0; e < E; ++e) {
            if (counts_[(size_t) e] == 0) continue;
            p.experts.push_back(e);
            const int64_t load = ((int64_t) counts_[(size_t) e] * T + n_sample - 1) / n_sample;
            p.loads.push_back((int32_t) std::max<int64_t>(1, std::min<int64_t>(load, T)));
        }
        out.push_back(std::move(p));
    }
}

}  // namespace hybrimoe
