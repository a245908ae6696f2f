// Routing replay through llama_set_moe_routing (vendor/llama.cpp/patches/0002): every MoE layer's routed expert
// ids come from a recorded table instead of the router (tests and traces compare upstream and hybrimoe on the same
// routing).
#pragma once

#include "llama.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace hybrimoe {

/// Replays recorded routing through llama_set_moe_routing (patch 0002): the token at position p of sequence s
/// gets row ((offset(s) + p) mod n_rows) of the table in every MoE layer; every offset is 0 unless set (each
/// sequence of a batch may then replay a routing of its own, e.g. another prompt of a trace).
class RoutingReplay {
public:
    /// ids: [n_rows, n_layers, k] int32, row-major; layer index = model layer (dense layers' rows unused).
    /// Throws std::invalid_argument on an empty table or ids outside [0, n_expert).
    RoutingReplay(std::vector<int32_t> ids, int n_rows, int n_layers, int k, int n_expert);

    /// Router scores of the replayed rows: [n_rows, n_layers, n_expert] float, row-major (the trace's own, so
    /// that score-based cache policies rank as on the model's own routing). Throws std::invalid_argument on a
    /// size that does not match.
    void set_scores(std::vector<float> scores);
    /// The scores of the rows the last ubatch replayed in model layer il, [n_tokens, n_expert] row-major, or
    /// nullptr (no scores, or that layer's last ubatch had another row count).
    const float * current_scores(int il, int n_tokens) const;

    /// offsets[s]: the row sequence s starts at; sequences past the list start at row 0. Set between decodes.
    void set_sequence_offsets(std::vector<int64_t> offsets) { offsets_ = std::move(offsets); }
    const std::vector<int64_t> & sequence_offsets() const { return offsets_; }

    void attach(llama_context * ctx);
    void detach();

    static void callback(int32_t il, int32_t n_tokens, int32_t n_expert_used, int32_t n_expert,
                         const llama_token * tokens, const llama_pos * pos, const llama_seq_id * seq, int32_t * ids,
                         void * user_data);

    /// ubatches replayed so far per layer
    uint64_t calls(int il) const { return il >= 0 && il < n_layers_ ? calls_[(size_t) il].load() : 0; }

private:
    /// the table row of the token at position p of sequence s
    int64_t row_of(int64_t p, llama_seq_id s) const;

    std::vector<int32_t> ids_;
    std::vector<int64_t> offsets_;               // per sequence: its first row (none: 0)
    std::vector<float> scores_;                  // [n_rows, n_layers, n_expert] or empty
    std::vector<std::vector<float>> current_;    // per layer: the last ubatch's rows of scores_
    int n_rows_, n_layers_, k_, n_expert_;
    std::unique_ptr<std::atomic<uint64_t>[]> calls_;
    llama_context * ctx_ = nullptr;
};

} // namespace hybrimoe
