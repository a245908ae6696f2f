#include "runtime/calibration.h"

#include "ggml-alloc.h"
#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace hybrimoe {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// The resources of one measurement, freed in one place whatever throws: up to two backends (the compute one,
// the device or the CPU, and the device's copy instance), the contexts and buffers of the copy's destination and of
// the compute's operands, the compute graph's allocation, an event, and the copy's host source.
struct Rig {
    ggml_backend_t compute = nullptr, copy = nullptr;
    ggml_context * dst_ctx = nullptr, * data_ctx = nullptr, * graph_ctx = nullptr;
    ggml_backend_buffer_t dst_buf = nullptr, data_buf = nullptr, host_buf = nullptr;
    ggml_gallocr_t galloc = nullptr;
    ggml_backend_event_t event = nullptr;
    std::vector<uint8_t> pageable;
    ~Rig() {
        if (event) ggml_backend_event_free(event);
        if (galloc) ggml_gallocr_free(galloc);
        if (graph_ctx) ggml_free(graph_ctx);
        if (host_buf) ggml_backend_buffer_free(host_buf);
        if (data_buf) ggml_backend_buffer_free(data_buf);
        if (dst_buf) ggml_backend_buffer_free(dst_buf);
        if (data_ctx) ggml_free(data_ctx);
        if (dst_ctx) ggml_free(dst_ctx);
        if (copy) ggml_backend_free(copy);
        if (compute) ggml_backend_free(compute);
    }
    // the copy's source: `bytes` of the device's pinned host buffer type when it has one, else pageable memory
    uint8_t * source(ggml_backend_dev_t device, const ggml_backend_dev_props & props, size_t bytes) {
        ggml_backend_buffer_type_t hbt = props.caps.host_buffer ? ggml_backend_dev_host_buffer_type(device) : nullptr;
        host_buf = hbt ? ggml_backend_buft_alloc_buffer(hbt, bytes) : nullptr;
        uint8_t * src = nullptr;
        if (host_buf) {
            src = (uint8_t *) ggml_backend_buffer_get_base(host_buf);
        } else {
            pageable.assign(bytes, 0);
            src = pageable.data();
        }
        std::memset(src, 1, bytes);
        return src;
    }
};

// The overlap share (t_h + t_c - t_b) / min(t_h, t_c), clamped to [0, 1], median of `reps`: timed(copy, compute)
// returns the seconds of the copy, the compute, or both together.
double overlap_share(const std::function<double(bool, bool)> & timed, int reps) {
    std::vector<double> ov;
    for (int i = 0; i < reps; ++i) {
        const double c = timed(false, true), h = timed(true, false), both = timed(true, true);
        ov.push_back(std::max(0.0, std::min(1.0, (h + c - both) / std::max(1e-9, std::min(h, c)))));
    }
    return median(ov);
}

// A chain of n nodes step(ctx, previous) from `first` on r.compute (each node reads the previous one: no parallel
// shortcut), in r.graph_ctx with its own allocation; the chain's last node in *out.
ggml_cgraph * build_chain(Rig & r, int64_t n, ggml_tensor * first, int nodes_per_step,
                          const std::function<ggml_tensor *(ggml_context *, ggml_tensor *)> & step, ggml_tensor ** out) {
    if (r.galloc) ggml_gallocr_free(r.galloc);
    if (r.graph_ctx) ggml_free(r.graph_ctx);
    r.galloc = nullptr;
    const size_t n_nodes = (size_t) (nodes_per_step * n + 8);
    ggml_init_params gp = {ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false), nullptr,
                           true};
    r.graph_ctx = ggml_init(gp);
    ggml_tensor * c = first;
    for (int64_t i = 0; i < n; ++i) c = step(r.graph_ctx, c);
    ggml_cgraph * gf = ggml_new_graph_custom(r.graph_ctx, n_nodes, false);
    ggml_build_forward_expand(gf, c);
    r.galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(r.compute));
    if (!ggml_gallocr_alloc_graph(r.galloc, gf)) throw std::runtime_error("cannot allocate a measurement graph");
    *out = c;
    return gf;
}

// Deterministic operand values in [0, 1/n) for the measurement chains.
void fill_operands(ggml_tensor * a, ggml_tensor * b, int64_t n) {
    std::vector<float> v((size_t) std::max(ggml_nelements(a), ggml_nelements(b)));
    for (size_t i = 0; i < v.size(); ++i) v[i] = (float) ((i * 2654435761u) % 1000) / 1000.0f / (float) n;
    ggml_backend_tensor_set(a, v.data(), 0, ggml_nbytes(a));
    ggml_backend_tensor_set(b, v.data(), 0, ggml_nbytes(b));
}

