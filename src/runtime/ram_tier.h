// The RAM expert tier: routed experts read from the GGUF file into a host slot pool, for models larger than RAM.
//
// Upstream llama.cpp runs such a model through mmap: an expert not in the page cache arrives by page faults,
// synchronously, while the CPU waits, and the kernel's page cache decides what stays. Here the routed-expert
// tensors stay unread (patch 0007, LLAMA_LAZY_MODE_EXPERTS), a SlotPool in host memory (SlotPool::open_host, the
// GPU pool's region layout) holds the experts an ExpertCache of its own keeps in RAM (MRS by default, HybriMoE
// §IV.D applied to this tier), and a pool of I/O workers reads the others from the file: one buffered pread per
// matrix of the expert (one expert is 1-3 reads; its F32 bias rows, which load with the model, are copied from
// host memory), then POSIX_FADV_DONTNEED on the range read, so the page cache does not keep a second copy and the
// RAM budget holds. Reads come from the plan op (demand: the layer's CPU experts not in RAM, computed in the CPU
// share's second pass once read, while the first computes the resident ones) and from the router look-ahead (prefetch: the next layers' predicted experts, HybriMoE §IV.C,
// read while this layer computes). The CPU share then computes over views of the pool's regions with the routing
// ids remapped to RAM slots: upstream's kernels on upstream's bytes, so the results are upstream's bit for bit.
//
// Threading: every method but the workers' own runs on ggml's thread 0 (the engine's ops) or, between decodes,
// the Python thread; the workers only read files into slots they were given and post completions.
#pragma once

#include "ggml-backend.h"
#include "ggml.h"
#include "policy/expert_cache.h"
#include "policy/prefetcher.h"
#include "runtime/expert_ffn.h"
#include "runtime/expert_files.h"
#include "runtime/slot_pool.h"

#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <sys/stat.h>
#include <string>
#include <thread>
#include <vector>

