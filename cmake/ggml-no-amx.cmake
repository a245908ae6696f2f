# Included right after ggml's project() call (CMAKE_PROJECT_ggml_INCLUDE) in the builds of ggml-cpu that hybrimoe
# runs: hybrimoe's own (cmake/llama.cmake) and CI's llama-cpp-python (.ci/lean-llama-cpp-python.cmake).
#
# Compiles ggml-cpu without its AMX kernels (amx/amx.cpp, amx/mmq.cpp: compiled when the compiler defines
# __AMX_INT8__, which GGML_NATIVE's -march=native does on Intel Sapphire Rapids and later). On some of those
# machines, virtual ones among them, upstream's ggml_backend_amx_mul_mat segfaults in the first graph that uses the
# AMX weight buffer (llama.cpp issue 20824; Ollama and DSPy took the AMX build out for the same crash). The engine
# never uses that buffer (it loads with use_extra_bufts off: experts are copied as stored), so only CPU-only runs
# that repack their weights lose AMX; they keep the AVX-512 kernels and the CPU_REPACK buffer. Explicit -mno-*
# flags win over -march=native's whatever their order (GCC and Clang).
include(CheckCCompilerFlag)
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64|x86|i[3-6]86)$" AND CMAKE_C_COMPILER_ID MATCHES "GNU|Clang")
    check_c_compiler_flag("-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" HYBRIMOE_CC_NO_AMX)
    if(HYBRIMOE_CC_NO_AMX)
        add_compile_options(-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
    endif()
endif()
