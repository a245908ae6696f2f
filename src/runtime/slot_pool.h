// The GPU expert slot pool and its copy queue (HybriMoE §IV.D's expert cache, on the device).
//
// The slots live in one or more device buffers ("slot buffers"): a device caps the bytes of one buffer
// (ggml_backend_buft_get_max_size: Vulkan's suballocation block, at most maxMemoryAllocationSize), so a pool larger
// than that is split. Each slot buffer holds its share of the slots plus one in nine regions (all gate matrices
// (or fused gate_up ones), then all up, then all down, then the gate (gate_up), up and down biases, then the gate,
// up and down per-expert scales of models that have them: empty regions otherwise), so that a GPU graph can view
// each matrix region as a 3-D [.., .., slots] tensor and index slots with mul_mat_id, each bias region as a 2-D
// [n_out, slots] tensor indexed with ggml_add_id and each scale region as a contiguous F32 [slots] tensor gathered
// with ggml_get_rows (biases and scales are indexed by expert id upstream, by slot here); a launch reads one slot
// buffer. Each buffer's last slot is its "null" slot: all zeros, the
// target of padded pairs. Slot numbers are global: slot s lies in buffer s / slots_per_buffer(). Which (MoE layer, expert)
// a slot holds is decided by the policy core's ExpertCache; the pool only maps keys (layer * n_expert + expert)
// to slots, queues host-to-device copies of expert weights on a copy queue of its own (a second backend instance:
// a second stream on CUDA) and lets the compute queue wait for the copies a launch reads (one event per copy).
#pragma once

#include "ggml-backend.h"
#include "ggml.h"
#include "runtime/expert_ffn.h"

