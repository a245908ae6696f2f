// Shared helpers of the hybrimoe._core bindings (policy core: src/policy).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <typeinfo>

namespace py = pybind11;

namespace hybrimoe_bind {

void bind_cost_model(py::module_ & m);
void bind_scheduler(py::module_ & m);
void bind_expert_cache(py::module_ & m);
void bind_prefetcher(py::module_ & m);
void bind_simulator(py::module_ & m);

/// Python class name of the object wrapping `self` (a trampoline instance); "?" when none. Needs the GIL.
inline std::string python_class_name(const void * self, const std::type_info & ti) {
    const py::detail::type_info * tinfo = py::detail::get_type_info(ti);
    if (!tinfo) return "?";
    py::handle h = py::detail::get_object_handle(self, tinfo);
    if (!h) return "?";
    return py::str(py::type::handle_of(h).attr("__name__"));
}

/// Re-raises a Python policy's exception as RuntimeError("<kind> '<Class>'.<method> failed: ...") chained from it,
/// so the user sees which policy broke. Needs the GIL.
[[noreturn]] inline void rethrow_policy_error(py::error_already_set & err, const char * kind, const std::string & cls,
                                              const char * method) {
    // Type and message only: the traceback stays on the chained original (__cause__).
    std::string what = py::str(err.value());
    const std::string type = py::str(err.type().attr("__name__"));
    const std::string msg = std::string(kind) + " '" + cls + "'." + method + " failed: " + type + ": " + what;
    py::raise_from(err, PyExc_RuntimeError, msg.c_str());
    throw py::error_already_set();
}

}  // namespace hybrimoe_bind

/// Calls the Python override `method` of a trampoline (GIL taken), converting failures to a named error.
/// Leaves the block when no override exists. `convert` turns the returned py::object into the return value.
#define HYBRIMOE_CALL_OVERRIDE(Base, kind, method, convert, ...)                                          \
    do {                                                                                                \
        py::gil_scoped_acquire hm_gil_;                                                                 \
        py::function hm_fn_ = py::get_override(static_cast<const Base *>(this), method);                \
        if (hm_fn_) {                                                                                   \
            try {                                                                                       \
                py::object hm_ret_ = hm_fn_(__VA_ARGS__);                                               \
                return convert(hm_ret_);                                                                \
            } catch (py::error_already_set & e) {                                                       \
                hybrimoe_bind::rethrow_policy_error(e, kind,                                            \
                    hybrimoe_bind::python_class_name(static_cast<const Base *>(this), typeid(Base)), method); \
            } catch (py::cast_error & e) {                                                              \
                throw py::type_error(std::string(kind) + " '" +                                         \
                    hybrimoe_bind::python_class_name(static_cast<const Base *>(this), typeid(Base)) + "'." + \
                    method + " returned a value of the wrong type: " + e.what());                        \
            }                                                                                           \
        }                                                                                               \
    } while (0)