// Times the copy alone (median of reps) and one chain step; returns the chain length of about the copy's time
// (at most 4096 steps).
int64_t chain_length(const std::function<double(bool, bool)> & timed, const std::function<void(int64_t)> & build,
                     int reps) {
    std::vector<double> th;
    for (int i = 0; i < reps; ++i) th.push_back(timed(true, false));
    const double t_h = median(th);
    build(1);
    timed(false, true);
    const double t1 = std::max(1e-7, timed(false, true));
    return std::max<int64_t>(1, std::min<int64_t>(4096, (int64_t) std::llround(t_h / t1)));
}

}  // namespace

double measure_h2d_s(ggml_backend_dev_t device, size_t bytes, int reps) {
    if (!device || bytes == 0 || reps < 1) throw std::invalid_argument("measure_h2d_s: device, bytes and reps needed");
    Rig r;
    r.copy = ggml_backend_dev_init(device, nullptr);
    if (!r.copy) throw std::runtime_error(std::string("cannot initialise device ") + ggml_backend_dev_name(device));
    ggml_init_params ip = {ggml_tensor_overhead() * 2, nullptr, true};
    r.dst_ctx = ggml_init(ip);
    ggml_tensor * t = ggml_new_tensor_1d(r.dst_ctx, GGML_TYPE_I8, (int64_t) bytes);
    r.dst_buf = ggml_backend_alloc_ctx_tensors(r.dst_ctx, r.copy);
    if (!r.dst_buf) throw std::runtime_error("cannot allocate " + std::to_string(bytes) + " bytes on the device");
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(device, &props);
    const uint8_t * src = r.source(device, props, bytes);
    std::vector<double> times;
    for (int i = 0; i < reps + 1; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        ggml_backend_tensor_set(t, src, 0, bytes);
        ggml_backend_synchronize(r.copy);
        if (i > 0) times.push_back(seconds_since(t0));  // the first copy pays one-time costs
    }
    return median(times);
}

double measure_copy_overlap(ggml_backend_dev_t device, size_t bytes, int reps) {
    if (!device || bytes == 0 || reps < 1) {
        throw std::invalid_argument("measure_copy_overlap: device, bytes and reps needed");
    }
    const std::string name = ggml_backend_dev_name(device);
    Rig r;
    r.compute = ggml_backend_dev_init(device, nullptr);
    r.copy = ggml_backend_dev_init(device, nullptr);
    if (!r.compute || !r.copy) throw std::runtime_error("cannot initialise device " + name);
    constexpr int64_t N = 256, M = 64;  // products of [N, N] by [N, M]: 8.4 MFLOP each
    ggml_init_params ip = {ggml_tensor_overhead() * 4, nullptr, true};
    r.data_ctx = ggml_init(ip);
    ggml_tensor * dst = ggml_new_tensor_1d(r.data_ctx, GGML_TYPE_I8, (int64_t) bytes);
    ggml_tensor * a = ggml_new_tensor_2d(r.data_ctx, GGML_TYPE_F32, N, N);
    ggml_tensor * b = ggml_new_tensor_2d(r.data_ctx, GGML_TYPE_F32, N, M);
    r.data_buf = ggml_backend_alloc_ctx_tensors(r.data_ctx, r.compute);
    if (!r.data_buf) throw std::runtime_error("cannot allocate " + std::to_string(bytes) + " bytes on " + name);
    fill_operands(a, b, N);
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(device, &props);
    uint8_t * src = r.source(device, props, bytes);

    ggml_cgraph * gf = nullptr;
    ggml_tensor * out = nullptr;
    auto build = [&](int64_t n) {
        gf = build_chain(r, n, b, 1, [&](ggml_context * ctx, ggml_tensor * c) { return ggml_mul_mat(ctx, a, c); },
                         &out);
    };
    // done means done: synchronize, then read a few bytes back (a backend whose synchronize returns before queued
    // work ends, as ggml's RPC client's does, answers a read only after it)
    auto timed = [&](bool do_copy, bool do_compute) {
        const auto t0 = std::chrono::steady_clock::now();
        if (do_copy) ggml_backend_tensor_set_async(r.copy, dst, src, 0, bytes);
        if (do_compute && ggml_backend_graph_compute_async(r.compute, gf) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("a compute on " + name + " failed");
        }
        ggml_backend_synchronize(r.copy);
        ggml_backend_synchronize(r.compute);
        uint8_t probe[4];
        ggml_backend_tensor_get(dst, probe, 0, std::min<size_t>(sizeof probe, bytes));
        if (out) ggml_backend_tensor_get(out, probe, 0, sizeof probe);
        return seconds_since(t0);
    };
    timed(true, false);  // the first copy pays one-time costs
    build(chain_length(timed, build, reps));
    timed(false, true);
    return overlap_share(timed, reps);
}

