# Obtain the pinned, verified, patched llama.cpp tree (vendor/llama.cpp/prepare_source.py), then build from it
# only what hybrimoe adds: libllama (patched), the RPC backend module and server, and the engine module.

file(GLOB HYBRIMOE_PATCHES CONFIGURE_DEPENDS "${CMAKE_SOURCE_DIR}/vendor/llama.cpp/patches/*.patch")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
    "${CMAKE_SOURCE_DIR}/vendor/llama.cpp/pin.json"
    "${CMAKE_SOURCE_DIR}/vendor/llama.cpp/prepare_source.py"
    ${HYBRIMOE_PATCHES})

execute_process(
    COMMAND "${Python_EXECUTABLE}" "${CMAKE_SOURCE_DIR}/vendor/llama.cpp/prepare_source.py"
    OUTPUT_VARIABLE HYBRIMOE_LLAMA_OUT
    RESULT_VARIABLE HYBRIMOE_LLAMA_RC
    OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT HYBRIMOE_LLAMA_RC EQUAL 0)
    message(FATAL_ERROR "hybrimoe: could not prepare the llama.cpp source (see the [hybrimoe] lines above)")
endif()
string(REGEX REPLACE ".*\n" "" HYBRIMOE_LLAMA_SRC "${HYBRIMOE_LLAMA_OUT}")
message(STATUS "hybrimoe: llama.cpp source: ${HYBRIMOE_LLAMA_SRC}")

# ggml here is a link-time stand-in: CPU only, every backend a loadable module, never installed. At run time
# libllama resolves libggml.so.0 / libggml-base.so.0 to llama-cpp-python's (built with the user's CMAKE_ARGS).
# Whatever CMAKE_ARGS asked for (e.g. -DGGML_CUDA=on, meant for llama-cpp-python) is overridden here, so the
# CUDA backend is compiled once, by llama-cpp-python.
set(BUILD_SHARED_LIBS ON CACHE BOOL "" FORCE)
foreach(opt GGML_CUDA GGML_HIP GGML_MUSA GGML_VULKAN GGML_METAL GGML_SYCL GGML_OPENCL GGML_CANN GGML_BLAS
            GGML_WEBGPU GGML_ZDNN GGML_HEXAGON GGML_OPENVINO GGML_VIRTGPU GGML_NATIVE GGML_RPC_RDMA
            GGML_CPU_ALL_VARIANTS LLAMA_BUILD_TESTS LLAMA_BUILD_TOOLS LLAMA_BUILD_EXAMPLES LLAMA_BUILD_SERVER
            LLAMA_BUILD_APP LLAMA_BUILD_COMMON LLAMA_BUILD_MTMD LLAMA_OPENSSL LLAMA_CURL LLAMA_ALL_WARNINGS)
    set(${opt} OFF CACHE BOOL "forced by hybrimoe" FORCE)
endforeach()
set(GGML_BACKEND_DL ON CACHE BOOL "forced by hybrimoe" FORCE)
set(GGML_CPU OFF CACHE BOOL "forced by hybrimoe: the CPU backend at run time is llama-cpp-python's" FORCE)
set(GGML_RPC ON CACHE BOOL "forced by hybrimoe" FORCE)
set(LLAMA_BUILD_NUMBER 0 CACHE STRING "" FORCE)

add_subdirectory("${HYBRIMOE_LLAMA_SRC}" llama.cpp EXCLUDE_FROM_ALL)

# installed layout: site-packages/hybrimoe/lib/{libllama.so, libggml-rpc.so, ggml-rpc-server}
#                   site-packages/llama_cpp/lib/{libggml.so*, libggml-base.so*, backends}  (llama-cpp-python)
set(HYBRIMOE_RPATH "$ORIGIN;$ORIGIN/../../llama_cpp/lib")

set_target_properties(llama PROPERTIES INSTALL_RPATH "${HYBRIMOE_RPATH}")
# one file, libllama.so (soname libllama.so), as llama-cpp-python's loader expects: unset upstream's versions
set_property(TARGET llama PROPERTY VERSION)
set_property(TARGET llama PROPERTY SOVERSION)
install(TARGETS llama LIBRARY DESTINATION "${HYBRIMOE_PKG_DIR}/lib")

set_target_properties(ggml-rpc PROPERTIES INSTALL_RPATH "${HYBRIMOE_RPATH}")
install(TARGETS ggml-rpc LIBRARY DESTINATION "${HYBRIMOE_PKG_DIR}/lib")

add_executable(ggml-rpc-server "${HYBRIMOE_LLAMA_SRC}/tools/rpc/rpc-server.cpp")
target_link_libraries(ggml-rpc-server PRIVATE ggml)
add_dependencies(ggml-rpc-server ggml-rpc)
set_target_properties(ggml-rpc-server PROPERTIES INSTALL_RPATH "${HYBRIMOE_RPATH}")
install(TARGETS ggml-rpc-server RUNTIME DESTINATION "${HYBRIMOE_PKG_DIR}/lib")

file(GLOB HYBRIMOE_ENGINE_SOURCES CONFIGURE_DEPENDS
    "${CMAKE_SOURCE_DIR}/src/runtime/*.cpp" "${CMAKE_SOURCE_DIR}/bindings/engine/*.cpp")
pybind11_add_module(_engine MODULE ${HYBRIMOE_ENGINE_SOURCES})
target_include_directories(_engine PRIVATE "${CMAKE_SOURCE_DIR}/src")
target_link_libraries(_engine PRIVATE llama ggml ggml-base hybrimoe_policy)
set_target_properties(_engine PROPERTIES INSTALL_RPATH "$ORIGIN/lib;$ORIGIN/../llama_cpp/lib")
install(TARGETS _engine LIBRARY DESTINATION "${HYBRIMOE_PKG_DIR}")
