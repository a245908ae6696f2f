// Records each MoE layer's routing as llama.cpp computes it, through the scheduler's eval callback
// (llama_context_params.cb_eval, a ggml_backend_sched_eval_callback), as upstream's imatrix tool collects
// activations. The nodes are the ones llm_graph_context::build_moe_ffn names:
//   "ffn_moe_topk-<il>"  I32 [k, T]: the routed expert ids of each token (after any selection bias and group mask);
//   "ffn_moe_probs-<il>" F32 [E, T]: the router's scores over all experts after the gating function (softmax,
//                        sigmoid, ...) and before the selection bias; for gating "softmax_weight" the raw logits.
// It works with any placement: the scheduler hands an asked node over once computed, and ggml_backend_tensor_get
// reads it from whichever device holds it. It needs no hook and changes no result.
#pragma once

#include "ggml.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace hybrimoe {

class RoutingRecorder {
public:
    /// Rows (tokens) of one layer, in the order its ubatches ran.
    struct Layer {
        int32_t k = 0;                ///< ids per row (0: none recorded)
        int32_t n_expert = 0;         ///< scores per row (0: none recorded)
        std::vector<int32_t> ids;     ///< [rows, k]
        std::vector<float> scores;    ///< [rows, n_expert]
    };

    /// The ggml_backend_sched_eval_callback; user_data is a RoutingRecorder. Asks for the two nodes of every
    /// layer while enabled, copies them when they are computed, and always lets the computation go on.
    static bool callback(ggml_tensor * t, bool ask, void * user_data);

    /// Recording starts disabled (graph reserves and calibration runs record nothing).
    void set_enabled(bool on) { enabled_ = on; }
    bool enabled() const { return enabled_; }

    /// Layers seen so far (index = model layer; layers without MoE stay empty).
    const std::vector<Layer> & layers() const { return layers_; }
    /// Hands over everything recorded and starts empty.
    std::vector<Layer> take();
    /// The first problem met (a node of an unexpected type or shape), or "" (recording of that node skipped).
    const std::string & error() const { return error_; }

private:
    void copy(ggml_tensor * t, bool is_ids, int il);

    bool enabled_ = false;
    std::vector<Layer> layers_;
    std::string error_;
};

/// Layer index of a node named "<prefix><il>" (e.g. "ffn_moe_topk-3"), or -1.
int layer_of_node(const char * name, const char * prefix);

}  // namespace hybrimoe
