#include "runtime/calibration.h"

#include "ggml-alloc.h"
#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace hybrimoe {

double measure_h2d_s(ggml_backend_dev_t device, size_t bytes, int reps) {
    if (!device || bytes == 0 || reps < 1) throw std::invalid_argument("measure_h2d_s: device, bytes and reps needed");
    ggml_backend_t be = ggml_backend_dev_init(device, nullptr);
    if (!be) throw std::runtime_error(std::string("cannot initialise device ") + ggml_backend_dev_name(device));
    ggml_init_params ip = {ggml_tensor_overhead() * 2, nullptr, true};
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * t = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) bytes);
    ggml_backend_buffer_t dbuf = ggml_backend_alloc_ctx_tensors(ctx, be);
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(device, &props);
    ggml_backend_buffer_type_t hbt = props.caps.host_buffer ? ggml_backend_dev_host_buffer_type(device) : nullptr;
    ggml_backend_buffer_t hbuf = hbt ? ggml_backend_buft_alloc_buffer(hbt, bytes) : nullptr;
    std::vector<uint8_t> pageable;
    uint8_t * src = nullptr;
    if (hbuf) {
        src = (uint8_t *) ggml_backend_buffer_get_base(hbuf);
    } else {
        pageable.assign(bytes, 1);
        src = pageable.data();
    }
    std::vector<double> times;
    if (dbuf) {
        std::memset(src, 1, bytes);
        for (int i = 0; i < reps + 1; ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            ggml_backend_tensor_set(t, src, 0, bytes);
            ggml_backend_synchronize(be);
            const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (i > 0) times.push_back(dt);  // the first copy pays one-time costs
        }
    }
    if (hbuf) ggml_backend_buffer_free(hbuf);
    if (dbuf) ggml_backend_buffer_free(dbuf);
    ggml_free(ctx);
    ggml_backend_free(be);
    if (times.empty()) throw std::runtime_error("cannot allocate " + std::to_string(bytes) + " bytes on the device");
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
}

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Device resources of measure_copy_overlap, freed in one place whatever throws.
struct OverlapRig {
    ggml_backend_t compute = nullptr, copy = nullptr;
    ggml_context * data_ctx = nullptr;
    ggml_backend_buffer_t data_buf = nullptr, host_buf = nullptr;
    ggml_context * graph_ctx = nullptr;
    ggml_gallocr_t galloc = nullptr;
    std::vector<uint8_t> pageable;
    ~OverlapRig() {
        if (galloc) ggml_gallocr_free(galloc);
        if (graph_ctx) ggml_free(graph_ctx);
        if (host_buf) ggml_backend_buffer_free(host_buf);
        if (data_buf) ggml_backend_buffer_free(data_buf);
        if (data_ctx) ggml_free(data_ctx);
        if (copy) ggml_backend_free(copy);
        if (compute) ggml_backend_free(compute);
    }
};

}  // namespace

