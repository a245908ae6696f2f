"""The GPU slot pool split over several device buffers (src/runtime/slot_pool.*): a device caps the bytes of one
buffer (ggml_backend_buft_get_max_size: 1 GiB on Vulkan by default), so a larger pool is spread over buffers and
each GPU launch reads one. On the RPC stand-in, which has no cap, ``$HYBRIMOE_MAX_BUFFER_BYTES`` sets one; the
oracle is upstream with the same placement (bit for bit on the stand-in, as in test_engine.py)."""
from __future__ import annotations

import numpy as np
import pytest

from hybrimoe.testing.upstream import greedy_with_logits, prompt_tokens


# both sides in the file's layout (no_repack): the stand-in computes the GPU share with the plain CPU kernels, and
# upstream's repacked ones may round differently (tests/runtime/test_engine_repack.py covers repacked weights)
def _common(rpc_server, **kw):
    d = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=256, n_batch=256, n_ubatch=16, seed=0,
             verbose=False,
             no_repack=True)
    d.update(kw)
    return d


def test_pool_over_several_buffers_keeps_upstreams_numbers(tiny_model, rpc_server, split_cost_model,
                                                            monkeypatch):
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import engine_facts

    path = tiny_model("qwen3moe", "Q8_0")
    facts = engine_facts(path)
    n_all = len(facts.moe_layers) * facts.n_expert
    # two slots and a null slot per buffer (each of the three regions padded to 256 bytes)
    monkeypatch.setenv("HYBRIMOE_MAX_BUFFER_BYTES", str(3 * facts.slot_bytes + 3 * 256))
    llm = Llama(str(path), moe_cache="100%", moe_cost_model=split_cost_model, **_common(rpc_server))
    try:
        assert llm.moe_engine.slots_per_buffer == 2
        assert llm.moe_engine.slot_buffers == (n_all + 1) // 2
        tokens = prompt_tokens(llm, 40)
        out, lg = greedy_with_logits(llm, tokens)
        st = llm.moe_stats()["engine"]
        assert llm.moe_engine.slots_in_use() == llm.moe_setup.policies.cache.n_resident
    finally:
        llm.close()
    monkeypatch.delenv("HYBRIMOE_MAX_BUFFER_BYTES")
    ref = Llama(str(path), tensor_buft_overrides="exps=CPU", **_common(rpc_server))
    try:
        ref_out, ref_lg = greedy_with_logits(ref, tokens)
    finally:
        ref.close()
    assert out == ref_out
    assert np.array_equal(lg, ref_lg)
    assert st["slot_buffers"] == (n_all + 1) // 2
    assert st["gpu_experts"] > 0 and st["cpu_experts"] > 0, st
    # a run whose GPU experts lie in several buffers makes a launch per buffer
    assert sum(s["gpu_launches"] for s in st["layers"]) > sum(s["gpu_runs"] for s in st["layers"]) > 0


def test_one_buffer_without_a_cap(tiny_model, rpc_server, split_cost_model):
    from hybrimoe import Llama

    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), moe_cache="100%", moe_cost_model=split_cost_model, **_common(rpc_server))
    try:
        assert llm.moe_engine.slot_buffers == 1
        assert llm.moe_engine.slots_per_buffer == llm.moe_engine.n_slots
    finally:
        llm.close()


@pytest.mark.parametrize("value, err, match", [
    ("lots", ValueError, "HYBRIMOE_MAX_BUFFER_BYTES must be a positive number of bytes, got 'lots'"),
    ("-5", ValueError, "HYBRIMOE_MAX_BUFFER_BYTES must be a positive number"),
    ("1000", RuntimeError, r"one expert slot and its null slot need \d+ bytes, more than the 1000 bytes one device "
                           r"buffer may hold \(RPC0"),
])
def test_bad_buffer_cap_is_a_clear_error(value, err, match, tiny_model, rpc_server, split_cost_model, monkeypatch):
    from hybrimoe import Llama

    monkeypatch.setenv("HYBRIMOE_MAX_BUFFER_BYTES", value)
    with pytest.raises(err, match=match):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), moe_cache="100%", moe_cost_model=split_cost_model,
              **_common(rpc_server))
