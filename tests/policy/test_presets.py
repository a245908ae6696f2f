"""One meaning per preset (hybrimoe.policy.SYSTEM_PRESETS, built by build_preset for the engine and the simulator):
``ktransformers`` keeps whole leading MoE layers resident, ``upstream-ncmoe`` the last ones, ``hot-set`` the hottest
experts of a profile (the simulator's profiling prompts, the engine's ``moe_profile``); the engine and the
simulator hold the same keys for the same budget, and bad profiles are named errors. The engine tests run on the
RPC stand-in device against upstream with the same placement (docs/design.md §12)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hybrimoe import policy as pol
from hybrimoe.testing.upstream import greedy_with_logits, prompt_tokens

from .test_policy_cache import obs


# both sides in the file's layout (no_repack): the stand-in computes the GPU share with the plain CPU kernels, and
# upstream's repacked ones may round differently (tests/runtime/test_engine_repack.py covers repacked weights)
def _common(rpc_server, **kw):
    d = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=512, n_batch=512, n_ubatch=16, seed=0,
             verbose=False,
             no_repack=True)
    d.update(kw)
    return d


def _model(tiny_model):
    """deepseek2, 4 layers (a dense one first): 3 MoE layers x 16 experts, top-4, a shared expert."""
    return tiny_model("deepseek2", "Q8_0", n_layer=4, n_expert=16, n_expert_used=4)


def _skewed_trace(path, n_prompts=6, n_tok=20, seed=5, shape=None):
    """A routing trace shaped for the GGUF at ``path`` (or ``shape`` = (MoE layers, experts, top-k)) whose routing
    favours a few experts per layer (distinct counts, so the hot set is well defined)."""
    from hybrimoe.model.reader import describe
    from hybrimoe.traces.format import RoutingTrace

    if shape is None:
        d = describe(path)
        shape = (len(d["moe_layers"]), d["n_expert"], d["n_expert_used"])
    L, E, k = shape
    rng = np.random.default_rng(seed)
    n = n_prompts * n_tok
    ids = np.empty((n, L, k), np.int16)
    for l in range(L):
        p = rng.permutation(E).astype(np.float64) + 1.0
        p = p ** 3 / np.sum(p ** 3)
        for t in range(n):
            ids[t, l] = rng.choice(E, k, replace=False, p=p)
    return RoutingTrace(expert_ids=ids, prompt_offsets=np.arange(0, n + 1, n_tok), num_experts=E, top_k=k,
                        expert_bytes=np.ones(L), model="")


def _counts(trace):
    L, E = trace.n_layers, trace.num_experts
    c = np.zeros((L, E))
    for t in range(trace.n_tokens):
        for l in range(L):
            for e in trace.expert_ids[t, l]:
                c[l, e] += 1
    return c


def _hottest(counts, n):
    """The ``n`` hottest keys, ties to the lower key (computed here, not with the library's helper)."""
    flat = counts.ravel()
    return sorted(sorted(range(flat.size), key=lambda k: (-flat[k], k))[:n])


# ---- the presets' residents, no engine --------------------------------------------------------------------------

@pytest.mark.parametrize("n_slots, leading", [(0, 0), (15, 0), (16, 1), (37, 2), (47, 2), (48, 3)])
def test_ktransformers_keeps_whole_leading_layers_and_ncmoe_the_last(n_slots, leading):
    """3 MoE layers x 16 experts, one slot per expert: ktransformers holds the first ``leading`` whole layers (a
    partial layer stays on the CPU), upstream-ncmoe as many of the last layers; neither ever loads or fills."""
    L, E = 3, 16
    eb = [1000.0] * L
    kt = pol.build_preset("ktransformers", eb, E, n_slots * 1000.0)
    assert sorted(kt.cache.resident_keys()) == list(range(leading * E))
    assert kt.fill_on_miss is False and kt.scheduler.name() == "ktransformers" and kt.prefetcher.name() == "none"
    assert pol.leading_layers_that_fit(eb, E, n_slots * 1000.0) == leading
    nc = pol.build_preset("upstream-ncmoe", eb, E, n_slots * 1000.0)
    assert sorted(nc.cache.resident_keys()) == list(range((L - leading) * E, L * E))


def test_leading_layers_with_layers_of_different_sizes():
    assert pol.leading_layers_that_fit([10.0, 20.0, 30.0], 2, 59.0) == 1
    assert pol.leading_layers_that_fit([10.0, 20.0, 30.0], 2, 60.0) == 2
    assert pol.leading_layers_that_fit([10.0, 20.0, 30.0], 2, 120.0) == 3


def test_every_preset_has_an_about_and_a_source():
    for name, spec in pol.SYSTEM_PRESETS.items():
        assert spec["about"] and spec["source"], name
    assert "Qwen2-25%.yaml" in pol.SYSTEM_PRESETS["ktransformers"]["source"]
    assert pol.PROFILE_PRESETS == ("hot-set",) and "hot-set" in pol.ENGINE_PRESETS


def test_policy_dicts_name_their_admission_and_check_fill():
    """A policy dict's ``admission``: ``"priority"`` turns on the cache's priority admission (with frequency
    admission for larger ubatches), ``"tinylfu"`` frequency admission only, ``"none"`` neither; anything else, and a
    ``fill`` that is not a bool, is a named ValueError."""
    for adm, freq, prio in (("none", False, False), ("tinylfu", True, False), ("priority", True, True)):
        ps = pol.build_preset({"cache": "reuse", "admission": adm}, [1.0] * 2, 4, 3.0)
        assert (ps.cache.frequency_admission, ps.cache.priority_admission) == (freq, prio), adm
    assert pol.build_preset("hybrimoe-reuse", [1.0] * 2, 4, 3.0).cache.priority_admission
    assert not pol.build_preset("hybrimoe", [1.0] * 2, 4, 3.0).cache.priority_admission
    with pytest.raises(ValueError, match="unknown admission 'lru'.*priority"):
        pol.build_preset({"cache": "reuse", "admission": "lru"}, [1.0] * 2, 4, 3.0)
    with pytest.raises(ValueError, match="fill must be True or False, got 'no'"):
        pol.build_preset({"cache": "reuse", "fill": "no"}, [1.0] * 2, 4, 3.0)


def test_hot_set_needs_hot_keys_and_holds_the_hottest():
    with pytest.raises(ValueError, match="needs a profile"):
        pol.build_preset("hot-set", [1.0] * 2, 4, 3.0)
    counts = np.array([[5, 0, 9, 1], [9, 2, 0, 7]], float)
    ps = pol.build_preset("hot-set", [1.0] * 2, 4, 3.0, hot_keys=pol.hot_keys_from_counts(counts),
                          profile=counts.ravel())
    assert sorted(ps.cache.resident_keys()) == [2, 4, 7] == _hottest(counts, 3)  # counts 9, 9 and 7
    assert ps.fill_on_miss is False and ps.prefetcher.name() == "none"


def test_engine_and_simulator_hold_the_same_keys(tiny_model):
    """For the same budget (whole slots) the simulator's and the engine's ktransformers, upstream-ncmoe and hot-set
    (the simulator's profile given to the engine as counts) keep the same experts resident."""
    from hybrimoe.model.facts import facts_from_gguf
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.setup import build_policies
    from hybrimoe.sim.simulator import Setup

    path = _model(tiny_model)
    facts = engine_facts(path)
    sb = facts.slot_bytes
    trace = _skewed_trace(path)
    trace.expert_bytes = np.full(trace.n_layers, float(sb))  # the engine's slots: one size for every layer
    hw = pol.load_hardware("paper-a6000")
    for n in (16, 20, 37):
        setup = Setup(trace, hw, n * sb, "decode", facts=facts_from_gguf(path), facts_source="test",
                               max_tokens=50)
        for name in ("ktransformers", "upstream-ncmoe", "hot-set"):
            sim_cache = setup.build(name)[0]
            ours = build_policies(name, facts, n, 3, profile=setup.profile)
            assert sorted(sim_cache.resident_keys()) == sorted(ours.cache.resident_keys()), (name, n)
        kt = build_policies("ktransformers", facts, n, 3)
        assert sorted(kt.cache.resident_keys()) == list(range(16 * (n // 16)))
        hs = build_policies("hot-set", facts, n, 3, profile=setup.profile)
        assert sorted(hs.cache.resident_keys()) == _hottest(setup.profile, n)



def test_the_gpu_cache_above_an_exclusive_ram_tier_takes_its_alpha(tiny_model):
    """Above an exclusive RAM tier the hybrimoe preset's MRS cache ranks with the RAM preset's ``gpu_mrs_alpha``
    (0.01), in the simulator's three-tier runs and in the engine's policies alike; without a RAM tier, and above the
    inclusive one, with the paper's 0.5. Oracle: MRS's update by hand, S <- alpha * s + (1 - alpha) * S from S = 0,
    with s = 1 / top_k for each routed expert when no scores are given (HybriMoE §IV.D)."""
    from hybrimoe.model.facts import facts_from_gguf
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.setup import build_policies
    from hybrimoe.sim.simulator import Setup

    assert pol.gpu_mrs_alpha("hybrimoe-exclusive") == pol.GPU_OVER_EXCLUSIVE_RAM_MRS_ALPHA == 0.01
    assert pol.gpu_mrs_alpha("hybrimoe") is None and pol.gpu_mrs_alpha(None) is None
    with pytest.raises(ValueError, match="unknown RAM-tier preset"):
        pol.gpu_mrs_alpha("exclusive")
    path = _model(tiny_model)
    facts = engine_facts(path)
    trace = _skewed_trace(path)
    k, E = trace.top_k, trace.num_experts
    setup = Setup(trace, pol.load_hardware("paper-a6000"), 8 * facts.slot_bytes, "decode",
                  facts=facts_from_gguf(path), facts_source="test", max_tokens=50, ram_cache="50%",
                  disk="pcie4-nvme")

    def score_after_one_use(cache):
        policy = cache.policy
        policy.reset(cache.n_layers, E)
        policy.observe(obs(0, [3], top_k=k, n_experts=E))
        return policy.score(0, 3)

    for ram, alpha in (("hybrimoe-exclusive", 0.01), ("hybrimoe", 0.5), (None, 0.5)):
        assert score_after_one_use(setup.build("hybrimoe", ram)[0]) == pytest.approx(alpha / k), ram
        engine = build_policies("hybrimoe", facts, 8, 3, ram_preset=ram)
        assert score_after_one_use(engine.cache) == pytest.approx(alpha / k), ram
    # the RAM tier itself: the exclusive preset's MRS remembers longer than the inclusive one's, in the simulator's
    # RAM cache and in the engine's RAM policy (moe_ram_policy None or "mrs") alike
    from hybrimoe.runtime.setup import ram_cache_policy

    for ram, alpha in (("hybrimoe-exclusive", pol.EXCLUSIVE_RAM_MRS_ALPHA), ("hybrimoe", pol.RAM_MRS_ALPHA)):
        assert score_after_one_use(setup.build_ram(ram)[0]) == pytest.approx(alpha / k), ram
        for spec in (None, "mrs"):
            mrs = ram_cache_policy(spec, ram)
            mrs.reset(1, E)
            mrs.observe(obs(0, [3], top_k=k, n_experts=E))
            assert mrs.score(0, 3) == pytest.approx(alpha / k), (ram, spec)
    assert pol.EXCLUSIVE_RAM_MRS_ALPHA == 0.05 and pol.RAM_MRS_ALPHA == 0.1
    # a run of the three-tier table gets it: Setup.run builds its GPU cache with the RAM preset's alpha
    import hybrimoe.sim.simulator as sim

    seen = []

    def recording(*a, **kw):
        seen.append(kw.get("mrs_alpha"))
        return pol.build_preset(*a, **kw)

    sim.build_preset, saved = recording, sim.build_preset
    try:
        for ram in ("hybrimoe-exclusive", "hybrimoe"):
            rec = setup.run("hybrimoe", ram=ram)
            assert rec["ram_policy"] == ram and rec["tokens"] > 0
    finally:
        sim.build_preset = saved
    assert seen == [0.01, None]


# ---- the engine ---------------------------------------------------------------------------------------------------

def _reference(path, rpc_server, tokens, n):
    from hybrimoe import Llama

    ref = Llama(str(path), tensor_buft_overrides="exps=CPU", **_common(rpc_server))
    try:
        return greedy_with_logits(ref, tokens, n)
    finally:
        ref.close()


def test_engine_ktransformers_runs_the_leading_layers_on_the_gpu(tiny_model, rpc_server, split_cost_model):
    """37 slots for 3 MoE layers x 16 experts: the engine's ktransformers gives MoE layers 0 and 1 a slot for every
    expert and layer 2 none, runs experts on the GPU in those two layers only, copies nothing but their first-use
    copies (no demand loads, prefetches or fills), and gives upstream's tokens and logits."""
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import slot_bytes

    path = _model(tiny_model)
    llm = Llama(str(path), moe_cache=37 * slot_bytes(path), moe_policy="ktransformers",
                moe_cost_model=split_cost_model, **_common(rpc_server))
    try:
        eng = llm.moe_engine
        E = 16
        resident = sorted(llm.moe_setup.policies.cache.resident_keys())
        slots = {(l, e): eng.slot_of(l, e) for l in range(3) for e in range(E)}
        tokens = prompt_tokens(llm, 40)
        out, lg = greedy_with_logits(llm, tokens, 12)
        st = llm.moe_stats()["engine"]
        after = sorted(llm.moe_setup.policies.cache.resident_keys())
        slots_after = {(l, e): eng.slot_of(l, e) for l in range(3) for e in range(E)}
    finally:
        llm.close()
    assert resident == after == list(range(2 * E))
    for s in (slots, slots_after):
        assert all(v >= 0 for (l, _), v in s.items() if l < 2)
        assert all(v == -1 for (l, _), v in s.items() if l == 2)
        assert len({v for v in s.values() if v >= 0}) == 2 * E  # one slot each
    layers = st["layers"]
    assert layers[0]["gpu_experts"] > 0 and layers[1]["gpu_experts"] > 0 and layers[2]["gpu_experts"] == 0
    assert layers[0]["cpu_experts"] == 0 and layers[1]["cpu_experts"] == 0 and layers[2]["cpu_experts"] > 0
    assert st["bytes_demand"] == 0 and st["bytes_prefetch"] == 0
    assert all(s["fill_copies"] <= E for s in layers[:2]) and layers[2]["fill_copies"] == 0  # first use only
    assert st["cache"]["evictions"] == 0 and st["cache"]["admissions"] == 0
    ref_out, ref_lg = _reference(path, rpc_server, tokens, 12)
    assert out == ref_out and np.array_equal(lg, ref_lg)


def test_engine_hot_set_from_a_trace_file(tiny_model, rpc_server, split_cost_model, tmp_path):
    """moe_profile=trace.npz: the engine's hot-set holds the trace's hottest (MoE layer, expert) keys, in slots,
    runs them on the GPU, loads nothing at run time, and gives upstream's tokens."""
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import slot_bytes

    path = _model(tiny_model)
    trace = _skewed_trace(path)
    prof = tmp_path / "profile.npz"
    trace.save(prof)
    want = _hottest(_counts(trace), 12)
    llm = Llama(str(path), moe_cache=12 * slot_bytes(path), moe_policy="hot-set", moe_profile=str(prof),
                moe_cost_model=split_cost_model, **_common(rpc_server))
    try:
        eng = llm.moe_engine
        assert sorted(llm.moe_setup.policies.cache.resident_keys()) == want
        assert np.array_equal(llm.moe_setup.profile, _counts(trace))
        assert sorted(l * 16 + e for l in range(3) for e in range(16) if eng.slot_of(l, e) >= 0) == want
        tokens = prompt_tokens(llm, 40)
        out, _ = greedy_with_logits(llm, tokens, 12)
        st = llm.moe_stats()["engine"]
        assert sorted(llm.moe_setup.policies.cache.resident_keys()) == want
    finally:
        llm.close()
    assert st["bytes_demand"] == 0 and st["bytes_prefetch"] == 0 and st["cache"]["admissions"] == 0
    assert st["profile"] == f"routing trace {prof}: {trace.n_tokens} tokens"
    assert st["gpu_experts"] > 0
    ref_out, _ = _reference(path, rpc_server, tokens, 12)
    assert out == ref_out


def test_engine_profile_fills_an_adaptive_cache_and_the_replay_agrees(tiny_model, rpc_server, split_cost_model, tmp_path):
    """With moe_profile the hybrimoe preset's MRS cache starts holding the profile's hottest experts (as the
    simulator's profile fills it), without one it starts empty; the simulator's replay rebuilds the same policies
    (the profile included) and reproduces every decision."""
    from hybrimoe import Llama, _core
    from hybrimoe.runtime.decision_replay import replay_engine_log
    from hybrimoe.runtime.engine_facts import slot_bytes
    from hybrimoe.runtime.setup import build_policies

    path = _model(tiny_model)
    trace = _skewed_trace(path, seed=9)
    prof = tmp_path / "profile.npz"
    trace.save(prof)
    kw = dict(moe_cache=12 * slot_bytes(path), moe_policy="hybrimoe", moe_cost_model=split_cost_model,
              **_common(rpc_server))
    plain = Llama(str(path), **kw)
    try:
        assert plain.moe_setup.policies.cache.resident_keys() == [] and plain.moe_setup.profile is None
    finally:
        plain.close()
    llm = Llama(str(path), moe_profile=str(prof), **kw)
    try:
        assert sorted(llm.moe_setup.policies.cache.resident_keys()) == _hottest(_counts(trace), 12)
        llm.moe_log()
        greedy_with_logits(llm, prompt_tokens(llm, 40), 8)
        log = llm.moe_take_log()
        assert log and _core.first_difference(log, replay_engine_log(llm, log)) == ""
        # negative control: the same preset rebuilt without the profile starts empty and decides otherwise
        setup = llm.moe_setup
        bare = build_policies("hybrimoe", setup.facts, setup.n_slots, setup.prefetch_layers)
        assert _core.first_difference(log, replay_engine_log(llm, log, policies=bare)) != ""
    finally:
        llm.close()


# ---- bad profiles ------------------------------------------------------------------------------------------------

def test_bad_profiles_are_named_errors(tiny_model, tmp_path):
    from hybrimoe import Llama

    path = _model(tiny_model)

    def load(**kw):
        return Llama(str(path), n_ctx=64, verbose=False, **kw)

    with pytest.raises(ValueError, match="moe_policy 'hot-set' needs moe_profile"):
        load(moe_cache=0, moe_policy="hot-set")
    with pytest.raises(ValueError, match="moe_profile set without moe_cache"):
        load(moe_profile=str(tmp_path / "x.npz"))
    other = tmp_path / "other.npz"
    _skewed_trace(None, shape=(2, 8, 2)).save(other)
    with pytest.raises(ValueError, match=r"moe_profile .*other\.npz: the trace has 2 MoE layers x 8 experts; the "
                                         r"model .* has 3 MoE layers x 16 experts"):
        load(moe_cache=0, moe_policy="hot-set", moe_profile=str(other))
    with pytest.raises(FileNotFoundError, match="moe_profile: trace file not found"):
        load(moe_cache=0, moe_policy="hot-set", moe_profile=str(tmp_path / "missing.npz"))
    junk = tmp_path / "junk.npz"
    junk.write_text("not a zip")
    with pytest.raises(ValueError, match="moe_profile: .*junk.npz is not a .npz trace"):
        load(moe_cache=0, moe_policy="hot-set", moe_profile=str(junk))
    with pytest.raises(ValueError, match=r"shape \(2, 16\), expected \(3, 16\)"):
        load(moe_cache=0, moe_policy="hot-set", moe_profile=np.ones((2, 16)))
    with pytest.raises(ValueError, match="finite and >= 0"):
        load(moe_cache=0, moe_policy="hot-set", moe_profile=-np.ones((3, 16)))
    with pytest.raises(ValueError, match="online is not implemented"):
        load(moe_cache=0, moe_policy="hot-set", moe_profile=64)
    # a trace of incomplete tokens only
    tr = _skewed_trace(path, n_prompts=1, n_tok=3)
    tr.expert_ids[:, 0, 0] = -1
    bad = tmp_path / "bad.npz"
    tr.save(bad)
    with pytest.raises(ValueError, match="no complete token to count \\(3 incomplete\\)"):
        load(moe_cache=0, moe_policy="hot-set", moe_profile=str(bad))


def test_cli_run_hot_set(tiny_model, rpc_server, split_cost_model, tmp_path):
    """``hybrimoe run --moe-policy hot-set`` needs ``--moe-profile`` (exit 1, the option named) and runs with one."""
    from hybrimoe.runtime.engine_facts import slot_bytes

    path = _model(tiny_model)
    prof = tmp_path / "p.npz"
    _skewed_trace(path).save(prof)
    base = [sys.executable, "-m", "hybrimoe", "run", "-m", str(path), "-p", "Once upon a time", "-n", "4",
            "--temp", "0", "--rpc", rpc_server.endpoint, "-ngl", "99", "--moe-cache", str(8 * slot_bytes(path)),
            "--moe-policy", "hot-set", "--moe-cost-model", split_cost_model, "--moe-stats"]
    bad = subprocess.run(base, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert bad.returncode == 1 and "needs moe_profile (the CLI's --moe-profile)" in bad.stderr, bad.stderr
    ok = subprocess.run(base + ["--moe-profile", str(prof)], capture_output=True, text=True, timeout=300,
                        cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "engine hot-set" in ok.stderr and f"profile: routing trace {prof}" in ok.stderr


def test_the_engine_ram_policy_takes_the_simulators_ram_preset_names():
    """moe_ram_policy "hybrimoe" and "hybrimoe-reuse" (``simulate --ram-policies``' names) run the cache policies those
    presets run (MRS at the RAM tier's alpha, the reuse predictor); an unknown name's error lists both spellings."""
    from hybrimoe import _core
    from hybrimoe.policy import presets as pol
    from hybrimoe.runtime.setup import ram_cache_policy

    assert type(ram_cache_policy("hybrimoe")) is type(ram_cache_policy("mrs")) is _core.MRSPolicy
    assert type(ram_cache_policy("hybrimoe-reuse")) is type(ram_cache_policy("reuse")) is _core.ReusePolicy
    assert type(pol.ram_cache_policy_of("hybrimoe-reuse")) is _core.ReusePolicy
    with pytest.raises(ValueError, match="hybrimoe and hybrimoe-reuse"):
        ram_cache_policy("hybrimoe-exclusive")
