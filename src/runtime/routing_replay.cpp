#include "runtime/routing_replay.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace hybrimoe {

RoutingReplay::RoutingReplay(std::vector<int32_t> ids, int n_rows, int n_layers, int k, int n_expert)
    : ids_(std::move(ids)), n_rows_(n_rows), n_layers_(n_layers), k_(k), n_expert_(n_expert),
      calls_(new std::atomic<uint64_t>[(size_t) (n_layers > 0 ? n_layers : 1)]) {
    if (n_rows < 1 || n_layers < 1 || k < 1) {
        throw std::invalid_argument("routing table must have at least one row, layer and rank");
    }
    if (ids_.size() != (size_t) n_rows * n_layers * k) {
        throw std::invalid_argument("routing table size does not match [n_rows, n_layers, k]");
    }
    for (size_t i = 0; i < ids_.size(); ++i) {
        if (ids_[i] < 0 || ids_[i] >= n_expert) {
            throw std::invalid_argument("routing table holds expert id " + std::to_string(ids_[i]) +
                                        " outside [0, " + std::to_string(n_expert) + ")");
        }
    }
    for (int i = 0; i < n_layers; ++i) calls_[(size_t) i] = 0;
}

void RoutingReplay::set_scores(std::vector<float> scores) {
    if (scores.size() != (size_t) n_rows_ * n_layers_ * n_expert_) {
        throw std::invalid_argument("routing scores size does not match [n_rows, n_layers, n_expert]");
    }
    scores_ = std::move(scores);
    current_.assign((size_t) n_layers_, {});
}

const float * RoutingReplay::current_scores(int il, int n_tokens) const {
    if (scores_.empty() || il < 0 || il >= n_layers_) return nullptr;
    const auto & c = current_[(size_t) il];
    return c.size() == (size_t) n_tokens * n_expert_ ? c.data() : nullptr;
}

void RoutingReplay::attach(llama_context * ctx) {
    ctx_ = ctx;
    llama_set_moe_routing(ctx, &RoutingReplay::callback, this);
}

void RoutingReplay::detach() {
    if (ctx_) {
        llama_set_moe_routing(ctx_, nullptr, nullptr);
        ctx_ = nullptr;
    }
}

int64_t RoutingReplay::row_of(int64_t p, llama_seq_id s) const {
    const int64_t off = s >= 0 && (size_t) s < offsets_.size() ? offsets_[(size_t) s] : 0;
    return (((off + p) % n_rows_) + n_rows_) % n_rows_;
}

void RoutingReplay::callback(int32_t il, int32_t n_tokens, int32_t n_expert_used, int32_t n_expert,
                             const llama_token * tokens, const llama_pos * pos, const llama_seq_id * seq,
                             int32_t * out, void * user_data) {
    (void) tokens;
    auto * self = static_cast<RoutingReplay *>(user_data);
    const int layer = il >= 0 && il < self->n_layers_ ? il : 0;
    for (int32_t t = 0; t < n_tokens; ++t) {
        const int64_t p = pos ? (int64_t) pos[t] : (int64_t) t;
        const int64_t row = self->row_of(p, seq ? seq[t] : 0);
        const int32_t * src = self->ids_.data() + ((size_t) row * self->n_layers_ + layer) * self->k_;
        for (int32_t j = 0; j < n_expert_used; ++j) {
            // warmup graphs ask for every expert: fill the ranks past the table's k with distinct ids
            int32_t id = j < self->k_ ? src[j] : j;
            out[(size_t) t * n_expert_used + j] = id < n_expert ? id : id % n_expert;
        }
    }
    if (il >= 0 && il < self->n_layers_) {
        self->calls_[(size_t) il].fetch_add(1, std::memory_order_relaxed);
        if (!self->scores_.empty() && n_expert == self->n_expert_) {
            // this ubatch's rows of the scores, for the engine's plan op of this layer (which runs after every
            // input of the graph was set)
            auto & cur = self->current_[(size_t) il];
            cur.resize((size_t) n_tokens * n_expert);
            for (int32_t t = 0; t < n_tokens; ++t) {
                const int64_t p = pos ? (int64_t) pos[t] : (int64_t) t;
                const int64_t row = self->row_of(p, seq ? seq[t] : 0);
                const float * src = self->scores_.data() + ((size_t) row * self->n_layers_ + il) * n_expert;
                std::copy(src, src + n_expert, cur.begin() + (size_t) t * n_expert);
            }
        }
    }
}

} // namespace hybrimoe