double measure_cpu_copy_overlap(ggml_backend_dev_t device, size_t bytes, int reps, int n_threads) {
    if (!device || bytes == 0 || reps < 1 || n_threads < 1) {
        throw std::invalid_argument("measure_cpu_copy_overlap: device, bytes, reps and n_threads needed");
    }
    const std::string name = ggml_backend_dev_name(device);
    ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu_dev) throw std::runtime_error("no CPU backend");
    Rig r;
    r.compute = ggml_backend_dev_init(cpu_dev, nullptr);
    r.copy = ggml_backend_dev_init(device, nullptr);
    if (!r.compute || !r.copy) throw std::runtime_error("cannot initialise device " + name + " or the CPU backend");
    {
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu_dev);
        auto set_threads = (void (*)(ggml_backend_t, int)) ggml_backend_reg_get_proc_address(reg,
                                                                                           "ggml_backend_set_n_threads");
        if (set_threads) set_threads(r.compute, n_threads);
    }
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(device, &props);
    if (props.caps.events) r.event = ggml_backend_event_new(device);

    ggml_init_params ip = {ggml_tensor_overhead() * 4, nullptr, true};
    r.dst_ctx = ggml_init(ip);
    ggml_tensor * dst = ggml_new_tensor_1d(r.dst_ctx, GGML_TYPE_I8, (int64_t) bytes);
    r.dst_buf = ggml_backend_alloc_ctx_tensors(r.dst_ctx, r.copy);
    if (!r.dst_buf) throw std::runtime_error("cannot allocate " + std::to_string(bytes) + " bytes on " + name);
    constexpr int64_t N = 2048;  // [N, N] F32: 16 MiB, read once per product
    r.data_ctx = ggml_init(ip);
    ggml_tensor * a = ggml_new_tensor_2d(r.data_ctx, GGML_TYPE_F32, N, N);
    ggml_tensor * v = ggml_new_tensor_1d(r.data_ctx, GGML_TYPE_F32, N);
    r.data_buf = ggml_backend_alloc_ctx_tensors(r.data_ctx, r.compute);
    if (!r.data_buf) throw std::runtime_error("cannot allocate the CPU operands");
    fill_operands(a, v, N);
    uint8_t * src = r.source(device, props, bytes);

    ggml_cgraph * gf = nullptr;
    ggml_tensor * out = nullptr;
    auto build = [&](int64_t n) {
        gf = build_chain(r, n, v, 2, [&](ggml_context * ctx, ggml_tensor * c) {
            return ggml_scale(ctx, ggml_mul_mat(ctx, a, c), 0.5f);
        }, &out);
    };
    // the copies as the engine's slot pool queues them: on the copy instance with an event when the device has
    // events, else a blocking set; the CPU chain runs while they are in flight
    auto timed = [&](bool do_copy, bool do_compute) {
        const auto t0 = std::chrono::steady_clock::now();
        if (do_copy) {
            if (r.event) {
                ggml_backend_tensor_set_async(r.copy, dst, src, 0, bytes);
                ggml_backend_event_record(r.event, r.copy);
            } else {
                ggml_backend_tensor_set(dst, src, 0, bytes);
            }
        }
        if (do_compute && ggml_backend_graph_compute(r.compute, gf) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("a CPU compute failed");
        }
        if (do_copy) {
            if (r.event) ggml_backend_event_synchronize(r.event);
            ggml_backend_synchronize(r.copy);
            uint8_t probe[4];  // a backend whose synchronize returns early answers a read only after the copy
            ggml_backend_tensor_get(dst, probe, 0, std::min<size_t>(sizeof probe, bytes));
        }
        return seconds_since(t0);
    };
    timed(true, false);
    build(chain_length(timed, build, reps));
    timed(false, true);
    return overlap_share(timed, reps);
}

}  // namespace hybrimoe