#include <algorithm>
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
    /// With `direct_align` > 0 (a pool of host slots that O_DIRECT reads land in: the RAM tier's), the stride of a
    /// matrix kind that some layer stores in whole `direct_align` blocks (those can be read in place) is instead the
    /// largest matrix plus `direct_align`, rounded up to a multiple of it: an aligned read of a matrix that starts
    /// up to direct_align - 1 bytes into its slot (its file offset's phase) fits, and every slot starts aligned.
    /// Such strides need not be whole blocks: only ggml-cpu's kernels, which index an expert by bytes, read those
    /// slots. Other kinds keep their usual stride (their reads go through staging).
    static std::array<int64_t, 3> region_strides(const std::vector<std::array<int64_t, 3>> & expert_bytes,
                                                 const std::vector<std::array<int32_t, 3>> & expert_types,
                                                 int64_t direct_align = 0);
    /// Bytes of one slot: the sum of the region strides.
    /// Per-slot stride of the gate, up and down bias regions (bytes): the largest F32 bias row of that kind over
    /// the MoE layers (bias_bytes: per MoE layer, bytes of one expert's gate, up and down bias rows, 0 where the
    /// layer has none; empty: no layer has biases), rounded up to a multiple of 16; 0 for a kind no layer has.
    /// Throws std::invalid_argument on a negative size, one not a whole number of floats, or (when not empty) a
    /// length other than expert_layers.
    static std::array<int64_t, 3> bias_strides(const std::vector<std::array<int64_t, 3>> & bias_bytes,
                                               size_t expert_layers);
    /// Per-slot stride of the gate, up and down scale regions (bytes): 4 (one F32) for a kind some MoE layer
    /// scales (scale_bytes: per MoE layer, 4 or 0 per kind; empty: no layer has scales), else 0; a scale region is
    /// one contiguous F32 array over the slots. Throws std::invalid_argument on a size other than 0 or 4, or (when
    /// not empty) a length other than expert_layers.
    static std::array<int64_t, 3> scale_strides(const std::vector<std::array<int64_t, 3>> & scale_bytes,
                                                size_t expert_layers);
    /// Bytes of one slot: the sum of the matrix, bias and scale region strides.
    static int64_t slot_bytes_for(const std::vector<std::array<int64_t, 3>> & expert_bytes,
                                  const std::vector<std::array<int32_t, 3>> & expert_types,
                                  const std::vector<std::array<int64_t, 3>> & bias_bytes = {},
                                  const std::vector<std::array<int64_t, 3>> & scale_bytes = {},
                                  int64_t direct_align = 0);

    /// Geometry only (no device): n_slots may be 0. Throws std::invalid_argument as region_strides,
    /// bias_strides and scale_strides do. `direct_align` > 0: matrix strides as region_strides gives them, every
    /// region of a slot buffer starting on a multiple of it, and open_host's own memory (for the CPU buffer type)
    /// aligned to 2 MiB and advised for transparent huge pages.
    SlotPool(int n_layers, int n_expert, const std::vector<std::array<int64_t, 3>> & expert_bytes,
             const std::vector<std::array<int32_t, 3>> & expert_types,
             const std::vector<std::array<int64_t, 3>> & bias_bytes = {},
             const std::vector<std::array<int64_t, 3>> & scale_bytes = {}, int64_t direct_align = 0);
    ~SlotPool();
    SlotPool(const SlotPool &) = delete;
    SlotPool & operator=(const SlotPool &) = delete;

    /// Slots per slot buffer for a pool of n_slots when one buffer may hold at most `max_buffer_bytes` (<= 0: no
    /// cap); each buffer adds a null slot and pads each of its nine regions to 256 bytes. At most n_slots. Throws
    /// std::runtime_error when not even one slot and its null slot fit.
    int64_t slots_per_buffer_for(int64_t n_slots, int64_t max_buffer_bytes) const;
    /// Slot buffers open_host(buft, n_slots, max_buffer_bytes) would allocate: the buffer type's cap (SIZE_MAX: none)
    /// and max_buffer_bytes (> 0), the lower of the two.
    int64_t host_buffers_for(ggml_backend_buffer_type_t buft, int64_t n_slots, int64_t max_buffer_bytes) const;
    /// Bytes of a slot buffer of n slots (plus its null slot).
    int64_t buffer_bytes_for(int64_t n) const { return region_base(kRegions, n); }

    /// Allocates n_slots slots on `device` in as few slot buffers as its buffer type's max size allows (and at most
    /// `max_buffer_bytes` each when > 0), each buffer's null slot zeroed, two backend instances (compute, copy) and,
    /// when the device has events (ggml_backend_dev_get_props caps), one event per in-flight copy. Throws
    /// std::runtime_error naming the device (and the bytes, for the pool) when one cannot be had.
    void open(ggml_backend_dev_t device, int64_t n_slots, int64_t max_buffer_bytes = 0);
    /// Allocates n_slots slots in host memory of buffer type `buft` (the CPU's, or a device's pinned host type),
    /// in as few buffers as its max size allows, each buffer's null slot zeroed; no backends and no copy queue
    /// (the RAM tier writes the slots itself through slot_data). Throws std::invalid_argument when `buft` is not
    /// a host buffer type or n_slots < 1, std::runtime_error when the memory cannot be had (the bytes named).
    /// `max_buffer_bytes` > 0 caps one buffer lower than the buffer type does.
    void open_host(ggml_backend_buffer_type_t buft, int64_t n_slots, int64_t max_buffer_bytes = 0);
    /// Host address of region `which` (as strides()) of global slot s: a host pool (open_host) only.
    uint8_t * slot_data(int32_t s, int which) const;
    /// Whether every slot of this open host pool starts on a multiple of the pool's `direct_align` (O_DIRECT reads
    /// may land in the slots); false for a pool without one.
    bool direct_aligned() const { return direct_ok_; }
    /// Waits for queued device work and frees everything on the device; afterwards n_slots() is 0.
    void release();
    bool is_open() const { return compute_ != nullptr || host_; }
    /// Whether the slots lie in host memory (open_host).
    bool is_host() const { return host_; }

    int64_t n_slots() const { return n_slots_; }
    int64_t slot_bytes() const { return slot_bytes_; }
    /// Number of slot buffers (0 when closed) and slots per buffer (the last may hold fewer).
    int n_buffers() const { return (int) bufs_.size(); }
    int64_t slots_per_buffer() const { return per_buf_; }
    /// Slot buffer of global slot s, and s's index within it.
    int buffer_of(int32_t s) const { return (int) (s / per_buf_); }
    int32_t local_slot(int32_t s) const { return (int32_t) (s % per_buf_); }
    /// Slots of buffer b; its null slot's local index is the same number.
    int64_t buffer_slots(int b) const { return std::min(per_buf_, n_slots_ - (int64_t) b * per_buf_); }
    int32_t null_slot(int b) const { return (int32_t) buffer_slots(b); }
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

    /// Queues the copy of expert `expert`'s matrices (m.slot_matrices(): host tensors [.., .., n_expert] in the
    /// file's layout), bias rows (m.slot_biases(): host F32 [n_out, n_expert]) and scales (m.slot_scales(): host F32
    /// [n_expert]), those that exist, into the slot of (layer, expert) on the copy queue. Returns the bytes queued
    /// (0: no slot, or already loaded). Without events the copy is synchronous. Throws std::invalid_argument when a
    /// part is larger than its region's stride (the pool was sized without it). `bias_expert` >= 0 takes the bias
    /// rows and scales of that expert instead (a negative control for tests: wrong numbers on purpose).
    /// `matrices`, when given, are host addresses of the gate (gate_up), up and down matrices to copy instead of
    /// m's expert `expert` (the RAM tier's slot of that expert: the same bytes, read from the file); they must stay
    /// unchanged until the copy ended (copy_seq, copies_done).
    double copy(int layer, int expert, const ExpertMatrices & m, int bias_expert = -1,
                const std::array<const uint8_t *, 3> * matrices = nullptr);
    /// Whether copies are queued (the device has events) rather than blocking until they end.
    bool async_copies() const { return !events_.empty(); }
    /// Reads (layer, expert)'s matrices (regions 0-2, `bytes` each; 0: none) from its slot into dst (exclusive
    /// tiers: an evicted GPU expert copied back to RAM), after the copies queued so far ended. Returns the bytes
    /// read; 0 when the key has no slot or its weights were never copied there.
    double copy_out(int layer, int expert, const std::array<int64_t, 3> & bytes,
                    const std::array<uint8_t *, 3> & dst);
    /// Sequence number of the last copy of `key` (0: none).
    uint64_t copy_seq(int64_t key) const { return key_copy_seq_[(size_t) key]; }
    /// Makes the compute queue wait until the copy with sequence number `seq` ended (0: nothing to wait for).
    void wait_for_copy(uint64_t seq);
    /// Whether every copy queued so far has been waited for by the compute queue (wait_for_copy of the last one):
    /// once the compute queue is synchronised, the copy queue is then empty.
    bool all_copies_waited() const { return events_.empty() || waited_seq_ >= copy_seq_; }
    /// The latest copy the compute queue was made to wait for: once the compute queue is synchronised, every copy
    /// up to it has ended (the copy queue runs in order).
    uint64_t waited_seq() const { return waited_seq_; }
    /// Blocks until every queued copy ended; returns the last copy's sequence number (all up to it have ended).
    uint64_t sync_copies();

    /// A view of region `which` (0 gate, 1 up, 2 down) of slot buffer `b` as a [like->ne[0], like->ne[1],
    /// buffer_slots(b) + 1] tensor of like's type, in `ctx` (no_alloc), pointing into the pool: mul_mat_id indexes
    /// it with local slot numbers.
    /// `offset`: bytes into each slot where the matrix starts (the RAM tier's per-layer phase of direct reads);
    /// like's per-expert bytes plus it must fit the stride (else std::logic_error).
    ggml_tensor * region_view(ggml_context * ctx, const ggml_tensor * like, int which, int b,
                              int64_t offset = 0) const;
    /// A view of bias region `which` (0 gate, 1 up, 2 down biases) of slot buffer `b` as an F32 [like->ne[0],
    /// buffer_slots(b) + 1] tensor in `ctx` (no_alloc): ggml_add_id indexes it with local slot numbers (the null
    /// slot's row is zeros). Throws std::logic_error when the pool has no such region or `like` does not fit it.
    ggml_tensor * bias_view(ggml_context * ctx, const ggml_tensor * like, int which, int b) const;
    /// A view of scale region `which` (0 gate, 1 up, 2 down scales) of slot buffer `b` as a contiguous F32
    /// [buffer_slots(b) + 1] tensor in `ctx` (no_alloc): one scale per local slot (the null slot's is 0). Throws
    /// std::logic_error when the pool has no such region.
    ggml_tensor * scale_view(ggml_context * ctx, int which, int b) const;
    /// Regions of a slot buffer: gate, up, down matrices; their biases; their scales.
    static constexpr int kRegions = 9;
    /// Per-slot bytes of each region: gate, up, down matrices, then gate, up, down biases, then gate, up, down
    /// scales (0: no such region).
    const std::array<int64_t, kRegions> & strides() const { return strides_; }

