"""Routing replay from a trace (``--replay-trace``; patch 0002, docs/design.md §8): the model's MoE layers see
exactly the trace's expert ids, for upstream's placements and the engine alike; mismatched traces are refused."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

TRACE_KNOBS = dict(n_layer=27, n_expert=64, n_expert_used=6, n_shared=2)  # DeepSeek-V2-Lite's routing shape


@pytest.fixture(scope="module")
def trace_path(dev_trace):
    return dev_trace


@pytest.fixture
def small_trace(tmp_path):
    """A 40-token trace over 2 MoE layers of 8 experts, top-2 (the fixture qwen3moe's shape)."""
    def make(n_layers=2, n_experts=8, top_k=2, n_tokens=40, seed=0):
        rng = np.random.default_rng(seed)
        ids = np.stack([np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(n_layers)])
                        for _ in range(n_tokens)]).astype(np.int16)
        p = tmp_path / f"trace-{n_layers}-{n_experts}-{top_k}.npz"
        np.savez(p, expert_ids=ids, prompt_offsets=np.array([0, n_tokens]), num_experts=n_experts, top_k=top_k,
                 expert_bytes=np.full(n_layers, 1e6), format_version=1)
        return p, ids
    return make


def test_replay_forces_the_trace_ids(tiny_model, trace_path):
    from hybrimoe import Llama
    from hybrimoe.traces.format import load_trace
    from hybrimoe.traces.routing_replay import routing_replay_table

    path = tiny_model("deepseek2", "Q8_0", **TRACE_KNOBS)
    tr = load_trace(trace_path)
    table = routing_replay_table(tr, path)
    llm = Llama(str(path), moe_replay=table, moe_hook=True, n_ctx=256, n_ubatch=16, verbose=False)
    try:
        llm.moe_hook.set_recording(True)
        n = 37
        toks = llm.tokenize(b"hello " * 40, add_bos=True)[:n]
        llm.eval(toks)
        st = llm.moe_stats()
        moe_layers = [il for il in range(27) if il >= 1]
        for i, il in enumerate(moe_layers[:-1]):
            rec = llm.moe_hook.recorded(il)
            assert np.array_equal(rec, tr.expert_ids[:n, i, :].astype(np.int32)), il
            assert st["tokens"][il] == n
        last = llm.moe_hook.recorded(moe_layers[-1])  # the last layer computes the output row only
        assert np.array_equal(last[-1], tr.expert_ids[n - 1, -1, :].astype(np.int32))
    finally:
        llm.close()


def test_replay_with_the_engine(tiny_model, small_trace, rpc_server):
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import slot_bytes
    from hybrimoe.traces.routing_replay import routing_replay_table

    path = tiny_model("qwen3moe", "Q8_0")
    tp, ids = small_trace()
    llm = Llama(str(path), moe_replay=routing_replay_table(tp, path), rpc_servers=rpc_server.endpoint, n_gpu_layers=-1,
                moe_cache=4 * slot_bytes(path), moe_policy="gpu-on-demand", n_ctx=256, verbose=False)
    try:
        llm.moe_hook.set_recording(True)
        toks = llm.tokenize(b"hello " * 20, add_bos=True)[:12]
        llm.eval(toks)
        assert np.array_equal(llm.moe_hook.recorded(0), ids[:12, 0, :].astype(np.int32))
        assert llm.moe_stats()["engine"]["gpu_experts"] > 0
    finally:
        llm.close()


def test_cli_says_the_text_is_meaningless(tiny_model, small_trace, tmp_path):
    path = tiny_model("qwen3moe", "Q8_0")
    tp, _ = small_trace()
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "run", "-m", str(path), "-n", "4", "--temp", "0",
                        "--replay-trace", str(tp)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "routing replayed" in r.stderr and "meaningless" in r.stderr


@pytest.mark.parametrize("shape, match", [(dict(n_layers=3), "has 3 MoE layers, the model .* has 2"),
                                          (dict(n_experts=6), "routes over 6 experts, the model has 8"),
                                          (dict(top_k=1), "top-k 1, the model 2")])
def test_mismatched_trace_is_refused(shape, match, tiny_model, small_trace, tmp_path):
    from hybrimoe.traces.routing_replay import routing_replay_table

    path = tiny_model("qwen3moe", "Q8_0")
    tp, _ = small_trace(**shape)
    with pytest.raises(ValueError, match=match):
        routing_replay_table(tp, path)
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "run", "-m", str(path), "-n", "2",
                        "--replay-trace", str(tp)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 1 and "--replay-trace" in r.stderr


def test_missing_trace(tiny_model, tmp_path):
    from hybrimoe.traces.routing_replay import routing_replay_table

    with pytest.raises(FileNotFoundError):
        routing_replay_table(tmp_path / "nope.npz", tiny_model("qwen3moe", "Q8_0"))
