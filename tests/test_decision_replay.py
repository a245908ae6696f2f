"""Issue 5, item 5: the engine and the simulator make the same decisions. The engine logs each (MoE layer, ubatch)
(routing, router scores, expert bytes, copy-queue estimate, predictions); the simulator replays that log through
fresh policies of the same preset, budget and cost model and must reproduce every decision exactly: cached, the
planned and the run split, demand loads admitted / declined, first-use copies, prefetches, fills, evictions and
the predicted makespan. Runs on the RPC stand-in device."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from hybrimoe import _core
from hybrimoe.simulate import replay_engine_log

PRESETS = ["hybrimoe", "hybrimoe-lru", "ktransformers", "upstream-ncmoe", "gpu-on-demand"]


def _common(rpc_server, **kw):
    d = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=512, n_batch=512, n_ubatch=16, seed=0,
             verbose=False)
    d.update(kw)
    return d


def _logged_run(path, rpc_server, engine_tools, n_prompt=40, n_gen=10, **kw):
    """(llm, log) after a prompt of n_prompt tokens (several ubatches) and n_gen greedy decode tokens."""
    from hybrimoe import Llama

    llm = Llama(str(path), **_common(rpc_server), **kw)
    llm.moe_log()
    tokens = engine_tools.prompt_of(llm, n_prompt)
    engine_tools.run_greedy(llm, tokens, n_gen)
    return llm, llm.moe_take_log()


def _slots(path, n):
    from hybrimoe.engine import slot_bytes

    return n * slot_bytes(path)


@pytest.mark.parametrize("policy", PRESETS)
def test_replay_reproduces_engine_decisions(policy, tiny_model, rpc_server, split_cost_model, engine_tools):
    """Every preset, prefill (3 ubatches) and decode, a cache of 20 slots for 3 MoE layers x 16 experts (top-4, a
    shared expert): the replay agrees with the engine on every record, and the records hold real decisions (GPU
    work, copies, evictions)."""
    path = tiny_model("deepseek2", "Q8_0", n_layer=4, n_expert=16, n_expert_used=4)
    llm, log = _logged_run(path, rpc_server, engine_tools, moe_cache=_slots(path, 20), moe_policy=policy,
                           moe_cost_model=split_cost_model)
    try:
        from hybrimoe import engine as eng

        setup = llm._moe_setup
        fresh = eng.build_policies(policy, setup["facts"], setup["n_slots"], setup["prefetch_layers"])
        sim = replay_engine_log(llm, log, policies=fresh)
        st = llm.moe_stats()["engine"]
        ran = setup["policies"].cache
    finally:
        llm.close()
    assert len(log) == sum(s["runs"] for s in st["layers"]) > 0
    assert _core.first_difference(log, sim) == ""
    # the cache counted the same hits, misses, admissions and evictions, and ends with the same residents
    fields = ("accesses", "demand_hits", "prefetch_hits", "misses", "late", "admissions", "evictions", "declined")
    assert [getattr(fresh.cache.stats, f) for f in fields] == [getattr(ran.stats, f) for f in fields]
    assert sorted(fresh.cache.resident_keys()) == sorted(ran.resident_keys())
    assert sum(sum(r["on_gpu"]) for r in log) == st["gpu_experts"] > 0
    copies = sum(len(r["loaded"]) + len(r["filled"]) + len(r["prefetched"]) + len(r["first_use"]) for r in log)
    assert copies > 0
    if policy != "upstream-ncmoe":  # static layers: nothing is ever evicted
        assert sum(len(r["evicted"]) for r in log) > 0
    if policy in ("hybrimoe", "hybrimoe-lru"):
        assert sum(len(r["prefetched"]) for r in log) > 0 and any(r["predictions"] for r in log)


def test_replay_detects_other_settings(tiny_model, rpc_server, split_cost_model, engine_tools):
    """Negative controls: another budget, another policy, or a changed input of one record give a named difference
    (the comparison can fail)."""
    from hybrimoe import engine as eng

    path = tiny_model("qwen3moe", "Q4_K_M")
    llm, log = _logged_run(path, rpc_server, engine_tools, moe_cache=_slots(path, 4), moe_policy="hybrimoe",
                           moe_cost_model=split_cost_model)
    try:
        setup = llm._moe_setup
        assert _core.first_difference(log, replay_engine_log(llm, log)) == ""
        smaller = eng.build_policies("hybrimoe", setup["facts"], 2, setup["prefetch_layers"])
        assert _core.first_difference(log, replay_engine_log(llm, log, policies=smaller)) != ""
        other = eng.build_policies("gpu-on-demand", setup["facts"], 4, setup["prefetch_layers"])
        assert _core.first_difference(log, replay_engine_log(llm, log, policies=other)) != ""
        # a later split sees a copy queue it cannot finish: that record's plan changes
        busy = copy.deepcopy(log)
        i = next(i for i, r in enumerate(busy) if any(r["planned_gpu"]) and not all(r["cached"]))
        busy[i]["pcie_free_s"] = 10.0
        diff = _core.first_difference(log, replay_engine_log(llm, busy))
        assert diff.startswith(f"record {i} ") or diff.startswith("record "), diff
        assert diff != ""
        with pytest.raises(ValueError, match="turn logging on before the first decode"):
            replay_engine_log(llm, log[3:])
    finally:
        llm.close()


def test_moe_log_needs_the_engine(tiny_model):
    from hybrimoe import Llama

    llm = Llama(str(tiny_model("qwen3moe", "Q8_0")), n_ctx=64, verbose=False)
    try:
        with pytest.raises(ValueError, match="moe_log needs the MoE engine"):
            llm.moe_log()
        with pytest.raises(ValueError, match="moe_take_log needs the MoE engine"):
            llm.moe_take_log()
    finally:
        llm.close()


def test_replay_rejects_malformed_records(tiny_model, rpc_server, split_cost_model, engine_tools):
    path = tiny_model("qwen3moe", "Q8_0")
    llm, log = _logged_run(path, rpc_server, engine_tools, n_prompt=8, n_gen=2, moe_cache=_slots(path, 3),
                           moe_cost_model=split_cost_model)
    try:
        bad = copy.deepcopy(log)
        del bad[1]["pcie_free_s"]
        with pytest.raises(ValueError, match="record 1: key 'pcie_free_s' is missing"):
            replay_engine_log(llm, bad)
        bad = copy.deepcopy(log)
        bad[2]["layer"] = 7
        with pytest.raises(ValueError, match="record 2: MoE layer 7 outside the cache's 2 layers"):
            replay_engine_log(llm, bad)
        bad = copy.deepcopy(log)
        bad[0]["ids"] = np.full_like(bad[0]["ids"], 99)
        with pytest.raises(ValueError, match="expert id 99 out of range"):
            replay_engine_log(llm, bad)
    finally:
        llm.close()
