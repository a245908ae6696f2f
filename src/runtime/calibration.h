// Device measurements for the cost model (hybrimoe calibrate, hybrimoe/calibrate.py; HYBRIMOE.md §1 "h2d").
#pragma once

#include "ggml-backend.h"

#include <cstddef>

namespace hybrimoe {

/// Seconds per host-to-device copy of `bytes` to `device` (median of `reps` timed copies, each followed by a
/// synchronize; one untimed copy first), from the device's pinned host buffer type when it has one
/// (ggml_backend_dev_get_props caps.host_buffer), else from pageable memory. Throws std::invalid_argument on a null
/// device, 0 bytes or reps < 1, std::runtime_error when the device or the buffers fail.
double measure_h2d_s(ggml_backend_dev_t device, size_t bytes, int reps);

}  // namespace hybrimoe
