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

# The user's ggml options as given (CMAKE_ARGS, the variable llama-cpp-python's build reads too), before the forced
# settings below: hybrimoe's own ggml-cpu must be compiled as llama-cpp-python's was.
separate_arguments(HYBRIMOE_USER_CMAKE_ARGS UNIX_COMMAND "$ENV{CMAKE_ARGS}")

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
find_package(Threads REQUIRED)
target_link_libraries(_engine PRIVATE llama ggml ggml-base hybrimoe_policy Threads::Threads)
set_target_properties(_engine PROPERTIES INSTALL_RPATH "$ORIGIN/lib;$ORIGIN/../llama_cpp/lib")
install(TARGETS _engine LIBRARY DESTINATION "${HYBRIMOE_PKG_DIR}")

# ---- hybrimoe's ggml-cpu (patch 0005: mul_mat_id skips negative expert ids) ---------------------------------------
# Built from the same patched tree as llama-cpp-python builds its ggml (a top-level llama.cpp configure with
# llama-cpp-python's defaults plus the user's CMAKE_ARGS, GPU backends off), so kernels and numbers are the same
# (without the AMX kernels, which only repacked CPU weights use: cmake/ggml-no-amx.cmake says why); installed as
# hybrimoe/lib/libggml-cpu.so.0 (llama-cpp-python's soname). hybrimoe loads it before llama_cpp
# (hybrimoe/_lib.py), so llama-cpp-python's libggml.so takes it for its libggml-cpu.so.0 dependency, and the engine
# checks that it did (proc address ggml_backend_cpu_skips_negative_expert_ids).
include(ExternalProject)
# one build folder per patched tree: a new patch series is a new source folder, which a configured build refuses
get_filename_component(HYBRIMOE_LLAMA_SRC_NAME "${HYBRIMOE_LLAMA_SRC}" NAME)
set(HYBRIMOE_CPU_BUILD "${CMAKE_BINARY_DIR}/ggml-cpu-build/${HYBRIMOE_LLAMA_SRC_NAME}")
# the library itself (bin/libggml-cpu.so.0 is a symlink to the versioned file), copied to a fixed name
set(HYBRIMOE_CPU_LIB "${HYBRIMOE_CPU_BUILD}/hybrimoe/libggml-cpu.so.0")
set(HYBRIMOE_CPU_ARGS
    -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_C_COMPILER=${CMAKE_C_COMPILER}
    -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}
    ${HYBRIMOE_USER_CMAKE_ARGS}
    -DBUILD_SHARED_LIBS=ON
    -DGGML_BACKEND_DL=OFF
    -DGGML_CPU=ON
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_MTMD=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
    -DLLAMA_ALL_WARNINGS=OFF -DLLAMA_BUILD_NUMBER=0
    -DGGML_CUDA=OFF -DGGML_HIP=OFF -DGGML_MUSA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_SYCL=OFF
    -DGGML_OPENCL=OFF -DGGML_CANN=OFF -DGGML_WEBGPU=OFF -DGGML_RPC=OFF -DGGML_HEXAGON=OFF -DGGML_OPENVINO=OFF
    -DGGML_VIRTGPU=OFF -DGGML_ZDNN=OFF
    -DCMAKE_SKIP_BUILD_RPATH=OFF -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
    "-DCMAKE_PROJECT_ggml_INCLUDE=${CMAKE_CURRENT_LIST_DIR}/ggml-no-amx.cmake"
    "-DCMAKE_INSTALL_RPATH=\$ORIGIN/../../llama_cpp/lib")
if(CMAKE_GENERATOR MATCHES "Ninja")
    set(HYBRIMOE_CPU_GENERATOR "${CMAKE_GENERATOR}")
else()
    set(HYBRIMOE_CPU_GENERATOR "Unix Makefiles")
endif()
ExternalProject_Add(hybrimoe_ggml_cpu
    SOURCE_DIR "${HYBRIMOE_LLAMA_SRC}"
    BINARY_DIR "${HYBRIMOE_CPU_BUILD}"
    CMAKE_GENERATOR "${HYBRIMOE_CPU_GENERATOR}"
    CMAKE_ARGS ${HYBRIMOE_CPU_ARGS}
    BUILD_COMMAND ${CMAKE_COMMAND} --build "${HYBRIMOE_CPU_BUILD}" --target ggml-cpu
    INSTALL_COMMAND ${CMAKE_COMMAND} -E copy "${HYBRIMOE_CPU_BUILD}/bin/libggml-cpu.so.0" "${HYBRIMOE_CPU_LIB}"
    BUILD_BYPRODUCTS "${HYBRIMOE_CPU_LIB}"
    BUILD_ALWAYS ON
    USES_TERMINAL_BUILD ON)
add_dependencies(_engine hybrimoe_ggml_cpu)
install(FILES "${HYBRIMOE_CPU_LIB}" DESTINATION "${HYBRIMOE_PKG_DIR}/lib" RENAME libggml-cpu.so.0)

# the combine op sums products in upstream's order and rounding: no fused multiply-add contraction
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(_engine PRIVATE -ffp-contract=off)
endif()
