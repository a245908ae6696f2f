// Cost model of one MoE layer's work on CPU, GPU and the host-to-device link (HybriMoE §IV.B; HYBRIMOE.md §1).
#pragma once

#include <map>
#include <stdexcept>
#include <string>

namespace hybrimoe {

/// Predicted durations, all in seconds, of the pieces of one MoE layer.
///
/// - CPU expert over n tokens: `cpu_a_s + cpu_b_s * n`; the first CPU expert of a layer also pays `cpu_startup_s`.
/// - GPU expert over n tokens: `gpu_a_s + gpu_b_s * n`.
/// - Host-to-device copy of `bytes`: `bytes / h2d_bandwidth_Bps + h2d_latency_s`.
/// - A GPU share of a layer moves the hidden state to the GPU and the partial output back once:
///   `act_a_s + act_b_s * n_tokens` (our MoE op runs on the host side; HYBRIMOE.md §1).
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
///   copies block the issuing thread (the RPC stand-in: ggml's RPC client sends tensor data synchronously).
/// The numbers come from a calibration or from a hardware preset (hybrimoe/presets/*.json), never from constants
/// in the scheduler. JSON load/save: cost_model_from_json / cost_model_to_json below (schema there).
struct CostModel {
    double cpu_a_s = 0.0;
    double cpu_b_s = 0.0;
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

    double cpu(int n_tokens) const { return cpu_a_s + cpu_b_s * n_tokens; }
    double gpu(int n_tokens) const { return gpu_a_s + gpu_b_s * n_tokens; }
    double h2d(double bytes) const { return bytes / h2d_bandwidth_Bps + h2d_latency_s; }
    double act(int n_tokens) const { return act_a_s + act_b_s * n_tokens; }
    double layer(int n_tokens) const { return layer_a_s + layer_b_s * n_tokens; }
    double dense(int n_tokens) const { return dense_a_s + dense_b_s * n_tokens; }

    /// Seconds of copy-queue time during which the device cannot compute: (1 - copy_overlap) * queue_s.
    double copy_blocking(double queue_s) const { return (1.0 - copy_overlap) * queue_s; }
    /// Seconds by which copies of `copy_s` seconds, issued for a layer, delay its CPU share:
    /// (1 - cpu_copy_overlap) * copy_s.
    double cpu_copy_blocking(double copy_s) const { return (1.0 - cpu_copy_overlap) * copy_s; }

    /// Throws std::invalid_argument naming the first field that is negative or not finite, a non-positive
    /// bandwidth, or a copy_overlap or cpu_copy_overlap outside [0, 1].
    void validate() const;
};

/// A cost-model JSON document that cannot be used: not JSON, not an object, wrong schema, a missing, unknown or
/// bad field, or an unreadable file. The message names the document (`where`) and the problem.
struct CostModelError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

/// Schema tag of the cost-model JSON this version writes; the older ones are still read: /2 (no cpu_copy_overlap,
/// read as 1) and /1 (neither copy_overlap nor cpu_copy_overlap, both read as 1).
constexpr const char * kCostModelSchema = "hybrimoe.cost_model/3";
constexpr const char * kCostModelSchemaV2 = "hybrimoe.cost_model/2";
constexpr const char * kCostModelSchemaV1 = "hybrimoe.cost_model/1";

/// Parses a cost-model JSON document, schema `hybrimoe.cost_model/3` (all times in seconds, bandwidth in
/// bytes per second):
///
///     {"schema": "hybrimoe.cost_model/3",
///      "cpu_a_s": number, "cpu_b_s": number, "cpu_startup_s": number,   // CPU expert: a + b*tokens (+ start-up)
///      "gpu_a_s": number, "gpu_b_s": number,                            // GPU expert: a + b*tokens
///      "h2d_bandwidth_Bps": number, "h2d_latency_s": number,            // copy: bytes/bandwidth + latency
///      "act_a_s": number, "act_b_s": number,                            // activation round trip of a GPU share
///      "layer_a_s": number, "layer_b_s": number,                        // non-expert work of a MoE layer
///      "dense_a_s": number, "dense_b_s": number,                        // a dense layer
///      "copy_overlap": number,                                          // 0..1, see CostModel
///      "cpu_copy_overlap": number,                                      // 0..1, see CostModel
///      "sources": {field: string, ...}}                                 // optional: where each number comes from
///
/// Every number is required, finite and >= 0 (bandwidth > 0, the overlaps <= 1); other keys are errors. A
/// `hybrimoe.cost_model/2` document (the same without cpu_copy_overlap) reads with cpu_copy_overlap 1, a
/// `hybrimoe.cost_model/1` one (without either overlap) with both 1. Standard JSON (RFC 8259);
/// Python's NaN / Infinity / -Infinity literals are read as numbers only so that they are reported as bad values.
/// `sources`, when not null, receives the "sources" object. Throws CostModelError with `where` in the message.
CostModel cost_model_from_json(const std::string & text, const std::string & where = "cost model",
                               std::map<std::string, std::string> * sources = nullptr);

/// The JSON document of `cm` (schema above; numbers printed with 17 significant digits, so they read back
/// bit for bit), with "sources" when not empty. Throws CostModelError if a number is not finite.
std::string cost_model_to_json(const CostModel & cm, const std::map<std::string, std::string> & sources = {});

/// Reads a cost-model JSON file. Throws CostModelError naming the path (unreadable file, bad document).
CostModel load_cost_model(const std::string & path, std::map<std::string, std::string> * sources = nullptr);

/// Writes cost_model_to_json(cm, sources) to a file. Throws CostModelError if it cannot be written.
void save_cost_model(const CostModel & cm, const std::string & path,
                     const std::map<std::string, std::string> & sources = {});

}  // namespace hybrimoe