double measure_copy_overlap(ggml_backend_dev_t device, size_t bytes, int reps) {
    if (!device || bytes == 0 || reps < 1) {
        throw std::invalid_argument("measure_copy_overlap: device, bytes and reps needed");
    }
    const std::string name = ggml_backend_dev_name(device);
    OverlapRig r;
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
    {
        std::vector<float> v((size_t) (N * N));
        for (size_t i = 0; i < v.size(); ++i) v[i] = (float) ((i * 2654435761u) % 1000) / 1000.0f / (float) N;
        ggml_backend_tensor_set(a, v.data(), 0, ggml_nbytes(a));
        ggml_backend_tensor_set(b, v.data(), 0, ggml_nbytes(b));
    }
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(device, &props);
    ggml_backend_buffer_type_t hbt = props.caps.host_buffer ? ggml_backend_dev_host_buffer_type(device) : nullptr;
    r.host_buf = hbt ? ggml_backend_buft_alloc_buffer(hbt, bytes) : nullptr;
    uint8_t * src = nullptr;
    if (r.host_buf) {
        src = (uint8_t *) ggml_backend_buffer_get_base(r.host_buf);
    } else {
        r.pageable.assign(bytes, 0);
        src = r.pageable.data();
    }
    std::memset(src, 1, bytes);

    auto copy_once = [&]() {
        ggml_backend_tensor_set_async(r.copy, dst, src, 0, bytes);
    };
    // a chain of n products, rebuilt when n changes (each product reads the previous one: no parallel shortcut)
    int64_t built = 0;
    ggml_cgraph * gf = nullptr;
    ggml_tensor * out = nullptr;  // the chain's last product
    auto build = [&](int64_t n) {
        if (n == built) return;
        if (r.galloc) ggml_gallocr_free(r.galloc);
        if (r.graph_ctx) ggml_free(r.graph_ctx);
        r.galloc = nullptr;
        ggml_init_params gp = {ggml_tensor_overhead() * (size_t) (n + 8) + ggml_graph_overhead_custom((size_t) n + 8,
                                                                                                      false),
                               nullptr, true};
        r.graph_ctx = ggml_init(gp);
        ggml_tensor * c = b;
        for (int64_t i = 0; i < n; ++i) c = ggml_mul_mat(r.graph_ctx, a, c);  // [N, M]
        gf = ggml_new_graph_custom(r.graph_ctx, (size_t) n + 8, false);
        ggml_build_forward_expand(gf, c);
        out = c;
        r.galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(r.compute));
        if (!ggml_gallocr_alloc_graph(r.galloc, gf)) throw std::runtime_error("cannot allocate a graph on " + name);
        built = n;
    };
    auto compute_once = [&]() {
        if (ggml_backend_graph_compute_async(r.compute, gf) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("a compute on " + name + " failed");
        }
    };
    // done means done: synchronize, then read a few bytes back (a backend whose synchronize returns before queued
    // work ends, as ggml's RPC client's does, answers a read only after it)
    auto finish = [&]() {
        ggml_backend_synchronize(r.copy);
        ggml_backend_synchronize(r.compute);
        uint8_t probe[4];
        ggml_backend_tensor_get(dst, probe, 0, std::min<size_t>(sizeof probe, bytes));
        if (out) ggml_backend_tensor_get(out, probe, 0, sizeof probe);
    };
    auto timed = [&](bool do_copy, bool do_compute) {
        const auto t0 = std::chrono::steady_clock::now();
        if (do_copy) copy_once();
        if (do_compute) compute_once();
        finish();
        return seconds_since(t0);
    };
    // the copy's time, then a chain that takes about as long (at most 4096 products)
    copy_once();
    finish();
    std::vector<double> th;
    for (int i = 0; i < reps; ++i) th.push_back(timed(true, false));
    const double t_h = median(th);
    build(1);
    compute_once();
    finish();
    const double t1 = std::max(1e-7, timed(false, true));
    build(std::max<int64_t>(1, std::min<int64_t>(4096, (int64_t) std::llround(t_h / t1))));
    compute_once();
    finish();
    std::vector<double> ov;
    for (int i = 0; i < reps; ++i) {
        const double c = timed(false, true), h = timed(true, false), both = timed(true, true);
        ov.push_back(std::max(0.0, std::min(1.0, (h + c - both) / std::max(1e-9, std::min(h, c)))));
    }
    return median(ov);
}

namespace {

// Resources of measure_cpu_copy_overlap, freed in one place whatever throws.
struct HostOverlapRig {
    ggml_backend_t cpu = nullptr, copy = nullptr;
    ggml_context * dev_ctx = nullptr, * cpu_ctx = nullptr, * graph_ctx = nullptr;
    ggml_backend_buffer_t dev_buf = nullptr, cpu_buf = nullptr, host_buf = nullptr;
    ggml_gallocr_t galloc = nullptr;
    ggml_backend_event_t event = nullptr;
    std::vector<uint8_t> pageable;
    ~HostOverlapRig() {
        if (event) ggml_backend_event_free(event);
        if (galloc) ggml_gallocr_free(galloc);
        if (graph_ctx) ggml_free(graph_ctx);
        if (host_buf) ggml_backend_buffer_free(host_buf);
        if (cpu_buf) ggml_backend_buffer_free(cpu_buf);
        if (dev_buf) ggml_backend_buffer_free(dev_buf);
        if (cpu_ctx) ggml_free(cpu_ctx);
        if (dev_ctx) ggml_free(dev_ctx);
        if (copy) ggml_backend_free(copy);
        if (cpu) ggml_backend_free(cpu);
    }
};

}  // namespace

