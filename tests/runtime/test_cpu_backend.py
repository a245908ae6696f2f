"""hybrimoe's ggml-cpu (hybrimoe/lib/libggml-cpu.so.0, cmake/llama.cmake) is the CPU backend of every process that
imports hybrimoe, and it is built without upstream's AMX kernels (cmake/ggml-no-amx.cmake): on some Intel Sapphire
Rapids machines ggml_backend_amx_mul_mat segfaults in the first graph that reads the AMX weight buffer (llama.cpp
issue 20824). Each check runs in a child process, so that a crash fails the test instead of the session."""
from __future__ import annotations

import subprocess
import sys


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_cpu_backend_reports_no_amx_with_hybrimoe_loaded():
    r = _child("import hybrimoe, llama_cpp; print(llama_cpp.llama_print_system_info().decode())")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CPU :" in r.stdout and "AVX" in r.stdout, r.stdout
    assert "AMX_INT8 = 1" not in r.stdout, f"hybrimoe's ggml-cpu was built with the AMX kernels: {r.stdout}"


def test_a_cpu_only_run_with_repacked_weights_generates(tiny_model):
    """Without an accelerator the weights go to ggml's extra CPU buffer types (repacking), which is where the AMX
    buffer would be chosen on an AMX machine; the run must finish and give tokens."""
    model = tiny_model("qwen3moe", "Q8_0")
    r = _child("import hybrimoe\n"
               f"llm = hybrimoe.Llama({str(model)!r}, n_ctx=128, verbose=False)\n"
               "out = llm('Once upon a time', max_tokens=8, temperature=0)\n"
               "print(out['usage']['completion_tokens'])")
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert int(r.stdout.split()[-1]) > 0
