// Cost model of one MoE layer's work on CPU, GPU and the host-to-device link (HybriMoE §IV.B; docs/design.md §1).
#pragma once

#include <limits>

namespace hybrimoe {

/// Predicted durations, all in seconds, of the pieces of one MoE layer.
///
/// - CPU expert over n tokens: `cpu_a_s + cpu_b_s * n + cpu_c_s * min(n, kCpuSmallRows)`; the first CPU expert of a
///   layer also pays `cpu_startup_s`. `cpu_c_s` is the extra cost of each of an expert's first rows: ggml-cpu runs
///   an expert with few rows row by row and one with many through its tiled kernels, which cost less per row
///   (docs/design.md §9), so a row costs more in decode than in a prefill ubatch.
/// - GPU expert over n tokens: `gpu_a_s + gpu_b_s * n`.
/// - Host-to-device copy of `bytes`: `bytes / h2d_bandwidth_Bps + h2d_latency_s`.
/// - A GPU share of a layer moves the hidden state to the GPU and the partial output back once:
///   `act_a_s + act_b_s * n_tokens` (our MoE op runs on the host side; docs/design.md §1).
/// - Non-expert work of a MoE layer (attention, router, shared experts): `layer_a_s + layer_b_s * n_tokens`;
///   of a dense layer: `dense_a_s + dense_b_s * n_tokens`.
/// - `copy_overlap` in [0, 1]: the share of a host-to-device copy's time during which the device still computes.
///   1: copies run beside compute (a discrete GPU's copy engine, HybriMoE §IV.B's separate PCIe timeline); 0: the
///   device does one thing at a time (the ggml RPC stand-in serves one command after another), so queued copies
///   delay the GPU share by (1 - copy_overlap) of their time.
/// - `cpu_copy_overlap` in [0, 1]: the share of a host-to-device copy's time during which the host's CPU share
///   still runs at full speed. 1: copies cost the CPU nothing (a DMA engine reading pinned memory; HybriMoE §IV.B
///   puts the CPU and PCIe on separate timelines); below 1: the copies the engine issues for a layer (its loads,
///   prefetches and fills, queued before the CPU share runs) delay that layer's CPU share by
///   (1 - cpu_copy_overlap) of their time: host-memory contention on a real GPU, the whole copy on a device whose
///   copies block the issuing thread.
/// - Disk (the tier below host RAM, for models larger than RAM): a read of `bytes` of the model file takes
///   `bytes / disk_bandwidth_Bps + disk_latency_s` when it runs alone; up to `disk_queue_depth` reads are in
///   flight at once and share the bandwidth (more than that wait). `disk_bandwidth_Bps` 0: no disk figures
///   (every expert in RAM, today's case; a RAM tier cannot be planned with such a model).
/// The numbers come from a calibration or from a hardware file (hybrimoe/policy/hardware_files/*.json, a disk from
/// hybrimoe/policy/disk_files/*.json), never from constants in the scheduler. The C++ side only holds them:
/// cost-model JSON files (schema hybrimoe.cost_model/4) are read
/// and written in Python (hybrimoe.policy), which hands the engine and the simulator a CostModel.
struct CostModel {
    double cpu_a_s = 0.0;
    double cpu_b_s = 0.0;
    double cpu_c_s = 0.0;
    double cpu_startup_s = 0.0;
    double gpu_a_s = 0.0;
    double gpu_b_s = 0.0;
    double h2d_bandwidth_Bps = 25e9;
    double h2d_latency_s = 0.0;
    double act_a_s = 0.0;
    double act_b_s = 0.0;
    double layer_a_s = 0.0;
    double layer_b_s = 0.0;
    double dense_a_s = 0.0;
    double dense_b_s = 0.0;
    double copy_overlap = 1.0;
    double cpu_copy_overlap = 1.0;
    double disk_bandwidth_Bps = 0.0;
    double disk_latency_s = 0.0;
    double disk_queue_depth = 1.0;

    /// Rows of an expert up to which each pays cpu_c_s on top of cpu_b_s.
    static constexpr int kCpuSmallRows = 8;

    double cpu(int n_tokens) const {
        return cpu_a_s + cpu_b_s * n_tokens + cpu_c_s * (n_tokens < kCpuSmallRows ? n_tokens : kCpuSmallRows);
    }
    double gpu(int n_tokens) const { return gpu_a_s + gpu_b_s * n_tokens; }
    double h2d(double bytes) const { return bytes / h2d_bandwidth_Bps + h2d_latency_s; }
    double act(int n_tokens) const { return act_a_s + act_b_s * n_tokens; }
    double layer(int n_tokens) const { return layer_a_s + layer_b_s * n_tokens; }
    double dense(int n_tokens) const { return dense_a_s + dense_b_s * n_tokens; }
    /// Whether the disk figures are known (disk_bandwidth_Bps > 0).
    bool has_disk() const { return disk_bandwidth_Bps > 0.0; }
    /// Seconds to read `bytes` from the disk with no other read in flight; infinity without disk figures.
    double disk_read(double bytes) const {
        return has_disk() ? bytes / disk_bandwidth_Bps + disk_latency_s : std::numeric_limits<double>::infinity();
    }

    /// Seconds of copy-queue time during which the device cannot compute: (1 - copy_overlap) * queue_s.
    double copy_blocking(double queue_s) const { return (1.0 - copy_overlap) * queue_s; }
    /// Seconds by which copies of `copy_s` seconds, issued for a layer, delay its CPU share:
    /// (1 - cpu_copy_overlap) * copy_s.
    double cpu_copy_blocking(double copy_s) const { return (1.0 - cpu_copy_overlap) * copy_s; }

    /// Throws std::invalid_argument naming the first field that is negative or not finite, a non-positive
    /// link bandwidth, a copy_overlap or cpu_copy_overlap outside [0, 1], or a disk_queue_depth below 1.
    void validate() const;
};

}  // namespace hybrimoe
