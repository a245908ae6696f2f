// Upstream's repacked CPU weight layout (ggml-cpu's CPU_REPACK buffer type, repack.cpp): which matrices it takes,
// and putting a matrix into it.
//
// llama.cpp offers CPU weights ggml-cpu's "extra" buffer types before the plain CPU one (make_cpu_buft_list,
// src/llama-model.cpp); CPU_REPACK interleaves a matrix's rows in groups of 4 or 8 for its gemv/gemm kernels when it
// has kernels for the type and row count on this CPU (ggml_repack_get_optimal_repack_type), and marks the tensor by
// giving it its traits (tensor->extra). A tensor that lives in such a buffer computes with the repacked kernels.
#pragma once

#include "ggml-backend.h"
#include "ggml.h"

#include <cstdint>

namespace hybrimoe {

/// ggml-cpu's CPU_REPACK buffer type in this process, or nullptr (no CPU backend, or built without repacking).
ggml_backend_buffer_type_t repack_buffer_type();

/// Whether `t` lives in the CPU_REPACK buffer with a repacked layout (its rows interleaved for the repacked
/// kernels, not the file's layout).
bool is_repacked(const ggml_tensor * t);

/// Whether ggml-cpu in this process repacks a weight matrix of `type` with rows of `ne0` values and `ne1` rows when
/// llama.cpp puts it in the CPU_REPACK buffer (asks the buffer type itself, ggml_backend_buffer_init_tensor: its
/// kernels depend on the type, the row count and this CPU's features). False when there is no such buffer type.
bool cpu_repacks(ggml_type type, int64_t ne0, int64_t ne1);

/// A small buffer of the CPU_REPACK type whose only use is its identity: a tensor that points elsewhere (a RAM slot
/// of the engine's) but names this buffer computes with the repacked kernels, and ggml_backend_tensor_set through it
/// repacks bytes into that tensor's memory. nullptr without the buffer type. Free with ggml_backend_buffer_free.
ggml_backend_buffer_t new_repack_marker();

/// Repacks one [ne0, ne1] matrix of `type` from the file's layout at `src` into `dst` (the same number of bytes,
/// ggml_row_size(type, ne0) * ne1), as the CPU_REPACK buffer does at load (the buffer type's set_tensor). `marker`:
/// new_repack_marker()'s buffer. Thread-safe. Returns false when this CPU has no repacked layout for it.
bool repack_matrix(ggml_backend_buffer_t marker, ggml_type type, int64_t ne0, int64_t ne1, const void * src,
                   void * dst);

}  // namespace hybrimoe