namespace hybrimoe {

/// How the RAM tier reads the routed experts (where from: ExpertFiles).
struct RamTierConfig {
    int64_t n_slots = 0;                        ///< RAM expert slots (0: no RAM tier)
    int io_threads = 4;                         ///< I/O workers (reads in flight at most)
    /// repack each matrix after its read where ggml-cpu repacks CPU weights (upstream's default, cpu_layout.h): the
    /// CPU share then runs upstream's repacked kernels on the slots. Not with a GPU cache above the tier (its copies
    /// read the slots and need the file's layout).
    bool repack = false;
    bool drop_after_read = true;                ///< POSIX_FADV_DONTNEED on each range read (buffered reads)
    /// O_DIRECT reads (aligned over-reads into a worker's staging buffer, then a copy into the slot); where the
    /// file system refuses O_DIRECT, buffered reads
    bool direct_io = true;
    /// a predicted expert is read ahead only at this confidence p or above: with the disk the bottleneck, a read
    /// ahead saves its later demand read's time t with probability p and takes t from the demand reads otherwise,
    /// so it pays off net of the waste, (2p - 1) t > 0, above 1/2
    double min_prefetch_confidence = 0.5;
    /// a read ahead at this confidence or above is admitted as a demand read (kCertainUse: a prefill's)
    double certain_use = kCertainUse;
    /// a read ahead of a several-sequence ubatch (RamTier::prefetch) whose cell's measured share used is at least
    /// this is admitted as a demand read. Measured at 8 sequences larger than RAM (docs/design.md §18): 0.9 decoded
    /// as fast as 0.8 with the bytes of no read ahead; 0.8 admitted cells at 0.78-0.85 and read 18% more
    double confident_use = 0.9;
    /// bytes one RAM slot buffer may hold at most, below the host buffer type's own cap (0: that cap only); the CPU
    /// share then runs once per buffer (Engine::build)
    int64_t max_buffer_bytes = 0;
    /// exclusive tiers (with a GPU cache above the tier): an expert on the GPU gives up its RAM slot (give_up), and
    /// one the GPU cache evicts comes back into RAM from the GPU's copy (demote) when it ranks at least as high as
    /// the RAM cache's victim, instead of being read from the file at its next use (docs/design.md §17)
    bool exclusive = false;
    /// the CPU share over the slots in two passes per layer (Engine::build): the experts in RAM at the plan while
    /// the others are read, then those; off: all of them once every read ended
    bool two_pass = true;
};

/// RAM tier counters (read between decodes; byte counts are file bytes read).
struct RamTierStats {
    uint64_t accesses = 0, hits = 0, misses = 0;
    uint64_t late = 0;                  ///< hits whose read (a prefetch) was still in flight at use
    uint64_t demand_reads = 0, prefetch_reads = 0;   ///< experts read
    uint64_t prefetch_used = 0;         ///< prefetched experts used at their layer before eviction
    uint64_t preads = 0;                ///< read system calls
    uint64_t direct_matrices = 0;       ///< expert matrices read with O_DIRECT (the others: buffered)
    uint64_t in_place_matrices = 0;     ///< of those, read straight into their slot (no staging buffer, no copy)
    uint64_t evictions = 0;
    uint64_t given_up = 0;              ///< exclusive tiers: RAM slots given up by experts on the GPU
    uint64_t demotions = 0;             ///< exclusive tiers: experts the GPU evicted copied back into RAM
    double bytes_demand = 0, bytes_prefetch = 0;
    double wait_s = 0;                  ///< seconds the plan op waited for reads
};

class RamTier {
public:
    /// Opens the files (each must still have the size and modification time it had at load), allocates
    /// cfg.n_slots host slots of `geometry`'s layout from `buft` (nullptr: the CPU buffer type) and starts the I/O
    /// workers. `cache`: the tier's ExpertCache, sized in these slots. Throws std::invalid_argument on facts that
    /// disagree, std::runtime_error naming the file when one cannot be opened or changed since the load, and naming
    /// the bytes when the slots cannot be allocated.
    RamTier(int n_layers, int n_expert, const std::vector<std::array<int64_t, 3>> & expert_bytes,
            const std::vector<std::array<int32_t, 3>> & expert_types,
            const std::vector<std::array<int64_t, 3>> & bias_bytes,
            const std::vector<std::array<int64_t, 3>> & scale_bytes, const ExpertFiles & where, RamTierConfig cfg,
            std::shared_ptr<ExpertCache> cache, ggml_backend_buffer_type_t buft);
    /// Drops the queued reads, waits for the ones in flight (each is one pread) and closes the files.
    ~RamTier();
    /// Drops the queued reads and stops the workers once the reads in flight end (each is one pread); from then
    /// on a read the tier would need fails (std::runtime_error). The slots stay. Idempotent.
    void stop_io();
    RamTier(const RamTier &) = delete;
    RamTier & operator=(const RamTier &) = delete;

    /// The layer's host expert tensors (biases are copied from them into the slots); set once its graph is built.
    void set_layer(int layer, const ExpertMatrices & m);
    /// Whether the slots hold layer `layer`'s matrix `region` (0 gate or gate_up, 1 up, 2 down) repacked (known once
    /// set_layer ran).
    bool repacked(int layer, int region) const;
    /// Layer `layer`'s `m` with its matrices and bias rows replaced by views of slot buffer `b` of the pool, built in `ctx`
    /// (no_alloc): indexed by the buffer's local slot (SlotPool::local_slot of slot_of) instead of expert id.
    /// Scales stay the file's (gathered by expert id). A repacked region's view names the CPU_REPACK marker buffer
    /// (and carries its traits), so that mul_mat_id runs the repacked kernels on it.
    ExpertMatrices views(ggml_context * ctx, int layer, const ExpertMatrices & m, int b = 0) const;

