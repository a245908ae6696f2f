"""Placements on the accelerator stand-in (a ggml RPC server with --device CPU on 127.0.0.1, started here).

Oracle: upstream's own placements agree on short prompts (docs/design.md §12): CPU only, all layers on
the RPC device, and all layers on the device with routed experts kept in host memory (-ot exps=CPU) give the
same greedy tokens; with hybrimoe's hook on the last placement the tokens stay the same.
"""
from __future__ import annotations

import pytest

from hybrimoe.testing.upstream import greedy_text

PROMPT = "Hello world, this is"


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "deepseek2"])
def test_placements_agree(arch, tiny_model, rpc_server):
    from hybrimoe import Llama

    path = str(tiny_model(arch, "Q8_0"))
    n = 10
    common = dict(n_ctx=128, n_threads=2, n_threads_batch=2, verbose=False)

    def tokens(**kw):
        llm = Llama(path, **common, **kw)
        try:
            return greedy_text(llm, PROMPT, n), llm
        finally:
            llm.close()

    cpu, _ = tokens()
    full, _ = tokens(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1)
    hybrid, _ = tokens(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, tensor_buft_overrides="exps=CPU")
    cmoe, _ = tokens(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, cpu_moe=True)
    hooked, _ = tokens(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, cpu_moe=True, moe_hook=True)
    assert len(cpu) > 0
    assert full == cpu
    assert hybrid == cpu
    assert cmoe == cpu
    assert hooked == cpu


def _buffer_sizes(log: str) -> dict[str, float]:
    """'<buffer> model buffer size = X MiB' lines of llama.cpp's load log -> {buffer: MiB}."""
    import re

    out: dict[str, float] = {}
    for m in re.finditer(r"(\S+) model buffer size =\s+([0-9.]+) MiB", log):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def test_placements_really_differ(tiny_model, rpc_server, capfd):
    """Control for the test above: the weights really go to the device, and -ot exps=CPU really keeps the
    experts in host memory (else the three runs would be the same CPU run)."""
    from hybrimoe import Llama

    path = str(tiny_model("qwen3moe", "Q8_0"))
    kw = dict(n_ctx=128, n_threads=2, verbose=True, rpc_servers=rpc_server.endpoint, n_gpu_layers=-1)
    capfd.readouterr()
    Llama(path, **kw).close()
    full = _buffer_sizes(capfd.readouterr().err)
    Llama(path, **kw, tensor_buft_overrides="exps=CPU").close()
    hybrid = _buffer_sizes(capfd.readouterr().err)
    dev_full = sum(v for k, v in full.items() if k.startswith("RPC"))
    dev_hybrid = sum(v for k, v in hybrid.items() if k.startswith("RPC"))
    host_hybrid = sum(v for k, v in hybrid.items() if not k.startswith("RPC"))
    assert dev_full > 0, full
    assert dev_hybrid < dev_full, (full, hybrid)
    assert host_hybrid > 0, hybrid


def test_n_cpu_moe_matches_cpu(tiny_model, rpc_server):
    from hybrimoe import Llama

    path = str(tiny_model("qwen3moe", "Q8_0"))
    kw = dict(n_ctx=128, n_threads=2, verbose=False)
    llm = Llama(path, **kw)
    ref = greedy_text(llm, PROMPT, 8)
    llm.close()
    llm = Llama(path, **kw, rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_cpu_moe=1)
    got = greedy_text(llm, PROMPT, 8)
    llm.close()
    assert got == ref
