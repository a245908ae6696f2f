"""Bounds that bound, on small instances solved exactly (hybrimoe.sim.bounds).

The exhaustive search's optimum is a lower bound on every policy's simulated time under the noise-free truth (its
model is a relaxation of the simulator's rules): no preset may beat it, on any random small trace. The clairvoyant
``oracle`` preset is checked against it: within 10% of the optimum from the same initial fill, and never slower
than a non-clairvoyant preset. On a wider set of random small traces ``oracle`` and ``belady`` are checked against
every preset (no exhaustive search there). Instances where it is not are listed with their measured ratio, so that the gap
stays visible and an entry that stops failing fails the test.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrimoe import policy as pol
from hybrimoe.model.facts import MODEL_FACTS
from hybrimoe.sim.bounds import optimal_time
from hybrimoe.sim.simulator import Setup
from hybrimoe.traces.format import RoutingTrace

HARDWARE = ("paper-a6000", "rtx4090-desktop", "h200")
FACTS = MODEL_FACTS["deepseek-v2-lite"]


def small_setup(ids: np.ndarray, n_experts: int, hw_name: str, slots: int, stage: str) -> Setup:
    """A Setup over two equal prompts of ``ids`` (int ``[tokens, layers, top_k]``): the first profiles, the second
    is simulated, with ``slots`` GPU expert slots, the noise-free truth and no host-memory contention (the exact
    search's model)."""
    T2, L, K = ids.shape
    eb = float(FACTS.per_layer_expert_bytes().mean())
    tr = RoutingTrace(expert_ids=ids.astype(np.int16), prompt_offsets=np.array([0, T2 // 2, T2], np.int64),
                      num_experts=n_experts, top_k=K, expert_bytes=np.full(L, eb), model=FACTS.name)
    s = Setup(tr, pol.load_hardware(hw_name), slots * eb * (1 + 1e-9), stage, ubatch=4, profile_fraction=0.5,
              prefetch_depth=min(3, L - 1), recall=(0.8, 0.65, 0.5)[:min(3, L - 1)], facts=FACTS)
    for f in ("cpu_noise", "gpu_noise", "h2d_noise", "act_noise", "layer_noise", "contention", "cpu_startup_extra_s"):
        setattr(s.truth, f, 0.0)
    return s


def random_ids(rng, tokens: int, layers: int, experts: int, top_k: int) -> np.ndarray:
    return np.array([[rng.choice(experts, top_k, replace=False) for _ in range(layers)] for _ in range(tokens)])


def solve(s: Setup, slots: int, **kw):
    return optimal_time(s.core_trace, s.trace.expert_ids, s.truth_cost, slots, s.cfg, s.first, s.end, **kw)


def test_the_search_is_exact_against_plain_enumeration():
    """Pruning (the time-left bound, dominance) changes nothing: the same optimum as enumerating every schedule."""
    rng = np.random.default_rng(3)
    for trial in range(4):
        ids = random_ids(rng, 4, 2, 3, 1 + trial % 2)
        s = small_setup(ids, 3, HARDWARE[trial % 3], 1 + trial % 2, "decode")
        fast, plain = solve(s, 1 + trial % 2), solve(s, 1 + trial % 2, prune=False)
        assert fast.proven and plain.proven
        assert fast.time_s == pytest.approx(plain.time_s, rel=1e-12), trial
        assert plain.nodes > fast.nodes


def test_one_expert_per_layer_is_the_closed_form():
    """Every token routes to expert 0 of each layer and the GPU holds them all from the start: each position costs
    its non-expert part plus the better of the GPU (activations + expert) and the CPU (start-up + expert)."""
    ids = np.zeros((6, 2, 1), int)
    s = small_setup(ids, 3, "rtx4090-desktop", 2, "decode")
    c = s.truth_cost
    per = c.layer(1) + min(c.act(1) + c.gpu(1), c.cpu_startup_s + c.cpu(1))
    assert solve(s, 2).time_s == pytest.approx(6 * per, rel=1e-12)
    # with no slot, every expert runs on the CPU
    s0 = small_setup(ids, 3, "rtx4090-desktop", 0, "decode")
    assert solve(s0, 0).time_s == pytest.approx(6 * (c.layer(1) + c.cpu_startup_s + c.cpu(1)), rel=1e-12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), layers=st.integers(2, 3), experts=st.integers(3, 4), top_k=st.integers(1, 2),
       tokens=st.integers(2, 4), slots=st.integers(1, 2), hw=st.sampled_from(HARDWARE),
       stage=st.sampled_from(("decode", "prefill")))
def test_no_policy_beats_the_exact_optimum(seed, layers, experts, top_k, tokens, slots, hw, stage):
    """On random small traces every preset (the clairvoyant ones included) is at least as slow as the exhaustive
    search's optimum with a free initial fill: it is a true lower bound there."""
    ids = random_ids(np.random.default_rng(seed), 2 * tokens, layers, experts, top_k)
    s = small_setup(ids, experts, hw, slots, stage)
    times = {p: s.run(p)["total_s"] for p in pol.SYSTEM_PRESETS}
    opt = solve(s, slots, upper_bound_s=min(times.values()) * (1 + 1e-9))
    assert opt.proven
    assert all(t >= opt.time_s * (1 - 1e-9) for t in times.values()), (opt.time_s, times)


#: instances (index into tightness_cases()' seeded list) where the oracle is more than 10% slower than the optimum
#: from its own initial fill, or slower than a non-clairvoyant preset, with the ratio measured when listed. 12
#: (decode, 2 layers, 4 experts, top-1, 2 slots, paper-a6000): the optimum copies two experts whose copy takes
#: longer than a layer, over several layers of CPU work; the oracle's prefetch looks 1 layer ahead (all the
#: instance has) and its fills copy one.
KNOWN_LOOSE: dict = {12: 1.119}
#: node limit per instance (a search cut short is left out; at most two may be)
MAX_NODES = 10_000


def seeded_cases(seed: int, n: int, layers: int, experts: int, tokens: int, slots: int) -> list:
    """``n`` random small instances ``(ids, experts, hardware, slots, stage)`` from ``seed``: up to ``layers``
    layers, ``experts`` experts (top-1 or top-2), ``tokens`` tokens per prompt and ``slots`` slots; the hardware
    presets and the stages take turns."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        n_l, n_e, top_k = int(rng.integers(2, layers + 1)), int(rng.integers(3, experts + 1)), int(rng.integers(1, 3))
        n_t, n_s = int(rng.integers(3, tokens + 1)), int(rng.integers(1, slots + 1))
        out.append((random_ids(rng, 2 * n_t, n_l, n_e, top_k), n_e, HARDWARE[i % 3], n_s,
                    ("decode", "prefill")[i % 2]))
    return out


def tightness_cases():
    return seeded_cases(2026, 16, layers=3, experts=5, tokens=4, slots=3)


def test_the_oracle_is_within_ten_percent_of_the_optimum():
    """The tightness check: on seeded small instances the ``oracle`` preset's time is within 1.10 x the optimum
    from the same initial fill (its clairvoyant first-use fill), and no non-clairvoyant preset beats it."""
    loose, unsolved = {}, []
    for i, (ids, experts, hw, slots, stage) in enumerate(tightness_cases()):
        s = small_setup(ids, experts, hw, slots, stage)
        t_oracle = s.run("oracle")["total_s"]
        others = {p: s.run(p)["total_s"] for p in pol.ENGINE_PRESETS}
        opt = solve(s, slots, upper_bound_s=t_oracle * (1 + 1e-9), initial=s.first_use_keys(),
                    max_nodes=MAX_NODES)
        if not opt.proven:
            unsolved.append(i)
            continue
        ratio = t_oracle / opt.time_s
        beaten = min(others.values()) < t_oracle * (1 - 1e-9)
        if ratio > 1.10 or beaten:
            loose[i] = round(ratio, 3)
    assert len(unsolved) <= 2, f"searches cut short: {unsolved}"
    assert loose.keys() == KNOWN_LOOSE.keys(), f"loose instances {loose} (listed: {KNOWN_LOOSE})"
    for i, r in loose.items():
        assert r == pytest.approx(KNOWN_LOOSE[i], abs=0.01), (i, r)


#: random small instances (index into bound_cases()) where an engine preset beats belady (and maybe the oracle), with
#: the ratios (oracle, belady) / fastest engine preset measured when listed. 23: a prefill of 2 prompts of 8 tokens
#: in ubatches of 4 over 3 layers of 5 experts, 3 slots, h200, where hybrimoe-reuse (its learned ranking and its
#: admission by predicted reuse, both on at ubatches of 4 tokens; without that admission it is not listed) takes
#: 1.656 ms, Belady's plan 1.666 and the oracle's 1.660: Belady's cache maximises hits, not time. Elsewhere (a
#: prefill instance of 3 or 4 layers where hybrimoe's MRS cache beats Belady's hit-count optimum by ~2% exists outside
#: this seeded set: probed on 250 instances, 2 such, both prefill)
KNOWN_UNBOUNDED: dict = {23: (1.002, 1.006)}


def bound_cases():
    return seeded_cases(7, 100, layers=4, experts=7, tokens=8, slots=4)


def test_the_oracle_is_at_least_as_fast_as_every_policy_on_random_small_traces():
    """On seeded random small traces (up to 4 layers, 7 experts, 8 tokens per prompt, 4 slots, both stages) the
    ``oracle`` preset is at least as fast as every other preset, ``belady`` included (its plan is one the oracle
    times: simulate.Setup.run), and ``belady`` at least as fast as every engine preset."""
    unbounded = {}
    for i, (ids, experts, hw, slots, stage) in enumerate(bound_cases()):
        s = small_setup(ids, experts, hw, slots, stage)
        t = {p: s.run(p)["total_s"] for p in pol.SYSTEM_PRESETS}
        online = min(v for p, v in t.items() if p in pol.ENGINE_PRESETS)
        assert t["oracle"] <= t["belady"] * (1 + 1e-12), (i, t)
        if t["belady"] > online * (1 + 1e-9):  # the oracle is then bounded or not: both ratios are kept
            unbounded[i] = (round(t["oracle"] / online, 3), round(t["belady"] / online, 3))
    assert unbounded == KNOWN_UNBOUNDED, f"instances where an engine preset beats a bound: {unbounded}"
