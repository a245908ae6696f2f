"""Speculative decoding in the simulator (hybrimoe.sim.speculative, simulate --draft): the draft-and-verify steps
and what the simulator makes of them. Oracles: the verification rule (drafts kept up to the first rejection, then
one token of the target's; Leviathan et al., ICML 2023) checked step by step, its expected tokens per step (their
eq. 1) against the draws' mean, and the simulator's own plain decode of the same trace."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrimoe.policy.hardware import load_hardware
from hybrimoe.sim.simulator import Setup
from hybrimoe.sim.speculative import expected_tokens_per_step, speculative_steps, speculative_trace
from hybrimoe.traces.synthetic import synthetic_trace


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6), draft=st.integers(1, 5),
       acceptance=st.floats(0.0, 1.0), seed=st.integers(0, 3))
def test_steps_verify_the_drafts_and_advance_by_what_they_emit(lengths, draft, acceptance, seed):
    offs = np.concatenate([[0], np.cumsum(lengths)])
    order, steps, emitted = speculative_steps(offs, draft, acceptance, seed=seed)
    assert steps[0] == 0 and steps[-1] == len(order) and len(emitted) == len(steps) - 1
    # every token is emitted once: the steps of each prompt cover it without gaps or overlaps
    assert emitted.sum() == offs[-1]
    pos, prompt = 0, 0
    for i in range(len(emitted)):
        rows = order[steps[i]:steps[i + 1]]
        if pos == offs[prompt + 1]:
            prompt += 1  # the prompt was emitted to its end: the next step starts the next one
        end = int(offs[prompt + 1])
        assert rows[0] == pos, "a step starts at the token after the last one emitted"
        # the last accepted token and the drafts, never past the prompt's end: the accepted ones are the prompt's
        # next tokens, the rejected ones stand-ins from the same prompt
        assert len(rows) == min(draft + 1, end - pos) and 1 <= emitted[i] <= len(rows)
        assert np.array_equal(rows[:emitted[i]], np.arange(pos, pos + emitted[i]))
        # the stand-ins: earlier tokens of the prompt (its context so far), never a token not emitted yet
        assert ((rows >= offs[prompt]) & (rows < pos + emitted[i])).all()
        pos += int(emitted[i])
    assert pos == offs[-1] and prompt == len(lengths) - 1
    if acceptance == 1.0:
        assert all(e == len(order[a:b]) for e, a, b in zip(emitted, steps[:-1], steps[1:]))
    if acceptance == 0.0:
        assert (emitted == 1).all()


@pytest.mark.parametrize("draft, acceptance", [(1, 0.5), (3, 0.7), (4, 0.9)])
def test_tokens_per_step_follow_the_i_i_d_acceptance_model(draft, acceptance):
    # one long prompt: no prompt end clips a step
    _, _, emitted = speculative_steps([0, 200_000], draft, acceptance, seed=1)
    want = expected_tokens_per_step(draft, acceptance)
    assert abs(emitted[:-2].mean() - want) < 0.02 * want
    # each step's accepted drafts: geometric, truncated at the draft count
    acc = emitted[:-2] - 1
    assert abs((acc == 0).mean() - (1 - acceptance)) < 0.01
    assert abs((acc == draft).mean() - acceptance ** draft) < 0.01


def test_a_recorded_run_s_counts_repeat_and_prompt_ends_clip_them():
    _, steps, emitted = speculative_steps([0, 10, 13], 3, [3, 0, 2])
    # prompt 0 (10 tokens): 4, 1, 3, then 2 tokens left (count 3 clipped to 1 draft: 2 rows, 2 emitted); prompt 1
    # (3 tokens): count 0 (1 emitted), then count 2 over the 2 tokens left (1 draft: 2 emitted)
    assert list(emitted) == [4, 1, 3, 2, 1, 2]
    assert list(np.diff(steps)) == [4, 4, 4, 2, 3, 2]
    for bad, msg in ((1.5, "probability"), (-0.1, "probability"), ([4], r"\[0, draft=3\]"), ([], "non-empty"),
                     ([0.5], "integers")):
        with pytest.raises(ValueError, match=msg):
            speculative_steps([0, 10], 3, bad)
    for bad in (0, 65, 2.0, True):
        with pytest.raises(ValueError, match=r"draft must be an integer in \[1, 64\]"):
            speculative_steps([0, 10], bad, 0.5)
    # a numpy float is a probability
    assert speculative_steps([0, 10], 3, np.float32(1.0))[2].tolist() == [4, 4, 2]


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace("deepseek-v3", 900, locality="high", seed=3)


def test_the_steps_trace_holds_the_verified_rows_of_each_prompt(trace):
    spec, emitted, step_prompt = speculative_trace(trace, 3, 0.6, seed=4)
    order, steps, em = speculative_steps(trace.prompt_offsets, 3, 0.6, seed=4)
    assert np.array_equal(emitted, em) and emitted.sum() == trace.n_tokens
    assert np.array_equal(spec.prompt_offsets, steps) and spec.phases is None
    assert np.array_equal(spec.expert_ids, trace.expert_ids[order])
    assert np.array_equal(step_prompt, [trace.prompt_of(int(t)) for t in order[steps[:-1]]])
    assert (np.diff(step_prompt) >= 0).all() and set(step_prompt.tolist()) == set(range(trace.n_prompts))


def test_the_simulator_counts_emitted_tokens_and_the_drafter_s_time(trace):
    hw = load_hardware("rtx4090-desktop")
    plain = Setup(trace, hw, "25%", "decode", max_tokens=400)
    # every draft accepted: a step emits each row it verifies; none: one token per step
    for a, per_row in ((1.0, True), (0.0, False)):
        s = Setup(trace, hw, "25%", "decode", max_tokens=400, draft=3, acceptance=a, seed=2)
        r = s.run("hybrimoe")
        assert r["stage"] == "decode" and r["draft"] == 3 and r["prompts"] == r["steps"] > 0
        assert r["tokens"] == (r["verified_tokens"] if per_row else r["steps"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["total_s"])
        assert r["tpot_s"] == pytest.approx(r["total_s"] / r["tokens"])
        # the same profiling prompts and the same first evaluated token as plain decode
        assert np.array_equal(s.profile, plain.profile) and s.hot_keys == plain.hot_keys
        first_row = int(s.trace.prompt_offsets[s.first])
        assert np.array_equal(s.trace.expert_ids[first_row],
                              plain.trace.expert_ids[int(plain.trace.prompt_offsets[plain.first])])
    assert "speculative decode" in s.stage_model()
    # the drafter's time: each drafted token (every verified row but a step's first) costs draft_cost_s
    s = Setup(trace, hw, "25%", "decode", max_tokens=400, draft=3, acceptance=0.6, seed=2)
    r = s.run("hybrimoe")
    c = Setup(trace, hw, "25%", "decode", max_tokens=400, draft=3, acceptance=0.6, seed=2, draft_cost_s=0.002)
    rc = c.run("hybrimoe")
    drafted = r["verified_tokens"] - r["steps"]
    assert 0 < drafted < 3 * r["steps"] or r["steps"] == 0
    assert rc["total_s"] == pytest.approx(r["total_s"] + drafted * 0.002)
    with pytest.raises(ValueError, match="stage 'decode' and one stream"):
        Setup(trace, hw, "25%", "prefill", draft=3)
    with pytest.raises(ValueError, match=r"draft_cost_s must be in \[0, 100\]"):
        Setup(trace, hw, "25%", "decode", draft=3, draft_cost_s=-1.0)


def test_drafting_pays_when_drafts_are_accepted_and_costs_when_they_are_not(trace):
    """Plain decode of the same trace is the oracle: verifying the next tokens in one ubatch plans the union of their
    experts once, so with every draft accepted a step emits 4 tokens for less than 4 steps' time; with none accepted
    it emits 1 token for a 4-row step."""
    hw = load_hardware("rtx4090-desktop")
    for preset in ("hybrimoe", "upstream-ncmoe"):
        plain = Setup(trace, hw, "25%", "decode", max_tokens=400).run(preset)["tokens_per_s"]
        rate = {a: Setup(trace, hw, "25%", "decode", max_tokens=400, draft=3, acceptance=a).run(preset)["tokens_per_s"]
                for a in (0.0, 1.0)}
        assert rate[1.0] > 1.1 * plain > 1.1 * rate[0.0], (preset, plain, rate)


def test_simulate_draft_flags(tmp_path, trace):
    trace.save(tmp_path / "t.npz")
    base = [sys.executable, "-m", "hybrimoe", "simulate", "--trace", str(tmp_path / "t.npz"), "--model-facts",
            "deepseek-v3", "--stage", "decode", "--max-tokens", "200", "--policies", "hybrimoe"]

    def run(*extra):
        return subprocess.run(base + list(extra), capture_output=True, text=True, cwd=tmp_path)

    p = run("--draft", "2", "--acceptance", "0.8", "--json", "p.json")
    assert p.returncode == 0, p.stderr
    assert "2 drafts per step" in p.stdout and "speculative decode" in p.stdout
    (tmp_path / "counts.txt").write_text("2 0 1\n")
    np.save(tmp_path / "counts.npy", np.array([2, 2, 0]))
    (tmp_path / "floats.txt").write_text("0.5 1.5")
    (tmp_path / "empty.txt").write_text("")
    for f, per_step in (("counts.txt", (3 + 1 + 2) / 3), ("counts.npy", (3 + 3 + 1) / 3)):
        p = run("--draft", "2", "--acceptance", f, "--draft-cost-ms", "1.5", "--json", f"{f}.json")
        assert p.returncode == 0, p.stderr
        rec = json.loads((tmp_path / f"{f}.json").read_text())[0]
        assert rec["acceptance"] == "recorded" and rec["draft_cost_s"] == pytest.approx(1.5e-3)
        assert abs(rec["tokens_per_step"] - per_step) < 0.1, rec  # a prompt's end clips a few steps
    for args, msg in ((("--acceptance", "0.5"), "need --draft"), (("--acceptance", "0.7"), "need --draft"),
                      (("--draft-cost-ms", "1"), "need --draft"), (("--draft", "2", "--acceptance", "2"), "[0, 1]"),
                      (("--draft", "2", "--acceptance", "nofile"), "neither a probability nor a file"),
                      (("--draft", "1", "--acceptance", "counts.txt"), "must be in [0, --draft 1]"),
                      (("--draft", "2", "--acceptance", "floats.txt"), "cannot read accepted-draft counts"),
                      (("--draft", "2", "--acceptance", "empty.txt"), "integer accepted-draft counts"),
                      (("--draft", "65",), "in 0..64"),
                      (("--draft", "2", "--streams", "2"), "one stream's drafts")):
        p = run(*args)
        assert p.returncode != 0 and msg in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
