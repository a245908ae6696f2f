"""The engine and the simulator make the same decisions (docs/design.md §7). The engine logs each (MoE layer, ubatch)
(routing, router scores, expert bytes, copy-queue estimate, predictions); the simulator replays that log through
fresh policies of the same preset, budget and cost model and must reproduce every decision exactly: cached, the
planned and the run split, demand loads admitted / declined, first-use copies, prefetches, fills, evictions and
the predicted makespan. Runs on the RPC stand-in device."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from hybrimoe import _core
from hybrimoe.policy import ENGINE_PRESETS, PROFILE_PRESETS
from hybrimoe.runtime.decision_replay import replay_engine_log
from hybrimoe.runtime.setup import build_policies
from hybrimoe.testing.upstream import greedy_with_logits, prompt_tokens

PRESETS = ["hybrimoe", "hybrimoe-lru", "hybrimoe-reuse", "ktransformers", "hot-set", "upstream-ncmoe", "gpu-on-demand"]
#: presets whose cache never changes after its initial fill: nothing is evicted
STATIC = ("ktransformers", "hot-set", "upstream-ncmoe")
#: the hybrimoe components without TinyLFU admission: in these tiny runs the admission filter declines every
#: prefetch (a predicted expert is not yet used more than its victim), so this case makes the replay check prefetches
NO_ADMISSION = {"scheduler": "hybrimoe", "cache": "mrs", "prefetch": "impact", "fill": True}
CASES = PRESETS + [NO_ADMISSION]


def test_every_engine_preset_is_replayed():
    assert sorted(PRESETS) == sorted(ENGINE_PRESETS)


def _profile_trace(path, out):
    """A routing trace for the GGUF at ``path`` (random routing, a few experts favoured per layer), saved to
    ``out``: the profile of the presets that need one (moe_profile)."""
    from hybrimoe.model.reader import describe
    from hybrimoe.traces.format import RoutingTrace

    d = describe(path)
    L, E, k = len(d["moe_layers"]), d["n_expert"], d["n_expert_used"]
    rng = np.random.default_rng(11)
    p = (np.arange(E, 0, -1) ** 2).astype(float)
    p /= p.sum()
    ids = np.array([[rng.choice(E, k, replace=False, p=np.roll(p, 3 * l)) for l in range(L)] for _ in range(60)],
                   dtype=np.int16)
    RoutingTrace(expert_ids=ids, prompt_offsets=np.array([0, 30, 60]), num_experts=E, top_k=k,
                 expert_bytes=np.ones(L), model="").save(out)
    return str(out)


def _common(rpc_server, **kw):
    d = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=512, n_batch=512, n_ubatch=16, seed=0,
             verbose=False)
    d.update(kw)
    return d


def _logged_run(path, rpc_server, n_prompt=40, n_gen=10, **kw):
    """(llm, log) after a prompt of n_prompt tokens (several ubatches) and n_gen greedy decode tokens."""
    from hybrimoe import Llama

    llm = Llama(str(path), **_common(rpc_server), **kw)
    llm.moe_log()
    tokens = prompt_tokens(llm, n_prompt)
    greedy_with_logits(llm, tokens, n_gen)
    return llm, llm.moe_take_log()


@pytest.fixture(scope="module")
def fast_link_cost(tmp_path_factory, split_cost_model) -> str:
    """The tests' split cost model with a 10x faster link: the tiny fixtures' prefetches then pay off net of
    the expected waste of a wrong prediction (ImpactPrefetcher), so the logs hold prefetches to replay."""
    import json
    from pathlib import Path

    cm = json.loads(Path(split_cost_model).read_text())
    cm["h2d_bandwidth_Bps"] *= 10
    p = tmp_path_factory.mktemp("cost") / "fast-link.json"
    p.write_text(json.dumps(cm))
    return str(p)


def _slots(path, n):
    from hybrimoe.runtime.engine_facts import slot_bytes

    return n * slot_bytes(path)


@pytest.mark.parametrize("policy", CASES, ids=PRESETS + ["hybrimoe-no-admission"])
def test_replay_reproduces_engine_decisions(policy, tiny_model, rpc_server, fast_link_cost,
                                            tmp_path):
    """Every engine preset, prefill (3 ubatches) and decode, a cache of 20 slots for 3 MoE layers x 16 experts
    (top-4, a shared expert; hot-set with a profile trace): the replay agrees with the engine on every record, and
    the records hold real decisions (GPU work, copies, evictions where the cache changes)."""
    path = tiny_model("deepseek2", "Q8_0", n_layer=4, n_expert=16, n_expert_used=4)
    extra = ({"moe_profile": _profile_trace(path, tmp_path / "profile.npz")}
             if isinstance(policy, str) and policy in PROFILE_PRESETS else {})
    llm, log = _logged_run(path, rpc_server, moe_cache=_slots(path, 20), moe_policy=policy,
                           moe_cost_model=fast_link_cost, **extra)
    try:
        setup = llm.moe_setup
        fresh = build_policies(policy, setup.facts, setup.n_slots, setup.prefetch_layers, setup.profile)
        # replay_engine_log rebuilds the same policies (the profile included) by itself too
        assert _core.first_difference(log, replay_engine_log(llm, log)) == ""
        sim = replay_engine_log(llm, log, policies=fresh)
        st = llm.moe_stats()["engine"]
        ran = setup.policies.cache
    finally:
        llm.close()
    assert len(log) == sum(s["runs"] for s in st["layers"]) > 0
    assert _core.first_difference(log, sim) == ""
    # each record's own decisions re-timed under the cost model they were decided with give its makespan, and the
    # engine measured each run (plan start to wait end) while the replay measured none
    again = _core.record_makespans(log, setup.cost)
    assert again == pytest.approx([r["makespan_s"] for r in log], rel=1e-12, abs=1e-15)
    assert all(r["measured_s"] > 0 for r in log) and all(r["measured_s"] == -1 for r in sim)
    # the cache counted the same hits, misses, admissions and evictions, and ends with the same residents
    fields = ("accesses", "demand_hits", "prefetch_hits", "misses", "late", "admissions", "evictions", "declined")
    assert [getattr(fresh.cache.stats, f) for f in fields] == [getattr(ran.stats, f) for f in fields]
    assert sorted(fresh.cache.resident_keys()) == sorted(ran.resident_keys())
    assert sum(sum(r["on_gpu"]) for r in log) == st["gpu_experts"] > 0
    copies = sum(len(r["loaded"]) + len(r["filled"]) + len(r["prefetched"]) + len(r["first_use"]) for r in log)
    assert copies > 0
    if policy in STATIC:  # static residents: nothing is ever evicted, loaded, prefetched or filled
        assert sum(len(r["evicted"]) + len(r["loaded"]) + len(r["prefetched"]) + len(r["filled"]) for r in log) == 0
    else:
        assert sum(len(r["evicted"]) for r in log) > 0
    if policy in ("hybrimoe", "hybrimoe-lru", "hybrimoe-reuse") or policy is NO_ADMISSION:
        assert any(r["predictions"] for r in log)
    if policy is NO_ADMISSION:
        assert sum(len(r["prefetched"]) for r in log) > 0


def test_replay_detects_other_settings(tiny_model, rpc_server, split_cost_model):
    """Negative controls: another budget, another policy, or a changed input of one record give a named difference
    (the comparison can fail)."""
    path = tiny_model("qwen3moe", "Q4_K_M")
    llm, log = _logged_run(path, rpc_server, moe_cache=_slots(path, 4), moe_policy="hybrimoe",
                           moe_cost_model=split_cost_model)
    try:
        setup = llm.moe_setup
        assert _core.first_difference(log, replay_engine_log(llm, log)) == ""
        smaller = build_policies("hybrimoe", setup.facts, 2, setup.prefetch_layers)
        assert _core.first_difference(log, replay_engine_log(llm, log, policies=smaller)) != ""
        other = build_policies("gpu-on-demand", setup.facts, 4, setup.prefetch_layers)
        assert _core.first_difference(log, replay_engine_log(llm, log, policies=other)) != ""
        # a later split sees a copy queue it cannot finish: that record's plan changes
        busy = copy.deepcopy(log)
        i = next(i for i, r in enumerate(busy) if any(r["planned_gpu"]) and not all(r["cached"]))
        busy[i]["pcie_free_s"] = 10.0
        diff = _core.first_difference(log, replay_engine_log(llm, busy))
        assert diff.startswith(f"record {i} "), diff
        later = next(j for j, r in enumerate(log) if r["ubatch"] > 0)
        with pytest.raises(ValueError, match="turn logging on before the first decode"):
            replay_engine_log(llm, log[later:])
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


def test_replay_rejects_malformed_records(tiny_model, rpc_server, split_cost_model):
    path = tiny_model("qwen3moe", "Q8_0")
    llm, log = _logged_run(path, rpc_server, n_prompt=8, n_gen=2, moe_cache=_slots(path, 3),
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


# ---- the shared rules against hand-computed outcomes (no engine: records written here) ----

B = 1_000_000  # bytes of one expert


def _cost(h2d_s=1.0):
    c = _core.CostModel()
    c.cpu_startup_s, c.cpu_a_s, c.cpu_b_s = 1e-4, 1e-2, 0.0
    c.gpu_a_s, c.gpu_b_s, c.act_a_s, c.act_b_s = 1e-4, 0.0, 0.0, 0.0
    c.h2d_bandwidth_Bps, c.h2d_latency_s = B / h2d_s, 0.0
    c.layer_a_s = c.layer_b_s = c.dense_a_s = c.dense_b_s = 0.0
    return c


def _rec(ubatch, layer, ids, now_s, pcie_free_s=0.0, predictions=()):
    ids = np.asarray(ids, dtype=np.int32)
    return dict(ubatch=ubatch, layer=layer, n_tokens=ids.shape[0], top_k=ids.shape[1], ids=ids, scores=None,
                expert_bytes=float(B), now_s=now_s, pcie_free_s=pcie_free_s, predictions=list(predictions))


def test_copies_are_ready_at_the_queue_estimate_and_a_lookup_before_is_late():
    """Every expert on the GPU (gpu-on-demand), one copy takes 1 s: a load queued behind 0.5 s of copies at
    t=100 is ready at 101.5; looked up at 101 it is cached but 0.5 s away (a late miss); at 102 a hit."""
    cache = _core.ExpertCache([float(B)] * 2, 4, 2.0 * B, _core.LRUPolicy())
    log = [_rec(0, 0, [[0]], 100.0, pcie_free_s=0.5), _rec(1, 0, [[0]], 101.0), _rec(2, 0, [[0]], 102.0)]
    sim = _core.replay_decisions(log, cache, _core.make_scheduler("gpu-on-demand"), _core.make_prefetcher("none"),
                                 _cost(), has_slots=True, prefetch_layers=0, fill_on_miss=False)
    assert sim[0]["loaded"] == [0] and list(sim[0]["cached"]) == [0] and list(sim[0]["on_gpu"]) == [1]
    assert list(sim[1]["cached"]) == [1] and sim[1]["ready_s"] == pytest.approx([0.5]) and not sim[1]["loaded"]
    assert list(sim[2]["cached"]) == [1] and sim[2]["ready_s"] == [0.0]
    st = cache.stats
    assert (st.misses, st.late, st.demand_hits) == (2, 1, 1)


def test_fills_stop_when_the_copy_queue_reaches_the_makespan():
    """ktransformers rules: uncached experts run on the CPU and are offered as fills while the copy-queue
    estimate is below the predicted makespan (3 CPU experts of 10 ms: 30.1 ms). With copies of 12 ms and an idle
    queue, fills start at 0, 12 and 24 ms: all three; with the queue 25 ms busy, one starts (25 < 30.1) and the
    next would start at 37 ms: stop."""
    def run(queue):
        cache = _core.ExpertCache([float(B)] * 2, 8, 8.0 * B, _core.LRUPolicy())
        sim = _core.replay_decisions([_rec(0, 0, [[0, 1, 2]], 5.0, pcie_free_s=queue)], cache,
                                     _core.make_scheduler("ktransformers"), _core.make_prefetcher("none"),
                                     _cost(h2d_s=0.012), has_slots=True, prefetch_layers=0, fill_on_miss=True)
        return sim[0]
    free = run(0.0)
    assert list(free["on_gpu"]) == [0, 0, 0] and free["makespan_s"] == pytest.approx(0.0301)
    assert sorted(free["filled"]) == [0, 1, 2]
    busy = run(0.025)
    assert len(busy["filled"]) == 1


def test_fills_and_prefetches_that_cost_the_cpu_lengthen_the_predicted_layer():
    """cpu_copy_overlap < 1: the copies queued after the plan (fills, prefetches) run before the layer's CPU share
    in the engine, so they delay it. ktransformers with 3 CPU experts (30.1 ms) and 12 ms fills: at 1 the three
    fills are free for the CPU (makespan 30.1 ms); at 0 the CPU share is the critical path and a fill would
    lengthen it, so none is issued. A prefetch (hybrimoe rules, impact prefetcher) at 0.5 adds half its 1 ms copy
    to the CPU end of a CPU-only layer."""
    def fills(cpu_overlap):
        cache = _core.ExpertCache([float(B)] * 2, 8, 8.0 * B, _core.LRUPolicy())
        cm = _cost(h2d_s=0.012)
        cm.cpu_copy_overlap = cpu_overlap
        return _core.replay_decisions([_rec(0, 0, [[0, 1, 2]], 5.0)], cache, _core.make_scheduler("ktransformers"),
                                      _core.make_prefetcher("none"), cm, has_slots=True, prefetch_layers=0,
                                      fill_on_miss=True)[0]
    free, paid = fills(1.0), fills(0.0)
    assert sorted(free["filled"]) == [0, 1, 2] and free["makespan_s"] == pytest.approx(0.0301)
    assert paid["filled"] == [] and paid["makespan_s"] == pytest.approx(0.0301)

    def prefetched(cpu_overlap):
        cache = _core.ExpertCache([float(B)] * 2, 4, 4.0 * B, _core.LRUPolicy())
        cm = _cost(h2d_s=0.001)
        cm.cpu_copy_overlap = cpu_overlap
        pred = dict(layer=1, distance=1, confidence=1.0, start_s=0.05, expert_bytes=float(B), experts=[3],
                    loads=[1])
        return _core.replay_decisions([_rec(0, 0, [[0]], 10.0, predictions=[pred]), _rec(0, 1, [[3]], 10.05)], cache,
                                      _core.make_scheduler("ktransformers"), _core.make_prefetcher("impact"), cm,
                                      has_slots=True, prefetch_layers=1, fill_on_miss=False)[0]
    a, b = prefetched(1.0), prefetched(0.5)
    assert [tuple(p) for p in a["prefetched"]] == [(1, 3)] == [tuple(p) for p in b["prefetched"]]
    assert b["makespan_s"] - a["makespan_s"] == pytest.approx(0.0005)


def test_copies_queued_after_the_gpu_launch_delay_its_outputs_on_a_one_queue_device():
    """The engine queues prefetches after the layer's GPU launch. On a device that cannot compute while it copies
    (copy_overlap 0: one queue, as ggml's RPC backend has) the launch's outputs come back after those copies, so
    they lengthen the GPU share; with copy_overlap 1 they do not. gpu-on-demand, one expert loaded (1 ms) and one
    prefetched for the next layer (1 ms): the makespan differs by the prefetch's 1 ms, and record_makespans
    re-times the 0-overlap record under the 1-overlap model to the other run's makespan."""
    def run(overlap):
        cache = _core.ExpertCache([float(B)] * 2, 4, 4.0 * B, _core.LRUPolicy())
        cm = _cost(h2d_s=0.001)
        cm.copy_overlap = overlap
        pred = dict(layer=1, distance=1, confidence=1.0, start_s=0.05, expert_bytes=float(B), experts=[3],
                    loads=[1])
        log = [_rec(0, 0, [[0]], 10.0, predictions=[pred]), _rec(0, 1, [[3]], 10.05)]
        return _core.replay_decisions(log, cache, _core.make_scheduler("gpu-on-demand"),
                                      _core.make_prefetcher("impact"), cm, has_slots=True, prefetch_layers=1,
                                      fill_on_miss=False)[0], cm
    (one, cm1), (queue, cm0) = run(1.0), run(0.0)
    for r in (one, queue):
        assert list(r["on_gpu"]) == [1] and r["loaded"] == [0] and [tuple(p) for p in r["prefetched"]] == [(1, 3)]
        assert r["post_launch_copies"] == 1 and r["post_launch_copy_bytes"] == B
    assert one["makespan_s"] == pytest.approx(0.0011)  # the load's copy, then the expert's 0.1 ms
    assert queue["makespan_s"] - one["makespan_s"] == pytest.approx(0.001)
    assert _core.record_makespans([queue], cm1) == pytest.approx([one["makespan_s"]])
    assert _core.record_makespans([queue], cm0) == pytest.approx([queue["makespan_s"]])


def test_record_makespans_rejects_a_record_of_mismatched_lengths():
    bad = dict(_rec(0, 0, [[0, 1]], 1.0), experts=[0, 1], loads=[1, 1], cached=[0], ready_s=[0.0, 0.0],
               on_gpu=[0, 0])
    with pytest.raises(ValueError, match="different lengths"):
        _core.record_makespans([bad], _cost())


@pytest.mark.parametrize("confidence,weight,issued", [(0.9, 0.5, True), (0.8, 0.5, False), (0.8, 0.0, True),
                                                      (0.5, 0.0, True)])
def test_impact_prefetch_weighs_the_expected_waste_of_a_wrong_prediction(confidence, weight, issued):
    """Net gain = confidence x (CPU 10.1 ms - GPU 0.1 ms) - weight x (1 - confidence) x the 100 ms copy, for one
    predicted expert whose copy lands in time: 0.06 c - 0.05 with the default weight 0.5, so c = 0.9 prefetches,
    c = 0.8 does not; without the waste term (weight 0) any positive gain prefetches."""
    cache = _core.ExpertCache([float(B)] * 2, 4, 4.0 * B, _core.LRUPolicy())
    pred = dict(layer=1, distance=1, confidence=confidence, start_s=0.5, expert_bytes=float(B), experts=[3],
                loads=[1])
    log = [_rec(0, 0, [[0]], 10.0, predictions=[pred]), _rec(0, 1, [[3]], 10.5)]
    sim = _core.replay_decisions(log, cache, _core.make_scheduler("ktransformers"),
                                 _core.ImpactPrefetcher(waste_weight=weight), _cost(h2d_s=0.1), has_slots=True,
                                 prefetch_layers=1, fill_on_miss=False)
    assert ([tuple(p) for p in sim[0]["prefetched"]] == [(1, 3)]) == issued
    assert _core.DEFAULT_PREFETCH_WASTE_WEIGHT == 0.5
    assert _core.make_prefetcher("impact").plan is not None  # the preset's prefetcher is this one with the default


def test_prefetch_sees_the_callers_clock():
    """Regression: the prefetcher compares the cache's ready times (caller's clock) with the predictions' start
    (relative to the split, converted by the rules). Late in a run (t=1000 s) with a resident expert copied long
    ago, the impact prefetcher still fetches the predicted expert that pays off."""
    cache = _core.ExpertCache([float(B)] * 2, 4, 4.0 * B, _core.LRUPolicy())
    pred = dict(layer=1, distance=1, confidence=1.0, start_s=0.05, expert_bytes=float(B), experts=[3, 1],
                loads=[1, 1])
    log = [_rec(0, 0, [[0]], 900.0), _rec(0, 1, [[3]], 900.1),       # layer 1's expert 3 copied at t~900
           _rec(1, 0, [[0]], 1000.0, predictions=[pred]), _rec(1, 1, [[3, 1]], 1000.1)]
    sim = _core.replay_decisions(log, cache, _core.make_scheduler("hybrimoe"), _core.make_prefetcher("impact"),
                                 _cost(h2d_s=0.001), has_slots=True, prefetch_layers=1, fill_on_miss=False)
    assert (1, 1) in [tuple(p) for p in sim[2]["prefetched"]], sim[2]
    assert list(sim[3]["cached"]) == [1, 1]