    /// Makes the experts `experts` of MoE layer `layer` resident, reading the missing ones (demand reads, issued
    /// before any prefetch still queued), waits for every one of their reads, and pins them until release(layer).
    /// `now_s` is the engine clock, `scores` [n_tokens, n_expert] router probabilities for the cache policy.
    /// Throws std::runtime_error naming the file and the offset when a read failed (EIO, a file that became shorter),
    /// or when the pinned experts leave no slot (a budget below the minimum).
    void acquire(int layer, const std::vector<int32_t> & experts, const std::vector<int32_t> & loads, int n_tokens,
                 int top_k, const std::vector<float> & scores, int64_t step, double now_s);
    /// The same with the layer's observation as the GPU cache saw it (LayerDecider::observation); it waits only
    /// for the reads of the first `wait_first` experts, and wait_rest() for the others' (the reads are all issued,
    /// in the order given).
    void acquire(const LayerObservation & seen, const std::vector<int32_t> & experts, double now_s,
                 size_t wait_first = SIZE_MAX);
    /// Waits for the reads the last acquire() left (its experts past wait_first). Throws as acquire.
    void wait_rest();
    /// A read ahead of (layer, expert) was used other than through acquire (copied to the GPU): counted as used.
    void note_used(int layer, int expert);
    /// Exclusive tiers: (layer, expert) is on the GPU; its RAM slot goes unless it is pinned, held or being read.
    /// Returns whether it went.
    bool give_up(int layer, int expert);
    /// Exclusive tiers: the GPU cache evicts (layer, expert). A RAM slot for it, when it is not in RAM and ranks at
    /// least as high as the RAM cache's victim (ExpertCache::admit_demoted): the host addresses of its gate (or
    /// gate_up), up and down matrices there, which the caller fills with the GPU's bytes (the file's layout) before
    /// calling demoted(); nullptrs when refused (or when the slots hold that layer repacked).
    std::array<uint8_t *, 3> demote(int layer, int expert, double now_s);
    /// demote()'s matrices are filled: the bias rows and scales are copied from the host tensors, and the expert is
    /// in its RAM slot.
    void demoted(int layer, int expert);
    /// Whether this tier holds a pin on (layer, expert) now.
    bool is_pinned(int layer, int expert) const { return pin_count_[(size_t) layer * n_expert_ + expert] > 0; }
    /// RAM slot of (layer, expert), or -1.
    int32_t slot_of(int layer, int expert) const { return pool_.slot_of(layer, expert); }
    /// Unpins the experts acquire(layer) pinned and the prefetches made for this layer.
    void release(int layer);
    /// Seconds the disk takes per expert of `layer` (its bytes at the measured time per byte: each read's time
    /// divided by the reads in flight when it started, smoothed); 0 before the first read ended.
    double read_estimate_s(int layer) const;
    /// Whether (layer, expert) is in its RAM slot with its read ended (a GPU load may copy from it now).
    bool ready(int layer, int expert) const;
    /// Host addresses of (layer, expert)'s gate (gate_up), up and down matrices in its RAM slot (ready() only).
    std::array<const uint8_t *, 3> matrices(int layer, int expert) const;
    /// Keeps (layer, expert) in its RAM slot until unhold (a GPU copy reading it has not ended yet); the holds are
    /// counted, as pins.
    void hold(int layer, int expert) { pin((int64_t) layer * n_expert_ + expert); }
    void unhold(int layer, int expert) { unpin((int64_t) layer * n_expert_ + expert); }
    /// Reads ahead the predicted experts of later layers (likeliest first, those at min_prefetch_confidence or
    /// above, not resident, not in flight), admitted by the cache, pinned until their layer ran; at most
    /// `keep_free` slots stay unpinned for the next layer's own demand. Returns the experts queued.
    ///
    /// How likely a predicted expert is used: a ubatch of `n_tokens` tokens picking `top_k` of n_expert each leaves
    /// an expert unused with probability (1 - top_k / n_expert)^n_tokens under uniform routing, so in a large
    /// ubatch (prefill) every expert of the next layers is read ahead, the sampled predictions first, the others
    /// at that prior. For the sampled predictions of smaller ubatches (decode), the confidence is the share of the
    /// reads ahead in the prediction's cell used at their layer (judged there: used, or not by the time it ran,
    /// release): a ubatch whose prior is below min_prefetch_confidence (one sequence) has one cell per distance; one
    /// at or above it and below certain_use (several sequences, or a short prompt's tail) one per distance and
    /// sampled tokens that predicted the expert (1, 2, 3 or more), reads ahead the predicted experts, and the others
    /// only where the tokens the look-ahead did not score (beyond RouterPredictor::kSampleTokens) make their use
    /// likely by the uniform prior (an expert no sampled token predicts is less likely used than the ubatch's prior;
    /// at 8 sequences their reads were refused by the admission or wasted), and admits a read whose cell's share is
    /// at least confident_use as a demand read (the layer would read it anyway: a refusal only moves the read to
    /// the layer's start, and the disk idles meanwhile);
    /// with the prediction's assumed confidence counted as kPriorOutcomes outcomes (a Beta prior: a look-ahead that
    /// misses stops being read ahead after a few misses, not after tens of wasted reads); the counts are halved at
    /// kWindowOutcomes, so the share follows the recent reads. Where the router look-ahead does not predict the
    /// routing, nothing is read ahead for it but one expert (the most tokens predicted) of one prediction in
    /// kProbeEvery, which keeps the share measured.
    /// `above`: per MoE layer, the GPU slot pool of exclusive tiers that serves it, whose experts (the GPU serves
    /// them) are not read ahead (nullptr: none).
    int prefetch(const std::vector<Prediction> & predictions, int64_t keep_free, double now_s, int n_tokens,
                 int top_k, const std::vector<const SlotPool *> * above = nullptr);
    static constexpr uint64_t kPriorOutcomes = 8;
    /// share cells: one per distance (1..3) for one-sequence ubatches, then distance x predicted tokens (1, 2, 3+)
    static constexpr int kOneCells = 3;
    static constexpr int kCells = kOneCells + 3 * 3;
    static constexpr uint64_t kWindowOutcomes = 256;
    static constexpr uint64_t kProbeEvery = 16;

