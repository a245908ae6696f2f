"""``moe_cache="auto"`` on a stand-in whose memory is limited (the RPC server's HYBRIMOE_RPC_MEMORY, patch 0006):
the slots are sized from the device memory left after the model loaded, fewer than the experts when that is all
there is, the choice is explained in moe_stats(), and a device without room is a clear error."""
from __future__ import annotations

import pytest

from hybrimoe.runtime.rpc import RPCServer


def _kw(endpoint, cost="rtx4090-desktop"):
    return dict(rpc_servers=endpoint, n_gpu_layers=-1, n_ctx=128, n_batch=32, n_ubatch=32, verbose=False,
                moe_cost_model=cost)


def test_rpc_server_reports_the_memory_it_is_given(rpc_server_factory):
    from hybrimoe import _ggml
    from hybrimoe._ggml import device_memory

    srv = rpc_server_factory(memory_bytes=123_456_789)
    dev = _ggml.accelerator(_ggml.add_rpc_server(srv.endpoint))
    free, total = device_memory(dev)
    assert total == 123_456_789 and free == total  # nothing allocated by a client yet
    with pytest.raises(ValueError, match="memory_bytes must be a positive integer"):
        RPCServer(memory_bytes=0)


def test_auto_picks_the_slots_the_memory_left_allows(tiny_model, split_cost_model, rpc_server_factory):
    """Measure what the model, KV cache and compute buffers take on the device (moe_cache=0: no slot pool), then
    give a server exactly that plus the engine's work buffers, the margin and room for half the experts: auto
    takes half the experts (not all), explains it, and runs like the same slot count given as bytes."""
    from hybrimoe import Llama
    from hybrimoe._ggml import device_memory
    from hybrimoe.envs import AUTO_MARGIN_MIN_BYTES
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.setup import auto_slots, gpu_work_bytes

    path = tiny_model("qwen3moe", "Q8_0")
    facts = engine_facts(path)
    big = 1 << 40
    srv = rpc_server_factory(memory_bytes=big)
    llm = Llama(str(path), moe_cache=0, **_kw(srv.endpoint))
    try:
        free, total = device_memory(llm.moe_setup.device)
        used = total - free
    finally:
        llm.close()
    assert used > 0
    n_all = len(facts.moe_layers) * facts.n_expert
    want = n_all // 2
    work = gpu_work_bytes(facts, 32)
    mem = used + work + AUTO_MARGIN_MIN_BYTES + (want + 1) * facts.slot_bytes
    assert auto_slots(facts, mem - used, 32)[0] == want
    srv = rpc_server_factory(memory_bytes=mem)
    llm = Llama(str(path), moe_cache="auto", **_kw(srv.endpoint, split_cost_model))
    try:
        st = llm.moe_setup
        assert st.n_slots == want < n_all and llm.moe_engine.n_slots == want
        note = llm.moe_stats()["engine"]["moe_cache"]
        assert note.startswith("auto: ") and f"{want} of {n_all} experts" in note, note
        assert st.policies.cache.budget_bytes == want * facts.slot_bytes
        auto_text = llm("Once upon a time", max_tokens=8, temperature=0)["choices"][0]["text"]
        assert llm.moe_stats()["engine"]["gpu_experts"] > 0
    finally:
        llm.close()
    srv = rpc_server_factory()
    ref = Llama(str(path), moe_cache=want * facts.slot_bytes, **_kw(srv.endpoint, split_cost_model))
    try:
        assert ref.moe_setup.n_slots == want
        assert ref("Once upon a time", max_tokens=8, temperature=0)["choices"][0]["text"] == auto_text
    finally:
        ref.close()


def test_auto_without_room_or_device_is_a_clear_error(tiny_model, rpc_server_factory):
    from hybrimoe import Llama, _ggml

    path = tiny_model("qwen3moe", "Q8_0")
    srv = rpc_server_factory(memory_bytes=64 * 1024 * 1024)  # below the margin alone
    with pytest.raises(ValueError, match="moe_cache='auto' found no room for an expert slot"):
        Llama(str(path), moe_cache="auto", **_kw(srv.endpoint))
    if _ggml.local_gpus():
        return  # this machine has a GPU: "no accelerator" cannot be shown here
    kw = _kw(None)
    kw.pop("rpc_servers")
    with pytest.raises(ValueError, match=r"moe_cache='auto' \(--moe-cache\) needs an accelerator"):
        Llama(str(path), moe_cache="auto", **kw)