private:
    /// Offset of region `which` (0 gate, 1 up, 2 down, 3..5 their biases, 6..8 their scales; 9: the end) in a
    /// slot buffer of n slots
    /// (plus its null slot).
    int64_t region_base(int which, int64_t n) const;

    int n_layers_, n_expert_;
    int64_t direct_align_ = 0;            // > 0: regions aligned for direct reads (constructor; 0 when no kind is read
                                          // in place, as region_strides decides)
    bool direct_ok_ = false;              // open_host: every slot starts on a multiple of direct_align_
    void * own_mem_ = nullptr;            // open_host's own mapping (CPU buffer type with direct_align_), or null
    size_t own_bytes_ = 0;
    std::array<int64_t, kRegions> strides_{};  // gate, up, down, their biases, their scales: bytes per slot
    int64_t slot_bytes_ = 0;
    int64_t n_slots_ = 0;
    bool host_ = false;                  // open_host: the slots are host memory, no device
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
    int64_t per_buf_ = 1;                // slots per slot buffer
    ggml_context * ctx_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr; // every slot buffer (one ggml allocation, split by the device's max size)
    std::vector<ggml_tensor *> bufs_;    // one tensor per slot buffer
    std::vector<int32_t> slot_key_;      // slot -> key or -1
    std::vector<int32_t> key_slot_;      // key -> slot or -1
    std::vector<uint8_t> key_loaded_;    // key's slot holds its weights (copy queued)
    std::vector<uint64_t> key_copy_seq_; // key -> sequence number of its last copy
    std::vector<int32_t> free_slots_;
};

}  // namespace hybrimoe