    int64_t n_slots() const { return pool_.n_slots(); }
    /// Bytes of one expert's gate (gate_up), up and down matrices in MoE layer `layer`.
    const std::array<int64_t, 3> & expert_bytes(int layer) const { return expert_bytes_[(size_t) layer]; }
    /// RAM slots pinned now (being read, used by a layer, read ahead for one, or held for a GPU copy); reads that
    /// ended since the last harvest give their own pins back first (a read ahead can end after its last lookup).
    /// Engine's thread, or between decodes.
    int64_t pinned() {
        harvest();
        return n_pinned_;
    }
    int64_t slot_bytes() const { return pool_.slot_bytes(); }
    const SlotPool & pool() const { return pool_; }
    const ExpertCache & cache() const { return *cache_; }
    RamTierStats stats() const;
    /// The reads ahead judged and used per share cell now (prefetch; the counts are windowed, kWindowOutcomes, and
    /// not cleared by reset_stats: they are the state the tier reads ahead by).
    std::array<std::array<uint64_t, 2>, kCells> ahead_counts() const;
    void reset_stats();
    /// Reads queued or in flight now.
    int reads_in_flight() const;
    /// Test-only fault injection: the next `count` preads fail with errno `err` (0: off).
    void inject_read_error(int err, int count = 1);

    /// O_DIRECT's alignment of file offset, length and buffer (4 KiB covers devices of 512 B blocks too); the slots'
    /// direct-read alignment (SlotPool::slot_bytes_for's `direct_align` for the RAM tier's slots).
    static constexpr int64_t kDirectAlign = 4096;

private:
    struct Job {
        int64_t key;
        int32_t slot;
        bool prefetch;
    };
    void worker();
    /// Copies expert `expert`'s bias rows and scales from its layer's host tensors `host` into slot `slot` (they
    /// load with the model).
    void copy_extras(int32_t slot, int expert, const ExpertMatrices & host);
    /// Reads one expert into its slot; "" or the error (file, offset, cause). `staging`: the worker's aligned
    /// buffer for direct reads (kDirectAlign-aligned, staging_bytes_).
    /// `tmp`: a worker buffer of the largest matrix's bytes when the tier repacks (the read lands there first).
    std::string read_expert(const Job & j, uint8_t * staging, uint8_t * tmp);
    /// Reads bytes [off, off + n) of file f into dst, directly (through `staging`) where the file allows it: the
    /// bytes got (n unless the file ends first), or -errno. With `in_staging`, a direct read leaves the bytes in the
    /// staging buffer and points *in_staging at them instead of copying them to dst.
    /// `into_slot`: dst lies `off % kDirectAlign` bytes past an aligned address with room for the aligned range
    /// (a slot of a matrix whose every expert has that phase): a direct read lands there, no staging and no copy.
    int64_t read_range(int32_t f, uint8_t * dst, int64_t n, int64_t off, uint8_t * staging, uint64_t & calls,
                       bool & direct, const uint8_t ** in_staging = nullptr, bool into_slot = false);
    /// Host address of layer `layer`'s matrix `region` in slot `slot`: the slot's region plus the phase.
    uint8_t * matrix_at(int32_t slot, int layer, int region) const {
        return pool_.slot_data(slot, region) + phase_[(size_t) layer][(size_t) region];
    }
    void close_files();
    /// POSIX_FADV_DONTNEED over every expert range (drop_after_read only): at open, and once more at the first
    /// ubatch.
    void drop_expert_pages();
    bool dropped_again_ = false;
    /// Throws std::runtime_error naming the file when one of the files no longer has the size or modification time
    /// it had at load.
    void check_files() const;
    /// Counts a read ahead of share cell `tag` - 1 (1..kCells) as used at its layer or not (under mu_).
    void judge(uint8_t tag, bool used);
    static bool judged_tag(uint8_t tag) { return tag >= 1 && tag <= kCells; }
    /// Admits `key` (evicting as the policy says), assigns its slot and queues its read. False: no room.
    /// `tag`: 0 a demand read; 1..kCells a read ahead whose use is counted in share cell tag - 1 (prefetch);
    /// kUncounted another read ahead. `certain`: a read ahead admitted as a demand read
    /// (RamTierConfig::certain_use).
    bool start_read(int layer, int expert, uint8_t tag, double now_s, bool certain = false);
    static constexpr uint8_t kUncounted = 255;
    /// Completed reads since the last call: their pins from the read are dropped, errors collected.
    void harvest();
    void wait_for(int64_t key);
    /// Waits for the reads of `keys`, then throws std::runtime_error with the first one's error, if any.
    void wait_keys(const std::vector<int64_t> & keys);
    std::vector<int64_t> rest_wait_;        // reads acquire() left to wait_rest()
    void drop_evicted();
    void pin(int64_t key);
    void unpin(int64_t key);