double measure_cpu_copy_overlap(ggml_backend_dev_t device, size_t bytes, int reps, int n_threads) {
    if (!device || bytes == 0 || reps < 1 || n_threads < 1) {
        throw std::invalid_argument("measure_cpu_copy_overlap: device, bytes, reps and n_threads needed");
    }
    const std::string name = ggml_backend_dev_name(device);
    ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu_dev) throw std::runtime_error("no CPU backend");
    HostOverlapRig r;
    r.cpu = ggml_backend_dev_init(cpu_dev, nullptr);
    r.copy = ggml_backend_dev_init(device, nullptr);
    if (!r.cpu || !r.copy) throw std::runtime_error("cannot initialise device " + name + " or the CPU backend");
    {
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu_dev);
        auto set_threads = (void (*)(ggml_backend_t, int)) ggml_backend_reg_get_proc_address(reg,
                                                                                           "ggml_backend_set_n_threads");
        if (set_threads) set_threads(r.cpu, n_threads);
    }
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(device, &props);
    if (props.caps.events) r.event = ggml_backend_event_new(device);

    ggml_init_params ip = {ggml_tensor_overhead() * 4, nullptr, true};
    r.dev_ctx = ggml_init(ip);
    ggml_tensor * dst = ggml_new_tensor_1d(r.dev_ctx, GGML_TYPE_I8, (int64_t) bytes);
    r.dev_buf = ggml_backend_alloc_ctx_tensors(r.dev_ctx, r.copy);
    if (!r.dev_buf) throw std::runtime_error("cannot allocate " + std::to_string(bytes) + " bytes on " + name);
    constexpr int64_t N = 2048;  // [N, N] F32: 16 MiB, read once per product
    r.cpu_ctx = ggml_init(ip);
    ggml_tensor * a = ggml_new_tensor_2d(r.cpu_ctx, GGML_TYPE_F32, N, N);
    ggml_tensor * v = ggml_new_tensor_1d(r.cpu_ctx, GGML_TYPE_F32, N);
    r.cpu_buf = ggml_backend_alloc_ctx_tensors(r.cpu_ctx, r.cpu);
    if (!r.cpu_buf) throw std::runtime_error("cannot allocate the CPU operands");
    {
        std::vector<float> w((size_t) (N * N));
        for (size_t i = 0; i < w.size(); ++i) w[i] = (float) ((i * 2654435761u) % 1000) / 1000.0f / (float) N;
        ggml_backend_tensor_set(a, w.data(), 0, ggml_nbytes(a));
        ggml_backend_tensor_set(v, w.data(), 0, ggml_nbytes(v));
    }
    ggml_backend_buffer_type_t hbt = props.caps.host_buffer ? ggml_backend_dev_host_buffer_type(device) : nullptr;
    r.host_buf = hbt ? ggml_backend_buft_alloc_buffer(hbt, bytes) : nullptr;
    uint8_t * src = nullptr;
    if (r.host_buf) {
        src = (uint8_t *) ggml_backend_buffer_get_base(r.host_buf);
    } else {
        r.pageable.assign(bytes, 0);
        src = r.pageable.data();
    }
    std::memset(src, 1, bytes);

    // as the engine's slot pool copies: queued on the copy instance with an event when the device has events,
    // else a blocking set
    auto copy_start = [&]() {
        if (r.event) {
            ggml_backend_tensor_set_async(r.copy, dst, src, 0, bytes);
            ggml_backend_event_record(r.event, r.copy);
        } else {
            ggml_backend_tensor_set(dst, src, 0, bytes);
        }
    };
    auto copy_wait = [&]() {
        if (r.event) ggml_backend_event_synchronize(r.event);
        ggml_backend_synchronize(r.copy);
        uint8_t probe[4];  // a backend whose synchronize returns early answers a read only after the copy
        ggml_backend_tensor_get(dst, probe, 0, std::min<size_t>(sizeof probe, bytes));
    };
    int64_t built = 0;
    ggml_cgraph * gf = nullptr;
    auto build = [&](int64_t n) {
        if (n == built) return;
        if (r.galloc) ggml_gallocr_free(r.galloc);
        if (r.graph_ctx) ggml_free(r.graph_ctx);
        r.galloc = nullptr;
        ggml_init_params gp = {ggml_tensor_overhead() * (size_t) (2 * n + 8) +
                                   ggml_graph_overhead_custom((size_t) (2 * n + 8), false),
                               nullptr, true};
        r.graph_ctx = ggml_init(gp);
        ggml_tensor * c = v;
        for (int64_t i = 0; i < n; ++i) c = ggml_scale(r.graph_ctx, ggml_mul_mat(r.graph_ctx, a, c), 0.5f);
        gf = ggml_new_graph_custom(r.graph_ctx, (size_t) (2 * n + 8), false);
        ggml_build_forward_expand(gf, c);
        r.galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(r.cpu));
        if (!ggml_gallocr_alloc_graph(r.galloc, gf)) throw std::runtime_error("cannot allocate the CPU graph");
        built = n;
    };
    auto compute = [&]() {
        if (ggml_backend_graph_compute(r.cpu, gf) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("a CPU compute failed");
        }
    };
    auto timed = [&](bool do_copy, bool do_compute) {
        const auto t0 = std::chrono::steady_clock::now();
        if (do_copy) copy_start();
        if (do_compute) compute();
        if (do_copy) copy_wait();
        return seconds_since(t0);
    };
    copy_start();
    copy_wait();
    std::vector<double> th;
    for (int i = 0; i < reps; ++i) th.push_back(timed(true, false));
    const double t_h = median(th);
    build(1);
    compute();
    const double t1 = std::max(1e-7, timed(false, true));
    build(std::max<int64_t>(1, std::min<int64_t>(4096, (int64_t) std::llround(t_h / t1))));
    compute();
    std::vector<double> ov;
    for (int i = 0; i < reps; ++i) {
        const double c = timed(false, true), h = timed(true, false), both = timed(true, true);
        ov.push_back(std::max(0.0, std::min(1.0, (h + c - both) / std::max(1e-9, std::min(h, c)))));
    }
    return median(ov);
}

}  // namespace hybrimoe
