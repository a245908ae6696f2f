// Trace-driven simulator of CPU, GPU and the copy engine, layer by layer.
//
// What it charges is the engine's real work (src/runtime/engine.h): per MoE layer, the CPU computes only its own
// experts, each over its own tokens (cpu(load), the first paying the start-up), and the GPU only its own (after
// the hidden state went up: act(n_tokens), then gpu(load) each, an expert waiting for its copy); the copy engine
// copies back to back. In prefill a step is one ubatch of a prompt (every expert's load is its token count in the
// ubatch); in decode a step is one token.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "policy/cost_model.h"
#include "policy/decision.h"
#include "policy/expert_cache.h"
#include "policy/prefetcher.h"
#include "policy/scheduler.h"
#include "policy/trace.h"

namespace hybrimoe {

/// What the planner does not see; time is charged by this "truth" model, never by the planner's own prediction.
/// Noise factors are log-normal with mean 1 and the given sigma, drawn per task from a generator seeded by `seed`.
struct TruthModel {
    uint64_t seed = 1;
    double cpu_noise = 0.10;            ///< per CPU expert
    double gpu_noise = 0.05;            ///< per GPU expert
    double h2d_noise = 0.05;            ///< per copy
    double act_noise = 0.10;            ///< per activation round trip
    double layer_noise = 0.03;          ///< per non-expert layer part
    double cpu_startup_extra_s = 0.0;   ///< first-CPU-expert overhead beyond the planner's cpu_startup_s
    double contention = 0.0;            ///< CPU expert time grows by this fraction while the link copies from host
                                        ///< memory (memory-bandwidth contention; e.g. link GB/s / host memory GB/s)
    double cpu_scale = 1.0, gpu_scale = 1.0, h2d_scale = 1.0;  ///< systematic planner error
    /// Throws std::invalid_argument on a negative or non-finite field.
    void validate() const;
};

/// The simulator's assumed recall of a routing predictor at look-ahead distance d = 1, 2, 3: the probability that
/// TracePredictor keeps a true (token, rank) expert of that layer (SimConfig::recall, `hybrimoe simulate
/// --recall`). It also becomes each simulated Prediction's confidence. An assumption every simulator report
/// states; not the engine's kDefaultPredictionConfidence (router_predictor.h), whose values it happens to share
/// today. Python: hybrimoe._core.DEFAULT_PREDICTOR_RECALL.
inline constexpr std::array<double, 3> kDefaultPredictorRecall = {0.8, 0.65, 0.5};

/// Imperfect routing predictor for the simulator: each true (token, rank) expert of the layer at distance d is
/// kept with probability recall[d-1] and otherwise replaced by a random expert that token did not pick. An
/// assumption standing in for "apply the next layers' routers to the current hidden state" (HybriMoE §IV.C);
/// recall 1 is the oracle (a bound only).
class TracePredictor {
public:
    /// recall: one value in [0, 1] per distance 1..D. Throws std::invalid_argument otherwise.
    TracePredictor(std::vector<double> recall, uint64_t seed);
    void predict(const int16_t * ids_base, int64_t token_stride, int n_tokens, int top_k, int n_experts, int distance,
                 Prediction & out);
    const std::vector<double> & recall() const { return recall_; }

private:
    std::vector<double> recall_;
    std::mt19937_64 rng_;
    std::vector<int32_t> pos_;
};

/// The host-RAM tier under the GPU cache, for a model larger than RAM: which routed experts are in RAM is an
/// ExpertCache of the RAM budget (any policy), and how the others arrive from the model file is set here. Reads are
/// charged by the truth CostModel's disk figures (CostModel::disk_read): a queued read of `bytes` waits for one of
/// disk_queue_depth places, pays disk_latency_s, then moves its bytes at disk_bandwidth_Bps once the reads ahead of
/// it moved theirs (in flight reads overlap their latency and share the bandwidth). One read per expert.
struct RamTierConfig {
    /// "queued": reads are queued to I/O workers (pread) when an expert is needed or predicted, and the work that
    /// needs the expert waits for its read; "faulting": the expert is touched through the file's mapping and its
    /// pages fault in on the touching thread, one read of `fault_bytes` at a time, each paying the latency
    /// (upstream llama.cpp's mmap: the CPU thread that computes the expert, or the copy of a GPU load, waits).
    std::string reads = "queued";
    /// Experts read from disk are offered to the RAM cache (false: the cache is a static set and what is read
    /// for a use is dropped after it).
    bool keep = true;
    /// Queued reads only: after a layer's router, read the predicted experts of the next `lookahead` MoE layers
    /// (the router look-ahead of HybriMoE §IV.C, one tier down), highest predicted load first, while the
    /// planner's estimate of the disk queue ends before that layer is expected to start. 0: no look-ahead.
    int lookahead = 0;
    /// The CPU share runs its experts in the order their weights are in RAM (resident first, then by read end);
    /// false: the plan's order, waiting for each.
    bool ready_first = false;
    /// Queued reads only: exclusive tiers. The GPU cache and the RAM tier hold different experts, so that together
    /// they hold their two budgets' worth: an expert loaded to the GPU gives up its RAM slot (at once, or once its
    /// layer ran when the layer's lookups pinned it there; not a streamed load on probation, which leaves the GPU
    /// at the next load; in a step that likely uses every expert of a layer, 1 - (1 - k/E)^n >= 1/2, a prefill
    /// ubatch, the tiers are left as they are: its loads stream through), and an expert the GPU cache evicts is copied back into
    /// RAM (demotion: device to host over the link's other direction, PCIe being full duplex, at the H2D figures)
    /// when it ranks at least as high as the RAM tier's victim (ExpertCache::admit_demoted), instead of being read
    /// from the disk at its next use. false: inclusive (an expert on the GPU keeps its RAM copy if the RAM cache
    /// keeps it).
    bool exclusive = false;
    double fault_bytes = 131072.0;   ///< bytes one page fault reads: Linux's default read_ahead_kb, 128 KiB
    /// Faulting reads only: bytes the kernel reads from the disk per byte of an expert faulted in (>= 1), its
    /// read-around: a window of that many experts' bytes centred on the expert. The neighbours (experts e +- 1,
    /// ..., adjacent in the ffn_*_exps tensors) wholly inside it that are not in RAM are read too and offered to
    /// the RAM cache as read ahead of use (a prefill that uses them hits; in decode they mostly take the place of
    /// what would have been used); the window's partial experts are read as waste. 1: only the expert's bytes.
    double read_around = 1.0;
    /// Faulting reads only: bytes per second the disk delivers to page faults (what the kernel reads for them,
    /// read-around and read-ahead included, over the wall seconds the faulting threads wait), measured by faulting
    /// a decode's experts through a mapping under memory pressure (hybrimoe calibrate --disk --memory-limit). It
    /// folds in what the queued model charges separately: each fault's latency, the few faults in flight (one per
    /// compute thread) and the kernel's work per fault (page-cache insertion, reclaim under the limit). A decode
    /// step's faults and the kernel's read-ahead they start move at it; a ubatch that sweeps whole layers in file
    /// order (a prefill's, read ahead by the kernel) still reads as queued reads do. 0: faults move as queued reads
    /// (read_bandwidth_Bps, else the disk's bandwidth), each paying its latency.
    double fault_bandwidth_Bps = 0.0;
    /// Bytes per second of this tier's reads that fault_bandwidth_Bps does not move (queued reads; a prefill's
    /// faults and their read-around; every fault where fault_bandwidth_Bps is 0), where they differ from the disk's
    /// bandwidth: reads through the page cache (a mapping's
    /// faults, preads that warm the page cache) land in 4 KiB pages and a direct read in huge pages, and a virtual
    /// disk may move the two at different rates (this project's machine: 1.3-1.6 against 3.1 GB/s). Measured by
    /// hybrimoe calibrate --disk (tier_read_Bps, buffered_read_Bps). 0: the disk's bandwidth.
    double read_bandwidth_Bps = 0.0;
    /// Faulting reads only: bytes per MoE layer of the weights outside the routed experts (attention, router,
    /// shared experts, norms), mapped from the same file and so held by the same page cache. An LRU page cache
    /// keeps a layer's share while fewer bytes entered it since the layer last ran than it holds (the RAM cache's
    /// budget plus every layer's share: its reuse distance); otherwise the layer faults the share in again before
    /// it runs, the kernel reading it sequentially. 0: they stay in RAM.
    double other_bytes = 0.0;
    /// Queued reads only: wall seconds by which each byte read delays the CPU share that runs beside it (the I/O
    /// workers' copies and system calls on the cores the compute threads use; 0: spare cores absorb them). A
    /// read's cost is first absorbed by the CPU share's waits for reads, the rest delays it; a layer whose CPU
    /// share is empty absorbs it all.
    double read_cpu_s_per_byte = 0.0;
    /// look-ahead predictor recall per distance 1..lookahead (an assumption to report, as SimConfig::recall)
    std::vector<double> recall{kDefaultPredictorRecall.begin(), kDefaultPredictorRecall.end()};
    /// Throws std::invalid_argument naming the bad field.
    void validate() const;
};

/// Run settings.
struct SimConfig {
    std::string stage = "decode";       ///< "decode" (one token per step) or "prefill" (ubatches of a prompt)
    int ubatch = 512;                   ///< prefill ubatch size, tokens
    /// Decode only: the first this many tokens of each prompt are its prompt, prefilled in ubatches before its
    /// tokens are decoded one per step (a request as a server runs it: the cache enters the decode as the prefill
    /// left it). The prefill's steps count in the result (tokens, total time, max_tokens) as the decode's do: a
    /// caller that wants the decode alone subtracts a run of the prompts alone. 0: every token decoded.
    int64_t prompt_tokens = 0;
    int prefetch_depth = 3;             ///< D, predicted MoE layers ahead
    /// predictor recall per distance 1..prefetch_depth (an assumption to report)
    std::vector<double> recall{kDefaultPredictorRecall.begin(), kDefaultPredictorRecall.end()};
    uint64_t predictor_seed = 7;
    bool fill_on_miss = true;           ///< offer CPU-computed misses to the cache, copied while the link is idle
    int64_t max_tokens = 0;             ///< stop after about this many tokens (0 = all); prefill: whole prompts
    int64_t timeline_step = 0;          ///< step whose first `timeline_layers` MoE layers are recorded (-1 = none)
    int timeline_layers = 4;
    RamTierConfig ram;                  ///< used when simulate() is given a RAM cache
    /// Throws std::invalid_argument naming the bad field.
    void validate() const;
};

/// One interval of the recorded timeline (seconds from the start of the run).
struct TimelineEvent {
    int64_t step = 0;
    int layer = 0;
    int resource = 0;    ///< 0 CPU, 1 GPU, 2 PCIe, 3 disk
    int expert = -1;     ///< -1: non-expert work / activation transfer
    int kind = 0;        ///< 0 compute, 1 demand copy, 2 prefetch copy, 3 fill copy, 4 non-expert, 5 activations,
                         ///< 6 disk read (a queued read on the disk, a faulting read on the CPU),
                         ///< 7 demotion copy (device to host, exclusive tiers)
    double start_s = 0.0;
    double end_s = 0.0;
};

/// Outputs of one run (times in seconds of simulated time).
struct SimResult {
    std::string stage;
    int64_t tokens = 0;
    int64_t steps = 0;
    int64_t prompts = 0;
    double total_s = 0.0;
    double ttft_s = 0.0;          ///< prefill: mean time to process a prompt
    double tpot_s = 0.0;          ///< decode: mean time per token
    double tokens_per_s = 0.0;
    CacheStats cache;
    double bytes_h2d = 0.0, bytes_demand = 0.0, bytes_prefetch = 0.0, bytes_fill = 0.0;
    int64_t prefetch_issued = 0, prefetch_declined = 0, prefetch_used = 0;
    double cpu_busy_s = 0.0, gpu_busy_s = 0.0, link_busy_s = 0.0;
    double predicted_moe_s = 0.0;  ///< sum of the planner's predicted makespans
    double charged_moe_s = 0.0;    ///< sum of the truth model's MoE times
    CacheStats ram_cache;          ///< the RAM tier's lookups (experts the CPU computes or a GPU load copies)
    double bytes_disk = 0.0;       ///< bytes read from the model file (all reads)
    double bytes_disk_prefetch = 0.0;  ///< of those, read by the look-ahead
    int64_t disk_reads = 0;        ///< reads of whole experts (queued or faulting)
    int64_t page_faults = 0;       ///< faulting reads: faults of fault_bytes each
    int64_t ram_prefetch_issued = 0;
    int64_t demotions = 0;         ///< exclusive tiers: experts the GPU evicted copied back into RAM
    double bytes_demoted = 0.0;    ///< and their bytes (device to host)
    double disk_busy_s = 0.0;      ///< seconds the disk moved bytes (bandwidth time, latency not counted)
    double decision_us_mean = 0.0;  ///< wall-clock per layer of split + cache update (instrumented)
    double prefetch_us_mean = 0.0;  ///< wall-clock per layer of prefetch planning
    std::vector<double> layer_moe_s;  ///< mean charged MoE time per MoE layer
    /// per device (simulate_devices; one entry with one device): its cache's lookups, the bytes copied to it, the
    /// seconds its link copied
    std::vector<CacheStats> device_cache;
    std::vector<double> device_bytes_h2d;
    std::vector<double> device_link_busy_s;
    std::vector<TimelineEvent> timeline;
};

/// Lists the steps (token ranges) of a run: decode one token each, prefill chunks of `ubatch` per prompt.
struct Step {
    int64_t begin = 0, end = 0;
    int prompt = 0;
};
std::vector<Step> make_steps(const Trace & trace, int first_prompt, int end_prompt, const SimConfig & cfg);

/// Future accesses of those steps, for clairvoyant cache policies.
FutureAccesses build_future(const Trace & trace, const std::vector<Step> & steps);

/// Replays a trace's accesses through a cache alone (no timing): per (step, layer) observe, look up and pin every
/// activated expert, offer every miss for admission, highest policy priority first (the policy may decline),
/// unpin. Returns the cache statistics.
CacheStats replay_cache(const Trace & trace, ExpertCache & cache, int first_prompt, int end_prompt,
                        const SimConfig & cfg);

/// Event-driven simulation of prompts [first_prompt, end_prompt): per layer, the engine's decision rules
/// (LayerDecider, decision.h: lookups, split, demand loads, a refused load on the CPU, prefetches, fills while the
/// planner's copy-queue estimate stays below the makespan) decide with `planner`, the policies and the planner's
/// estimate of the copy queue, as the engine does; the CPU, GPU and copy-engine timelines are charged by
/// `truth_cost` under `truth` (an expert waits for the true end of its copy). The cache's initial fill is resident
/// from the start (the engine copies it at first use). Non-expert work runs on the
/// GPU before the routed experts; a leading dense layer costs dense(n). Throws std::invalid_argument on bad
/// ranges or a cache whose shape does not match the trace; exceptions from policies propagate.
///
/// `ram`: the RAM tier (cfg.ram says how it reads): an expert the CPU computes, or a GPU load copies, must be in
/// RAM first; one in neither cache is read from disk. nullptr: every expert is in RAM (no disk). With a RAM tier
/// both cost models need disk figures (CostModel::has_disk), else std::invalid_argument.
SimResult simulate(const Trace & trace, ExpertCache & cache, SchedulePolicy & scheduler, PrefetchPolicy & prefetcher,
                   const CostModel & planner, const CostModel & truth_cost, const TruthModel & truth,
                   const SimConfig & cfg, int first_prompt, int end_prompt, ExpertCache * ram = nullptr);

/// One accelerator of a simulated host with several (simulate_devices): its cache (of the layers it serves: give
/// the others expert bytes 0), policies and cost models (the planner's and the truth's; their GPU-side figures
/// (copies, GPU compute, the non-expert layer part) are this device's, the CPU and disk figures are the host's,
/// taken from device 0). Not owned.
struct SimDevice {
    ExpertCache * cache = nullptr;
    SchedulePolicy * scheduler = nullptr;
    PrefetchPolicy * prefetcher = nullptr;
    CostModel planner, truth;
};

/// simulate() over several devices, as llama.cpp's layer split runs a model on several GPUs: MoE layer l's
/// non-expert part and GPU share run on device layer_device[l] (empty: all on device 0), with that device's cache,
/// rules and copy queue; a device prefetches only its own layers (the engine's rule: no copy between devices).
/// Each device copies over a link of its own, or, with `shared_link`, all over one (GPUs that share the host's
/// lanes behind one switch): their copies then queue one after another. The hidden state's hop between devices
/// is not charged (n_embd floats per token). Throws std::invalid_argument on no device, a device without a cache
/// or policy, two devices sharing one cache, or a layer_device of the wrong length or out of range.
SimResult simulate_devices(const Trace & trace, const std::vector<SimDevice> & devices,
                           const std::vector<int> & layer_device, bool shared_link, const TruthModel & truth,
                           const SimConfig & cfg, int first_prompt, int end_prompt, ExpertCache * ram = nullptr);

/// Replays the engine's decision records (Engine::take_log, logged from the engine's first ubatch on) through
/// `cache`, `scheduler` and `prefetcher`, which must be fresh objects built as the engine's were (same preset,
/// budget, initial fill) with the engine's cost model and rules `cfg`. Per record, in order, the
/// same rules as the engine (LayerDecider) run on the record's inputs: routing, router scores, expert bytes, the
/// engine's clock and copy-queue estimate at the split, the predictions the prefetcher was shown and the first-use copies; the layer
/// is released after its record, as the engine's wait op does. Returns one record per input holding those inputs
/// and the simulator's decisions (cached, planned and run split, loads admitted / declined, prefetches, fills,
/// evictions, makespan). A prefetch-only record (DecisionRecord::prefetch_only: one device's prefetch planned at
/// another device's layer) is replayed by LayerDecider::prefetch_ahead. Throws std::invalid_argument on records that
/// do not fit the cache (layer or expert out of range, ids not [n_tokens, top_k], scores not [n_tokens,
/// n_experts]); policy errors propagate.
std::vector<DecisionRecord> replay_decisions(const std::vector<DecisionRecord> & log,
                                             std::shared_ptr<ExpertCache> cache,
                                             std::shared_ptr<SchedulePolicy> scheduler,
                                             std::shared_ptr<PrefetchPolicy> prefetcher, const CostModel & cost,
                                             const DeciderConfig & cfg);

/// The first decision on which two logs differ, as "record i (ubatch u, MoE layer l): <field>: <a> vs <b>", or ""
/// when they agree on every decision (cached, ready_s, planned_gpu, on_gpu, loaded, declined, first_use, prefetched,
/// filled, evicted, makespan_s; compared exactly) and have the same length.
std::string first_difference(const std::vector<DecisionRecord> & a, const std::vector<DecisionRecord> & b);

}  // namespace hybrimoe