    int n_layers_, n_expert_;
    std::vector<std::array<int64_t, 3>> expert_bytes_;
    ExpertFiles where_;
    RamTierConfig cfg_;
    std::shared_ptr<ExpertCache> cache_;
    SlotPool pool_;
    std::vector<int> fds_;
    std::vector<int> direct_fds_;           // the same files opened O_DIRECT (-1: refused, or direct_io off)
    int64_t staging_bytes_ = 0;
    std::vector<ExpertMatrices> layers_;
    std::vector<std::array<bool, 3>> repack_;   // per layer and region: repacked after the read (set_layer)
    // Per layer and region: where in its slot a matrix starts, the file offset's phase (offset % kDirectAlign) when
    // every expert of the tensor has the same one (its bytes a multiple of kDirectAlign), so that an aligned direct
    // read lands in the slot with the matrix in place; 0 otherwise (direct reads then go through staging).
    std::vector<std::array<int64_t, 3>> phase_;
    std::vector<std::array<bool, 3>> into_slot_;
    ggml_backend_buffer_t repack_marker_ = nullptr;
    // key state: 0 not resident, 1 read queued or in flight, 2 in the slot; written under mu_
    std::vector<uint8_t> state_;
    std::vector<std::string> key_error_;    // a failed read's message (state back to 0 at harvest)
    std::vector<uint8_t> prefetched_;       // resident through a prefetch and not yet used: its tag (0: not)
    // reads ahead judged at their layer per share cell (kCells: prefetch), and those used; under mu_
    std::array<uint64_t, kCells> ahead_judged_{}, ahead_used_{};
    std::array<uint64_t, kCells> probe_calls_{};  // predictions seen while a cell's measured share was low
    std::vector<std::vector<int32_t>> pins_;          // per layer: experts acquire() pinned
    std::vector<std::vector<int32_t>> prefetch_pins_; // per layer: experts prefetched for it (pinned)
    std::vector<int32_t> pin_count_;        // pins this tier holds per key (the cache's own count mirrored)
    int64_t n_pinned_ = 0;                  // keys with a pin
    std::vector<int64_t> done_;             // completed reads not yet harvested
    mutable std::mutex mu_;
    std::condition_variable cv_work_, cv_done_;
    std::deque<Job> queue_;
    int in_flight_ = 0;
    double read_spb_ = 0.0;                 // measured seconds per byte read (smoothed); under mu_
    bool stop_ = false;
    int fault_errno_ = 0, fault_count_ = 0;
    std::vector<std::thread> workers_;
    mutable std::mutex stats_mu_;
    RamTierStats stats_;
};

}  // namespace hybrimoe
