"""Concurrent decode streams in one batch (hybrimoe.sim.streams, simulate --streams): the steps a continuous batch
decodes, and the simulator planning each step's union of experts once."""
from __future__ import annotations

import numpy as np
import pytest

from hybrimoe.policy.hardware import load_hardware
from hybrimoe.sim.simulator import Setup
from hybrimoe.sim.streams import streams_trace
from hybrimoe.traces.synthetic import synthetic_trace


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace("qwen3-30b-a3b", 900, locality="high", seed=5)


def _prompt_of(trace):
    offs = np.asarray(trace.prompt_offsets)
    return np.searchsorted(offs, np.arange(trace.n_tokens), side="right") - 1


@pytest.mark.parametrize("n", [1, 3, 8])
def test_steps_take_one_token_of_each_active_stream(trace, n):
    st = streams_trace(trace, n)
    assert st.n_tokens == trace.n_tokens and st.phases is None
    # every token exactly once: the rows are a permutation of the original rows
    a = trace.expert_ids.reshape(trace.n_tokens, -1)
    b = st.expert_ids.reshape(st.n_tokens, -1)
    order = [int(np.flatnonzero((a == row).all(axis=1))[0]) for row in b[:60]]
    sizes = np.diff(st.prompt_offsets)
    assert sizes.min() >= 1 and sizes.max() == min(n, trace.n_prompts)
    prompt = _prompt_of(trace)
    first = [order[i] for i in range(int(st.prompt_offsets[0]), int(st.prompt_offsets[1]))]
    # the first step holds the first token of each of the first n prompts, in order
    assert [prompt[t] for t in first] == list(range(min(n, trace.n_prompts)))
    if n == 1:
        assert np.array_equal(st.expert_ids, trace.expert_ids) and list(sizes) == [1] * trace.n_tokens
    # no step has two tokens of one prompt, and a prompt's tokens come in order, one per step
    steps = np.searchsorted(st.prompt_offsets, np.arange(len(order)), side="right") - 1
    seen = {}
    for i, t in enumerate(order):
        p = prompt[t]
        if p in seen:
            assert t == seen[p][0] + 1 and steps[i] == seen[p][1] + 1
        seen[p] = (t, steps[i])


def test_a_batch_plans_the_union_of_its_experts_once(trace):
    """Per step and MoE layer the cache is looked up once per distinct expert of the step's tokens (an expert two
    streams route to is one load), and four streams decode faster in all than one, each stream slower."""
    hw = load_hardware("rtx4090-desktop")
    one = Setup(trace, hw, "25%", "decode", max_tokens=400, seed=2).run("hybrimoe")
    s4 = Setup(trace, hw, "25%", "decode", max_tokens=400, seed=2, streams=4)
    four = s4.run("hybrimoe")
    from hybrimoe import _core

    st = s4.trace
    want = 0
    for b, e, _ in _core.make_steps(s4.core_trace, s4.first, s4.end, s4.cfg):
        assert e - b <= 4  # one ubatch per step
        for layer in range(st.n_layers):
            want += len(np.unique(st.expert_ids[b:e, layer]))
    assert four["streams"] == 4 and four["stage"] == "decode"
    assert four["tokens_per_s"] > 1.1 * one["tokens_per_s"]
    assert four["tpot_s"] > one["tpot_s"]
    cache, sched, pre, cfg = s4.build("hybrimoe")
    assert s4.simulate(cache, sched, pre, s4.planner, cfg).cache.accesses == want


def test_streams_are_refused_outside_decode(trace):
    with pytest.raises(ValueError, match="decode"):
        Setup(trace, load_hardware("rtx4090-desktop"), "25%", "prefill", streams=2)
    with pytest.raises(ValueError, match="streams must be"):
        streams_trace(trace, 0)


def test_simulate_streams_command(trace, tmp_path, capsys):
    import json

    from hybrimoe.commands import main as hybrimoe_main

    path = tmp_path / "q.npz"
    trace.save(path)
    rec = tmp_path / "r.json"
    argv = ["simulate", "--trace", str(path), "--max-tokens", "200", "--no-progress"]
    assert hybrimoe_main(argv + ["--streams", "4", "--policies", "hybrimoe,upstream-ncmoe", "--json", str(rec)]) == 0
    assert "4 streams per step" in capsys.readouterr().out
    recs = json.loads(rec.read_text())
    assert all(r["streams"] == 4 and r["tpot_s"] > 0 for r in recs)
    assert hybrimoe_main(argv + ["--streams", "2", "--stage", "prefill"]) == 2
    assert "--stage decode" in capsys.readouterr().err
