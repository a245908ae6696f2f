// The GPU expert slot pool and its copy queue (HybriMoE §IV.D's expert cache, on the device).
//
// One device buffer holds n_slots + 1 expert-sized slots in three regions (all gate matrices, then all up, then all
// down), so that a GPU graph can view each region as a 3-D [.., .., slots] tensor and index slots with
// mul_mat_id. The last slot is the "null" slot: all zeros, the target of padded pairs. Which (MoE layer, expert)
// a slot holds is decided by the policy core's ExpertCache; the pool only maps keys (layer * n_expert + expert)
// to slots, queues host-to-device copies of expert weights on a copy queue of its own (a second backend instance:
// a second stream on CUDA) and lets the compute queue wait for the copies a launch reads (one event per copy).
#pragma once

#include "ggml-backend.h"
#include "ggml.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace hybrimoe {

class SlotPool {
public:
    /// Per-slot stride of the gate, up and down regions (bytes): the largest matrix of that kind over the MoE
    /// layers, rounded up to a multiple of 16 and of every ggml block size used for that kind (kernels, CUDA's
    /// among them, index an expert as stride / block size). Throws std::invalid_argument on mismatched lengths or
    /// an unknown type.
    static std::array<int64_t, 3> region_strides(const std::vector<std::array<int64_t, 3>> & expert_bytes,
                                                 const std::vector<std::array<int32_t, 3>> & expert_types);
    /// Bytes of one slot: the sum of the region strides.
    static int64_t slot_bytes_for(const std::vector<std::array<int64_t, 3>> & expert_bytes,
                                  const std::vector<std::array<int32_t, 3>> & expert_types);

    /// Geometry only (no device): n_slots may be 0. Throws std::invalid_argument as region_strides does.
    SlotPool(int n_layers, int n_expert, const std::vector<std::array<int64_t, 3>> & expert_bytes,
             const std::vector<std::array<int32_t, 3>> & expert_types);
    ~SlotPool();
    SlotPool(const SlotPool &) = delete;
    SlotPool & operator=(const SlotPool &) = delete;

    /// Allocates n_slots + 1 slots on `device` (the null slot zeroed), two backend instances (compute, copy) and,
    /// when the device has events (ggml_backend_dev_get_props caps), one event per in-flight copy. Throws
    /// std::runtime_error naming the device (and the bytes, for the pool) when one cannot be had.
    void open(ggml_backend_dev_t device, int64_t n_slots);
    /// Waits for queued device work and frees everything on the device; afterwards n_slots() is 0.
    void release();
    bool is_open() const { return compute_ != nullptr; }

    int64_t n_slots() const { return n_slots_; }
    int64_t slot_bytes() const { return slot_bytes_; }
    int32_t null_slot() const { return (int32_t) n_slots_; }
    ggml_backend_dev_t device() const { return device_; }
    const std::string & device_name() const { return device_name_; }
    ggml_backend_t compute() const { return compute_; }
    /// The device's pinned host buffer type (staging for activations), or nullptr when it has none.
    ggml_backend_buffer_type_t host_buffer_type() const { return host_buft_; }

    /// Gives (layer, expert) a free slot unless it has one; false when none is free.
    bool assign(int layer, int expert);
    /// The cache evicted `key`: its slot is free again (no copy or launch reads it: evicted experts are unpinned).
    void evict(int64_t key);
    /// Slot of (layer, expert) or -1.
    int32_t slot_of(int layer, int expert) const;
    int32_t slot_of_key(int64_t key) const { return key_slot_[(size_t) key]; }
    /// Whether the slot of `key` holds its weights (a copy was queued).
    bool loaded(int64_t key) const { return key_loaded_[(size_t) key] != 0; }
    int slots_in_use() const;

    /// Queues the copy of expert `expert`'s gate, up and down matrices (host tensors [.., .., n_expert] in the
    /// file's layout) into the slot of (layer, expert) on the copy queue. Returns the bytes queued (0: no slot, or
    /// already loaded). Without events the copy is synchronous.
    double copy(int layer, int expert, const ggml_tensor * gate, const ggml_tensor * up, const ggml_tensor * down);
    /// Whether copies are queued (the device has events) rather than blocking until they end.
    bool async_copies() const { return !events_.empty(); }
    /// Sequence number of the last copy of `key` (0: none).
    uint64_t copy_seq(int64_t key) const { return key_copy_seq_[(size_t) key]; }
    /// Makes the compute queue wait until the copy with sequence number `seq` ended (0: nothing to wait for).
    void wait_for_copy(uint64_t seq);
    /// Whether every copy queued so far has been waited for by the compute queue (wait_for_copy of the last one):
    /// once the compute queue is synchronised, the copy queue is then empty.
    bool all_copies_waited() const { return events_.empty() || waited_seq_ >= copy_seq_; }

    /// A view of region `which` (0 gate, 1 up, 2 down) as a [like->ne[0], like->ne[1], n_slots + 1] tensor of
    /// like's type, in `ctx` (no_alloc), pointing into the pool.
    ggml_tensor * region_view(ggml_context * ctx, const ggml_tensor * like, int which) const;

private:
    int n_layers_, n_expert_;
    std::array<int64_t, 3> strides_{};   // gate, up, down: bytes per slot in that region
    std::array<int64_t, 3> bases_{};     // gate, up, down: offset of the region in the pool
    int64_t slot_bytes_ = 0;
    int64_t n_slots_ = 0;
    ggml_backend_dev_t device_ = nullptr;
    std::string device_name_;
    ggml_backend_t compute_ = nullptr;
    ggml_backend_t copy_ = nullptr;
    ggml_backend_buffer_type_t host_buft_ = nullptr;
    // one event recorded after each copy, in a ring: a reused event marks a later point of the same in-order copy
    // queue, so waiting on it still covers the earlier copy
    static constexpr int kEvents = 64;
    std::vector<ggml_backend_event_t> events_;
    uint64_t copy_seq_ = 0;
    uint64_t waited_seq_ = 0;  // the latest copy the compute queue was made to wait for
    ggml_context * ctx_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr;
    ggml_tensor * pool_ = nullptr;
    std::vector<int32_t> slot_key_;      // slot -> key or -1
    std::vector<int32_t> key_slot_;      // key -> slot or -1
    std::vector<uint8_t> key_loaded_;    // key's slot holds its weights (copy queued)
    std::vector<uint64_t> key_copy_seq_; // key -> sequence number of its last copy
    std::vector<int32_t> free_slots_;
};

}  // namespace hybrimoe
