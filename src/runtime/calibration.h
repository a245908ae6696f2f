// Device measurements for the cost model (hybrimoe calibrate, hybrimoe/calibrate.py; docs/design.md §1).
#pragma once

#include "ggml-backend.h"

#include <cstddef>

namespace hybrimoe {

/// Seconds per host-to-device copy of `bytes` to `device` (median of `reps` timed copies, each followed by a
/// synchronize; one untimed copy first), from the device's pinned host buffer type when it has one
/// (ggml_backend_dev_get_props caps.host_buffer), else from pageable memory. Throws std::invalid_argument on a null
/// device, 0 bytes or reps < 1, std::runtime_error when the device or the buffers fail.
double measure_h2d_s(ggml_backend_dev_t device, size_t bytes, int reps);

/// The share of a host-to-device copy's time during which `device` still computes (CostModel::copy_overlap): 1
/// when copies run beside compute (a GPU's copy engine: the copy on one backend instance, the compute on another,
/// as the engine queues them), 0 when the device does one thing at a time (the RPC stand-in). Measured from a copy
/// of `bytes` alone (t_h), a chain of F32 matrix products sized to take about as long alone (t_c), and both queued
/// together (t_b): (t_h + t_c - t_b) / min(t_h, t_c), clamped to [0, 1], median of `reps`. Throws
/// std::invalid_argument on bad arguments, std::runtime_error when the device or its buffers fail.
double measure_copy_overlap(ggml_backend_dev_t device, size_t bytes, int reps);

/// The share of a host-to-device copy's time during which the host CPU still computes at full speed
/// (CostModel::cpu_copy_overlap): copies of `bytes` queued on `device` as the engine queues its expert copies (a
/// second backend instance, asynchronous when the device has events, else blocking), alone (t_h); a chain of
/// F32 matrix-vector products over a 16 MiB matrix (memory-bound, as decode-time experts are) on ggml's CPU
/// backend with `n_threads` threads, sized to take about as long alone (t_c); and both, the copies queued first
/// and the CPU chain run while they are in flight (t_b): (t_h + t_c - t_b) / min(t_h, t_c), clamped to [0, 1],
/// median of `reps`. 1: copies cost the CPU nothing (a DMA engine); 0: the CPU waits for them (a blocking copy,
/// or a client that sends the data itself on a fully busy host). Throws std::invalid_argument on bad arguments,
/// std::runtime_error when a device or its buffers fail.
double measure_cpu_copy_overlap(ggml_backend_dev_t device, size_t bytes, int reps, int n_threads);

}  // namespace hybrimoe
