#include "runtime/cpu_layout.h"

#include <cstring>

namespace hybrimoe {

namespace {

// A [ne0, ne1] matrix of `type` at `data`, in `buf`, with the buffer type's traits when it repacks it.
ggml_tensor matrix_in(ggml_backend_buffer_t buf, ggml_type type, int64_t ne0, int64_t ne1, void * data) {
    ggml_tensor t{};
    t.type = type;
    t.ne[0] = ne0;
    t.ne[1] = ne1;
    t.ne[2] = t.ne[3] = 1;
    t.nb[0] = ggml_type_size(type);
    t.nb[1] = ggml_row_size(type, ne0);
    t.nb[2] = t.nb[3] = t.nb[1] * (size_t) ne1;
    t.buffer = buf;
    t.data = data;
    if (ggml_backend_buffer_init_tensor(buf, &t) != GGML_STATUS_SUCCESS) t.extra = nullptr;
    return t;
}

}  // namespace

ggml_backend_buffer_type_t repack_buffer_type() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) return nullptr;
    auto get_extra = (ggml_backend_buffer_type_t * (*)(ggml_backend_dev_t)) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t * b = get_extra ? get_extra(cpu) : nullptr; b && *b; ++b) {
        if (std::strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) return *b;
    }
    return nullptr;
}

bool is_repacked(const ggml_tensor * t) {
    // its buffers are not host buffers, and only a tensor it has kernels for gets traits
    if (!t || !t->buffer || t->extra == nullptr || ggml_backend_buffer_is_host(t->buffer)) return false;
    return ggml_backend_buffer_get_type(t->buffer) == repack_buffer_type();
}

ggml_backend_buffer_t new_repack_marker() {
    ggml_backend_buffer_type_t buft = repack_buffer_type();
    return buft ? ggml_backend_buft_alloc_buffer(buft, 64) : nullptr;
}

bool cpu_repacks(ggml_type type, int64_t ne0, int64_t ne1) {
    if (ne0 % ggml_blck_size(type) != 0) return false;
    ggml_backend_buffer_t buf = new_repack_marker();
    if (!buf) return false;
    // nothing is written: the tensor's data is never touched
    const bool ok = matrix_in(buf, type, ne0, ne1, ggml_backend_buffer_get_base(buf)).extra != nullptr;
    ggml_backend_buffer_free(buf);
    return ok;
}

bool repack_matrix(ggml_backend_buffer_t marker, ggml_type type, int64_t ne0, int64_t ne1, const void * src,
                   void * dst) {
    if (!marker) return false;
    ggml_tensor t = matrix_in(marker, type, ne0, ne1, dst);
    if (t.extra == nullptr) return false;
    ggml_backend_tensor_set(&t, src, 0, ggml_nbytes(&t));  // the buffer type's set_tensor: repack into t.data
    return true;
}

}  // namespace hybrimoe
