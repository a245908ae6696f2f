# Included right after llama.cpp's project() call when CI builds llama-cpp-python (CMAKE_PROJECT_llama.cpp_INCLUDE in
# .ci/run and .ci/vulkan). hybrimoe loads only llama-cpp-python's ggml libraries (its libllama is hybrimoe's own,
# CMakeLists.txt), so CI leaves out what llama-cpp-python's CMakeLists forces on and hybrimoe never loads: the common
# library (a normal variable shadows the cache entry that llama-cpp-python sets with FORCE, and llama.cpp's
# option() keeps it) and, with -DLLAVA_BUILD=OFF beside this file, mtmd. That is 104 of its 178 compile jobs.
set(LLAMA_BUILD_COMMON OFF)
# ggml-cpu without the AMX kernels, as hybrimoe builds its own (cmake/ggml-no-amx.cmake): the tests run plain
# llama-cpp-python as their oracle, which on some AMX machines crashes in upstream's AMX kernels
set(CMAKE_PROJECT_ggml_INCLUDE "${CMAKE_CURRENT_LIST_DIR}/../cmake/ggml-no-amx.cmake")
