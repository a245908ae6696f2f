// Shared declarations of the hybrimoe._engine bindings (runtime: src/runtime). One file per bound concept, as
// bindings/core/ is; module.cpp defines the module and calls each bind_* in registration order.
#pragma once

#include "llama.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>

namespace py = pybind11;

namespace hybrimoe_bind {

void bind_moe_hook(py::module_ & m);
void bind_engine(py::module_ & m);
void bind_calibration(py::module_ & m);
void bind_routing_replay(py::module_ & m);
void bind_routing_recorder(py::module_ & m);

/// The llama_context behind llama-cpp-python's Llama._ctx.ctx (a ctypes c_void_p passed as an int).
/// Throws std::invalid_argument (ValueError) on NULL.
inline llama_context * ctx_from(uintptr_t ptr) {
    if (ptr == 0) {
        throw std::invalid_argument("llama_context pointer is NULL (model closed?)");
    }
    return reinterpret_cast<llama_context *>(ptr);
}

}  // namespace hybrimoe_bind
