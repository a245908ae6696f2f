// The GPU share of a MoE layer: the (token, rank) pairs assigned to the GPU, computed over the slot pool.
//
// A launch gets a compacted pair list (each pair: a staged hidden-state row, a slot, a routing weight) and runs a
// fixed-shape ggml graph on the pool's compute queue: get_rows of the staged rows, then build_expert_ffn over the
// slot pool with slot ids (matrices and, for models with expert biases or scales, the pool's per-slot bias rows and
// scales), weighted (before the FFN for Llama 4, as upstream). Shapes are bucketed by pair count (powers of two: at most 2x padding; padded
// pairs read row 0 through the all-zero null slot with weight 0), so graphs are reused. All of a launch's inputs
// travel in one host-to-device transfer (one packed buffer) and its outputs in one device-to-host transfer. A launch
// reads the slots of one slot buffer (SlotPool: a pool larger than the device's max buffer size has several), so a
// layer's GPU pairs make one launch per slot buffer they use.
#pragma once

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "runtime/expert_ffn.h"
#include "runtime/slot_pool.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace hybrimoe {

class GpuShare {
public:
    /// Graphs run on pool.compute(); `pool` must outlive this object.
    GpuShare(SlotPool & pool, int n_embd);
    ~GpuShare();
    GpuShare(const GpuShare &) = delete;
    GpuShare & operator=(const GpuShare &) = delete;

    /// Smallest bucket (a power of two) holding n pairs.
    static int64_t bucket(int64_t n_pairs);

    /// One launch being filled, then run.
    struct Launch;
    /// A launch of at most `max_pairs` pairs over at most as many staged rows, for experts that look like `like`
    /// (the matrices' types and shapes, which biases exist and their lengths, the activation; the weights
    /// themselves come from slot buffer `buffer` of the pool). Launch index 0 or 1 (a layer's launches must not
    /// share buffers: each (index, buffer) has its own). Throws std::runtime_error when the device cannot allocate
    /// the graph's buffers, std::logic_error when `like` has a bias the pool has no region for.
    Launch & prepare(const ExpertMatrices & like, int64_t max_pairs, int index, int buffer);
    /// Stages one hidden-state row (n_embd floats) and returns its row number in the launch.
    int32_t add_row(Launch & l, const float * x);
    /// Stages one pair: hidden-state row `row` (from add_row) through `slot` (local to the launch's slot buffer:
    /// SlotPool::local_slot), weighted by `weight`.
    void add_pair(Launch & l, int32_t row, int32_t slot, float weight);
    /// Uploads the launch's inputs (one transfer) and queues its graph; returns the bytes uploaded. Throws
    /// std::runtime_error when the device refuses the graph.
    size_t run(Launch & l);
    /// Queues the read of the launch's weighted outputs, one row of n_embd floats per pair in the order added, into
    /// `dst` (one transfer); the rows are there after the compute queue is synchronised. Returns the bytes read.
    size_t read(Launch & l, float * dst);
    int64_t pairs(const Launch & l) const;
    /// Frees every graph (none may be running).
    void clear();
    size_t n_graphs() const { return graphs_.size(); }

private:
    SlotPool & pool_;
    int n_embd_;
    /// A key of everything in `m` that shapes the graph (types, shapes, biases, scales, activation, ...).
    static std::string signature(const ExpertMatrices & m);
    // (signature, pair bucket, launch index, slot buffer)
    std::map<std::tuple<std::string, int64_t, int, int>, std::unique_ptr<Launch>> graphs_;
};

struct GpuShare::Launch {
    int64_t cap = 0;                // pair bucket
    int buffer = 0;                 // the slot buffer it reads
    ggml_context * ctx = nullptr;   // graph and input headers (no_alloc)
    ggml_context * in_ctx = nullptr;
    ggml_backend_buffer_t in_buf = nullptr;  // the packed inputs: ids | rows | weights | hidden rows
    ggml_tensor * packed = nullptr;
    ggml_cgraph * gf = nullptr;
    ggml_gallocr_t galloc = nullptr;
    ggml_tensor * out = nullptr;    // F32 [n_embd, 1, cap]
    size_t off_rows = 0, off_w = 0, off_x = 0;  // byte offsets of the regions in `packed`
    ggml_backend_buffer_t host_buf = nullptr;   // pinned staging, when the device has a host buffer type
    std::vector<uint8_t> host_vec;              // pageable staging otherwise
    uint8_t * stage = nullptr;
    int64_t n_pairs = 0, n_rows = 0;
    ~Launch();
};

}  // namespace hybrimoe
