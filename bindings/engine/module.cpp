// pybind11 module hybrimoe._engine: the runtime side that links our patched libllama.
// The llama_context pointer comes from llama-cpp-python (Llama._ctx.ctx, a ctypes c_void_p) as an int.
//
// The policy core's classes (CostModel, ExpertCache, the policies) are bound once, by hybrimoe._core; this module
// imports it first and takes those objects as they are: both modules link the one libhybrimoe_policy.so, so the
// C++ types behind _core's Python classes are the types the engine uses, and pybind11 (one registry per
// interpreter) converts them for the arguments below.
#include "common.h"

PYBIND11_MODULE(_engine, m) {
    m.doc() = "hybrimoe runtime: the MoE hook and routing replay installed into a llama_context "
              "(vendor/llama.cpp/patches 0001 and 0002).";
    // registers the policy core's classes, which Engine's arguments are
    py::module_::import("hybrimoe._core");
    // in this order: a signature names the Python class of a type bound before it (pybind11 writes docstrings
    // when a function is defined)
    hybrimoe_bind::bind_moe_hook(m);
    hybrimoe_bind::bind_engine(m);
    hybrimoe_bind::bind_calibration(m);
    hybrimoe_bind::bind_routing_replay(m);
    hybrimoe_bind::bind_routing_recorder(m);
}
