#include "runtime/calibration.h"

#include "ggml-alloc.h"
#include "ggml.h"

#include <algorithm>
#include <chrono>
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

}  // namespace hybrimoe
