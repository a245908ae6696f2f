// hybrimoe._core: the HybriMoE policy core and trace-driven simulator (no ggml, no llama).
#include "common.h"

PYBIND11_MODULE(_core, m) {
    m.doc() = "HybriMoE policy core (cost model, expert cache, scheduler, prefetcher) and trace simulator.\n"
              "Source: Zhong et al., HybriMoE, arXiv:2504.05897; design: docs/design.md.";
    hybrimoe_bind::bind_cost_model(m);
    hybrimoe_bind::bind_scheduler(m);
    hybrimoe_bind::bind_expert_cache(m);
    hybrimoe_bind::bind_prefetcher(m);
    hybrimoe_bind::bind_simulator(m);
}
