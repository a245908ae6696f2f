"""Event-driven simulator: conservation checks, planner == truth when the truth adds nothing, determinism,
system presets and the ``hybrimoe simulate`` command, on any model (facts from a GGUF or carried by the trace), with
the stages' phase tokens and incomplete tokens dropped on request."""
import argparse
import json

import numpy as np
import pytest

from hybrimoe import _core
from hybrimoe import policy as pol
from hybrimoe.commands import simulate as simulate_command
from hybrimoe.model.facts import MODEL_FACTS
from hybrimoe.sim.simulator import Setup, stage_core_trace, total_times
from hybrimoe.traces.format import RoutingTrace

MB = 1e6


def synthetic(n_tok=400, n_layers=5, n_exp=16, k=2, seed=0, prompts=(0, 50, 120, 260, 400)):
    rng = np.random.default_rng(seed)
    p = np.exp(-np.arange(n_exp) / 3.0)
    ids = np.array([[rng.choice(n_exp, k, replace=False, p=p / p.sum()) for _ in range(n_layers)]
                    for _ in range(n_tok)], dtype=np.int16)
    return RoutingTrace(expert_ids=ids, prompt_offsets=np.array(prompts), num_experts=n_exp, top_k=k,
                        expert_bytes=np.full(n_layers, 2 * MB), n_dense_layers=1, model="")


def costs():
    c = _core.CostModel()
    c.cpu_a_s, c.cpu_b_s, c.cpu_startup_s = 1e-4, 1e-6, 2e-5
    c.gpu_a_s, c.gpu_b_s = 2e-5, 1e-7
    c.h2d_bandwidth_Bps, c.h2d_latency_s = 12e9, 1e-5
    c.act_a_s, c.act_b_s, c.layer_a_s, c.layer_b_s, c.dense_a_s = 2e-5, 1e-9, 1e-4, 1e-7, 2e-4
    return c


def quiet_truth():
    t = _core.TruthModel()
    t.cpu_noise = t.gpu_noise = t.h2d_noise = t.act_noise = t.layer_noise = 0.0
    return t


def cfg(stage="decode", depth=0, fill=False):
    c = _core.SimConfig()
    c.stage, c.prefetch_depth, c.fill_on_miss, c.ubatch = stage, depth, fill, 64
    return c


@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_truth_equals_planner_when_it_adds_nothing(stage):
    """No noise, no contention, no extra start-up, no prefetch or fills, a cache that never refuses a planned load
    (16 of 80 experts: a layer's pinned experts never fill it): the charged MoE time must equal the sum of the
    planner's predicted makespans, and the total must add the non-expert costs exactly."""
    tr = synthetic().to_core()
    c = costs()
    cache = _core.ExpertCache([2 * MB] * 5, 16, 32 * MB, _core.LRUPolicy())
    res = _core.simulate(tr, cache, _core.HybriMoEScheduler(), _core.NoPrefetcher(), c, c, quiet_truth(),
                         cfg(stage), 0, tr.n_prompts)
    assert res.cache.declined == 0 and res.bytes_demand > 0
    assert res.charged_moe_s == pytest.approx(res.predicted_moe_s, rel=1e-9)
    steps = _core.make_steps(tr, 0, tr.n_prompts, cfg(stage))
    non_expert = sum(c.dense(e - b) + 5 * c.layer(e - b) for b, e, _ in steps)
    assert res.total_s == pytest.approx(non_expert + res.charged_moe_s, rel=1e-9)
    assert res.tokens == 400 and res.steps == len(steps)


def test_a_refused_load_runs_on_the_cpu_as_in_the_engine():
    """The engine's rule (policy/decision.h): a planned load the cache refuses (here: 4 slots, prefill ubatches
    activating more experts, all pinned) runs on the CPU. The prediction is that of the split run (the plan
    re-evaluated with the refused loads on the CPU), so with a noise-free truth the charge equals it."""
    tr = synthetic().to_core()
    c = costs()
    cache = _core.ExpertCache([2 * MB] * 5, 16, 8 * MB, _core.LRUPolicy())
    res = _core.simulate(tr, cache, _core.HybriMoEScheduler(), _core.NoPrefetcher(), c, c, quiet_truth(),
                         cfg("prefill"), 0, tr.n_prompts)
    assert res.cache.declined > 0
    assert res.charged_moe_s == pytest.approx(res.predicted_moe_s, rel=1e-9)


def test_accesses_and_hits_are_counted_per_layer_and_ubatch():
    rt = synthetic()
    tr = rt.to_core()
    c = costs()
    cache = _core.ExpertCache([2 * MB] * 5, 16, 0.0, _core.LRUPolicy())
    res = _core.simulate(tr, cache, _core.HybriMoEScheduler(), _core.NoPrefetcher(), c, c, quiet_truth(),
                         cfg("prefill"), 0, tr.n_prompts)
    want = 0
    for b, e, _ in _core.make_steps(tr, 0, tr.n_prompts, cfg("prefill")):
        for l in range(5):
            want += len(np.unique(rt.expert_ids[b:e, l]))
    assert res.cache.accesses == want
    assert res.cache.misses == want and res.cache.hit_rate == 0.0
    assert res.bytes_h2d == res.bytes_demand


def test_noise_is_seeded_and_changes_the_charge():
    tr = synthetic().to_core()
    c = costs()

    def once(seed):
        t = _core.TruthModel()
        t.seed = seed
        t.contention = 0.2
        cache = _core.ExpertCache([2 * MB] * 5, 16, 8 * MB, _core.MRSPolicy())
        return _core.simulate(tr, cache, _core.HybriMoEScheduler(), _core.ImpactPrefetcher(), c, c, t,
                              cfg(depth=3, fill=True), 0, tr.n_prompts)

    a, b, d = once(1), once(1), once(2)
    assert a.total_s == b.total_s and a.bytes_h2d == b.bytes_h2d
    assert a.total_s != d.total_s
    assert a.charged_moe_s != pytest.approx(a.predicted_moe_s, rel=1e-6)


def test_baselines_behave_as_named():
    tr = synthetic().to_core()
    c = costs()
    t = quiet_truth()
    stat = _core.ExpertCache([2 * MB] * 5, 16, 8 * MB, _core.StaticPolicy([0, 1, 2, 3], []))
    stat.fill([0, 1, 2, 3])
    kt = _core.simulate(tr, stat, _core.CpuUncachedScheduler(), _core.NoPrefetcher(), c, c, t, cfg(fill=True), 0, 4)
    assert kt.bytes_h2d == 0 and sorted(stat.resident_keys()) == [0, 1, 2, 3]
    gpu = _core.simulate(tr, _core.ExpertCache([2 * MB] * 5, 16, 8 * MB, _core.LRUPolicy()),
                         _core.GpuOnDemandScheduler(), _core.NoPrefetcher(), c, c, t, cfg(), 0, 4)
    assert gpu.cpu_busy_s == 0 and gpu.bytes_demand == gpu.cache.misses * 2 * MB


def test_prefetch_issues_copies_and_timeline_is_recorded():
    tr = synthetic().to_core()
    c = costs()
    cache = _core.ExpertCache([2 * MB] * 5, 16, 8 * MB, _core.MRSPolicy())
    res = _core.simulate(tr, cache, _core.HybriMoEScheduler(), _core.ImpactPrefetcher(), c, c, _core.TruthModel(),
                         cfg(depth=3, fill=True), 0, tr.n_prompts)
    assert res.prefetch_issued > 0 and res.bytes_prefetch == res.prefetch_issued * 2 * MB
    assert res.cache.prefetch_hits > 0
    assert {e.resource for e in res.timeline} >= {0, 1}
    assert all(e.end_s >= e.start_s >= 0 for e in res.timeline)
    assert all(e.step == 0 and e.layer < 4 for e in res.timeline)


def test_bad_simulator_inputs():
    tr = synthetic().to_core()
    c = costs()
    cache = _core.ExpertCache([2 * MB] * 5, 16, 8 * MB, _core.LRUPolicy())
    args = (tr, cache, _core.HybriMoEScheduler(), _core.NoPrefetcher(), c, c, _core.TruthModel())
    with pytest.raises(ValueError, match="prompt range"):
        _core.simulate(*args, cfg(), 0, 99)
    bad = cfg()
    bad.stage = "train"
    with pytest.raises(ValueError, match="stage"):
        _core.simulate(*args, bad, 0, 1)
    wrong = _core.ExpertCache([2 * MB] * 3, 16, 8 * MB, _core.LRUPolicy())
    with pytest.raises(ValueError, match="does not match the trace"):
        _core.simulate(tr, wrong, *args[2:], cfg(), 0, 1)
    neg = costs()
    neg.cpu_a_s = -1.0
    with pytest.raises(ValueError, match="cpu_a_s"):
        _core.simulate(tr, cache, args[2], args[3], neg, c, args[6], cfg(), 0, 1)


# ---- presets and the command ------------------------------------------------------------------------------------

def test_every_system_preset_runs_on_a_synthetic_trace(tmp_path):
    rt = synthetic()
    rt.model = "deepseek-v2-lite"   # facts for the cost model only
    setup = Setup(rt, pol.load_hardware("paper-a6000"), "25%", "decode", max_tokens=200)
    recs = [setup.run(n) for n in simulate_command.DEFAULT_POLICIES]
    for r in recs:
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["tokens_per_s"] > 0 and r["tpot_s"] > 0
    by = {r["policy"]: r for r in recs}
    assert by["ktransformers"]["bytes_h2d"] == 0 and by["upstream-ncmoe"]["bytes_h2d"] == 0
    assert by["hot-set"]["bytes_h2d"] == 0
    assert by["gpu-on-demand"]["cpu_busy_frac"] == 0


@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_a_bound_check_stops_the_oracle_only_where_the_verdict_is_known(stage):
    """Setup.run(enough_s=...) stops the oracle's alternative plans at the first one within enough_s; enough_s 0
    runs every plan (the record is the bound's); total_times' bound_tolerance gives each bound check the verdict the
    full oracle gives, and the presets before it their own times."""
    rt = synthetic()
    rt.model = "deepseek-v2-lite"
    hw = pol.load_hardware("paper-a6000")
    full = Setup(rt, hw, "25%", stage, max_tokens=200).run("oracle")
    assert "plans_not_run" not in full
    assert _untimed(Setup(rt, hw, "25%", stage, max_tokens=200).run("oracle", enough_s=0.0)) == _untimed(full)
    first = Setup(rt, hw, "25%", stage, max_tokens=200).run("oracle", enough_s=float("inf"))
    assert first["plan"] == "oracle" and first["plans_not_run"][0] == "belady"
    assert first["total_s"] >= full["total_s"]
    assert ("oracle+streaming" in first["plans_not_run"]) == (stage == "prefill")
    names = ("hybrimoe",) + pol.STATIC_PRESETS + ("oracle",)
    for cache in ("10%", "25%", "75%"):
        every = total_times(rt, "paper-a6000", cache, stage, names, max_tokens=200)
        checked = total_times(rt, "paper-a6000", cache, stage, names, max_tokens=200, bound_tolerance=1e-9)
        assert {n: checked[n] for n in names[:-1]} == {n: every[n] for n in names[:-1]}
        others = (1 + 1e-9) * min(every[n] for n in names[:-1])
        assert (checked["oracle"] <= others) == (every["oracle"] <= others)
        assert checked["oracle"] >= every["oracle"]
    with pytest.raises(ValueError, match="bound tolerance must be >= 0"):
        total_times(rt, "paper-a6000", "25%", stage, names, max_tokens=200, bound_tolerance=-1.0)


def _args(**kw):
    p = argparse.ArgumentParser()
    simulate_command.add_arguments(p)
    argv = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [f"{flag}={v}"]
    return p.parse_args(argv)


def test_command_rejects_bad_names(tmp_path, monkeypatch, capsys):
    """The flags are checked before the trace is looked up: a typo is named even where no trace is (a fresh clone
    has no shared trace beside it)."""
    monkeypatch.setattr(simulate_command, "default_trace_path", lambda: tmp_path / "no-such-trace.npz")
    assert simulate_command.run(_args(policies="hybrimoe,nope", no_progress=True)) == 2
    assert "unknown policy preset 'nope'" in capsys.readouterr().err
    assert simulate_command.run(_args(hardware="tpu-v9", no_progress=True)) == 2
    assert "unknown hardware preset 'tpu-v9'" in capsys.readouterr().err
    assert simulate_command.run(_args(moe_cache="-5%", no_progress=True)) == 2
    assert "within 0..100" in capsys.readouterr().err
    assert simulate_command.run(_args(no_progress=True)) == 2  # the flags are fine: now the missing trace
    assert "no-such-trace.npz" in capsys.readouterr().err


def test_a_missing_default_trace_names_the_flag_and_the_variable(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "shared" / "traces" / "dsv2lite_dev.npz"
    monkeypatch.setattr(simulate_command, "default_trace_path", lambda: missing)
    assert simulate_command.run(_args(no_progress=True)) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "--trace" in err and "HYBRIMOE_TRACE" in err, err


def test_command_on_the_dsv2lite_trace(dev_trace, tmp_path, capsys):
    path = dev_trace
    out = tmp_path / "r.json"
    rc = simulate_command.run(_args(trace=path, stage="prefill", policies="hybrimoe,ktransformers", max_tokens=3000,
                            json=out, no_progress=True))
    assert rc == 0
    recs = json.loads(out.read_text())
    assert [r["policy"] for r in recs] == ["hybrimoe", "ktransformers"]
    for r in recs:
        for key in ("policy", "hit_rate", "tokens_per_s", "ttft_s", "bytes_h2d"):
            assert key in r
    assert "| hybrimoe |" in capsys.readouterr().out


def test_progress_bar_only_on_a_terminal_or_when_asked(dev_trace, tmp_path, capsys, monkeypatch):
    """Without --no-progress, simulate draws its bar on a terminal only: into a redirected stderr (pytest's capture
    here) nothing but its lines, with HYBRIMOE_PROGRESS=1 the bar too (hybrimoe.envs.progress_on)."""
    path = dev_trace
    monkeypatch.delenv("HYBRIMOE_PROGRESS", raising=False)
    kw = dict(trace=path, stage="prefill", policies="ktransformers", max_tokens=500)
    assert simulate_command.run(_args(**kw)) == 0
    assert "simulate prefill" not in capsys.readouterr().err
    monkeypatch.setenv("HYBRIMOE_PROGRESS", "1")
    assert simulate_command.run(_args(**kw)) == 0
    assert "simulate prefill" in capsys.readouterr().err


def test_simulate_checks_outputs_before_running(tmp_path, capsys):
    """Unwritable outputs are reported before the (long) simulation, as bad input (exit 2)."""
    parser = argparse.ArgumentParser()
    simulate_command.add_arguments(parser)
    afile = tmp_path / "f.txt"
    afile.write_text("x")
    for extra in (["--json", str(tmp_path)], ["--json", str(tmp_path / "no" / "such" / "x.json")],
                  ["--plot", str(afile)]):
        args = parser.parse_args(["--trace", str(tmp_path / "missing.npz"), "--no-progress", *extra])
        assert simulate_command.run(args) == 2
        err = capsys.readouterr().err
        assert ("--json" in err or "--plot" in err) and "missing.npz" not in err
    assert afile.read_text() == "x"


# ---- any model: facts from a GGUF or carried by the trace; phases; incomplete tokens -------------------------------

def for_model(path, n_prompts=10, prefill=12, decode=8, seed=3, **kw):
    """A trace of random routing shaped for the GGUF at ``path`` (its MoE layers, experts, top-k), each prompt
    ``prefill`` prefill-phase then ``decode`` decode-phase tokens; bogus expert bytes (1.0) unless given."""
    from hybrimoe.model.reader import describe

    d = describe(path)
    L, E, k = len(d["moe_layers"]), d["n_expert"], d["n_expert_used"]
    n = n_prompts * (prefill + decode)
    rng = np.random.default_rng(seed)
    ids = np.array([[rng.choice(E, k, replace=False) for _ in range(L)] for _ in range(n)], dtype=np.int16)
    phases = np.tile(np.r_[np.zeros(prefill), np.ones(decode)].astype(np.int8), n_prompts)
    args = dict(expert_ids=ids, prompt_offsets=np.arange(0, n + 1, prefill + decode), num_experts=E, top_k=k,
                expert_bytes=np.ones(L), n_dense_layers=len(d["dense_layers"]), phases=phases, model="")
    args.update(kw)
    return RoutingTrace(**args)


def _run(capsys, **kw):
    capsys.readouterr()
    kw.setdefault("force", True)  # these tests write one --json file again and again
    rc = simulate_command.run(_args(no_progress=True, policies="hybrimoe,ktransformers", **kw))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_simulate_a_model_from_its_gguf_alone(tiny_model, tmp_path, capsys):
    """``simulate -m tiny.gguf --trace T``: a model with no built-in facts, its trace without facts; the facts, the
    expert bytes per layer and the non-expert costs all come from the GGUF."""
    from hybrimoe.model.facts import facts_from_gguf

    gguf_path = tiny_model("qwen3moe", "Q8_0")
    facts = facts_from_gguf(gguf_path)
    trace = tmp_path / "t.npz"
    for_model(gguf_path).save(trace)
    rc, _, err = _run(capsys, trace=trace)
    assert rc == 2 and "no model facts" in err and "-m MODEL.gguf" in err and "--model-facts NAME" in err \
        and "carries its facts" in err
    out_json = tmp_path / "r.json"
    rc, out, err = _run(capsys, trace=trace, model=gguf_path, stage="prefill", json=out_json)
    assert rc == 0, err
    assert f"expert bytes per layer from {gguf_path}, mean 6528; the trace's differ" in out
    recs = json.loads(out_json.read_text())
    assert [r["policy"] for r in recs] == ["hybrimoe", "ktransformers"]
    for r in recs:
        assert r["tokens"] == 8 * 12 and r["ttft_s"] > 0  # 2 of 10 prompts profile; 12 prefill tokens each
        assert r["assumptions"]["model_facts"] == f"{facts.name}: read from {gguf_path} (-m)"
        assert "prefill-phase tokens" in r["assumptions"]["stage_model"]
    assert recs[0]["budget_bytes"] == pytest.approx(0.25 * 2 * 8 * 6528)  # 25% of the GGUF's expert bytes
    # the non-expert costs are the facts' real bytes, not DeepSeek constants
    hw = pol.load_hardware("paper-a6000")
    cm = pol.cost_model_from_hardware(hw, facts)
    f = hw.facts
    assert cm.layer_a_s == pytest.approx(f["gpu_kernels_per_layer"] * f["gpu_kernel_launch_s"] + 15744 /
                                         (f["gpu_mem_bandwidth_Bps"] * f["gpu_mem_efficiency"]))
    assert cm.cpu_a_s == pytest.approx(6528 / (f["cpu_mem_bandwidth_Bps"] * f["cpu_mem_efficiency"]))
    # a trace that carries the facts needs no -m
    for_model(gguf_path, facts=facts, expert_bytes=facts.per_layer_expert_bytes()).save(tmp_path / "f.npz")
    rc, out, err = _run(capsys, trace=tmp_path / "f.npz", json=out_json)
    assert rc == 0, err
    recs = json.loads(out_json.read_text())
    assert recs[0]["assumptions"]["model_facts"] == f"{facts.name}: carried by the trace"
    assert recs[0]["tokens"] == 8 * 8 and "decode-phase tokens" in recs[0]["assumptions"]["stage_model"]


def test_a_gguf_of_another_shape_is_refused(tiny_model, tmp_path, capsys):
    trace = tmp_path / "t.npz"
    for_model(tiny_model("qwen3moe", "Q8_0")).save(trace)  # 2 MoE layers, 8 experts, top-2
    other = tiny_model("deepseek2", "Q8_0")                  # 2 MoE layers, 6 experts, top-2
    rc, _, err = _run(capsys, trace=trace, model=other)
    assert rc == 2
    assert f"has 2 MoE layers, 8 experts, top-2; the model {other} has 2 MoE layers, 6 experts, top-2" in err
    assert len(err.strip().splitlines()) == 1
    rc, _, err = _run(capsys, trace=trace, model="deepseek-v2-lite")
    assert rc == 2 and "--model-facts deepseek-v2-lite" in err
    rc, _, err = _run(capsys, trace=trace, model=other, model_facts="deepseek-v2-lite")
    assert rc == 2 and "not both" in err
    # built-in facts of another shape are refused as a GGUF of another shape is
    rc, _, err = _run(capsys, trace=trace, model_facts="deepseek-v2-lite")
    assert rc == 2 and "the built-in model facts 'deepseek-v2-lite' has 26 MoE layers, 64 experts, top-6" in err


def test_stages_take_their_phase_tokens():
    """With phases, prefill simulates the prefill-phase tokens and decode the decode-phase ones; without phases
    both take every token; a stage without tokens is an error naming the other stage."""
    facts = MODEL_FACTS["deepseek-v2-lite"]  # for the cost model only
    rt = synthetic(n_tok=400, prompts=tuple(range(0, 401, 40)))  # 10 prompts of 40 tokens
    rt.phases = np.tile(np.r_[np.zeros(30), np.ones(10)].astype(np.int8), 10)
    hw = pol.load_hardware("paper-a6000")

    def tokens(tr, stage):
        s = Setup(tr, hw, "25%", stage, max_tokens=0, facts=facts, facts_source="test")
        return s.run("hybrimoe")["tokens"]

    assert (tokens(rt, "prefill"), tokens(rt, "decode")) == (8 * 30, 8 * 10)  # the first 2 prompts profile
    rt_all = synthetic(n_tok=400, prompts=tuple(range(0, 401, 40)))
    assert (tokens(rt_all, "prefill"), tokens(rt_all, "decode")) == (8 * 40, 8 * 40)
    rt.phases = np.zeros(400, np.int8)
    with pytest.raises(ValueError, match="no decode-phase tokens .*simulate --stage prefill"):
        Setup(rt, hw, "25%", "decode", facts=facts)


def _untimed(record: dict) -> dict:
    """A run's record without the measured decision times (the one part that differs between identical runs)."""
    return {k: v for k, v in record.items() if not k.endswith("_us_mean")}


def test_a_shared_core_trace_gives_the_same_records_and_a_wrong_one_is_refused():
    """Setups of one trace and stage may share the C++ trace (stage_core_trace): every record is as with a trace
    built by the Setup itself; the other stage's C++ trace of a phased trace is refused, naming what differs."""
    facts = MODEL_FACTS["deepseek-v2-lite"]
    rt = synthetic(n_tok=400, prompts=tuple(range(0, 401, 40)))
    rt.phases = np.tile(np.r_[np.zeros(30), np.ones(10)].astype(np.int8), 10)
    hw = pol.load_hardware("paper-a6000")
    for stage in ("decode", "prefill"):
        core = stage_core_trace(rt, stage)
        for name in ("hybrimoe", "hot-set", "oracle"):
            mine = Setup(rt, hw, "25%", stage, facts=facts, facts_source="test").run(name)
            shared = Setup(rt, hw, "25%", stage, facts=facts, facts_source="test", core_trace=core).run(name)
            assert _untimed(shared) == _untimed(mine), (stage, name)
    with pytest.raises(ValueError, match=r"core_trace is not the decode tokens of this trace: n_tokens 300 "
                                         r"\(trace: 100\)"):
        Setup(rt, hw, "25%", "decode", facts=facts, core_trace=stage_core_trace(rt, "prefill"))


def test_drop_incomplete(tiny_model, tmp_path, capsys):
    """Tokens the recorder did not finish (-1 ids) and a NaN score: without --drop-incomplete one line naming the
    first token, its prompt and layer; with it they are left out and counted."""
    gguf_path = tiny_model("qwen3moe", "Q8_0")
    tr = for_model(gguf_path, router_scores=np.full((200, 2, 8), 0.125, np.float32))
    tr.expert_ids[155, 1] = -1           # prompt 7 (a decode token), the last layer not reached
    tr.expert_ids[199, 0:2] = -1         # the last token of the last prompt (an interrupted recording)
    tr.router_scores[60, 0, 5] = np.nan  # prompt 3
    tr.partial = True
    trace = tmp_path / "p.npz"
    tr.save(trace)
    rc, _, err = _run(capsys, trace=trace, model=gguf_path)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "token 60 (prompt 3), MoE layer 0: the router score of expert 5 is nan; 3 token(s)" in err
    assert "--drop-incomplete" in err
    out_json = tmp_path / "r.json"
    rc, out, err = _run(capsys, trace=trace, model=gguf_path, drop_incomplete=True, stage="decode",
                        max_tokens=0, json=out_json)
    assert rc == 0, err
    assert "dropped 3 incomplete token(s)" in out and "197 left" in out
    assert "decode: the decode-phase tokens" in out and "partial trace: yes" in out  # the printed assumptions
    rec = json.loads(out_json.read_text())[0]
    assert rec["tokens"] == 8 * 8 - 2  # decode tokens of prompts 2..9, less tokens 155 and 199 (60 is prefill)
    assert rec["assumptions"]["incomplete_tokens"] == "3 dropped (--drop-incomplete)"
    assert rec["assumptions"]["partial_trace"].startswith("yes")


def test_model_facts_by_name_on_the_dsv2lite_trace(dev_trace, tmp_path, capsys):
    path = dev_trace
    out_json = tmp_path / "r.json"
    rc, _, err = _run(capsys, trace=path, model_facts="deepseek-v2-lite", max_tokens=500, json=out_json)
    assert rc == 0, err
    rec = json.loads(out_json.read_text())[0]
    assert rec["assumptions"]["model_facts"] == "deepseek-v2-lite: built-in model facts 'deepseek-v2-lite' " \
                                                "(--model-facts)"
    assert "the trace has no phases" in rec["assumptions"]["stage_model"] and rec["tokens"] >= 500
    rc, _, err = _run(capsys, trace=path, model_facts="mixtral")
    assert rc == 2 and "unknown model facts 'mixtral'" in err


@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_impact_prefetch_shares_evaluations_without_changing_a_plan(stage):
    """ImpactPrefetcher's shared evaluations (MakespanEvaluator::equal_result_key: candidates that cannot differ are
    evaluated once) give the plans of evaluating every candidate: the same simulated run, field for field, with
    fewer evaluations in decode, where every predicted expert has a load of one token."""
    from hybrimoe.policy.hardware import load_hardware
    from hybrimoe.traces.synthetic import synthetic_trace

    tr = synthetic_trace("qwen3-30b-a3b", 400, locality="low", seed=0)
    s = Setup(tr, load_hardware("h200"), "25%", stage, max_tokens=200, seed=1)
    recs, evaluations = [], []
    for share in (True, False):
        cache, sched, _, cfg = s.build("hybrimoe")
        pre = _core.ImpactPrefetcher(share_equal_evaluations=share)
        rec = s.run("hybrimoe", cache, sched, pre, cfg)
        recs.append({k: v for k, v in rec.items() if not k.endswith("_us_mean")})  # wall-clock fields differ
        evaluations.append(pre.evaluations)
    assert recs[0]["prefetch_issued"] > 0
    assert recs[0] == recs[1]
    if stage == "decode":
        assert evaluations[0] < 0.8 * evaluations[1], evaluations
    else:
        assert evaluations[0] <= evaluations[1], evaluations


def test_a_decode_run_can_prefill_each_prompt_first():
    """SimConfig.prompt_tokens: in decode each prompt's first tokens run as prefill ubatches (of ``ubatch``), then
    the rest one per step, as a server runs a request; every token once, in order; 0 decodes every token; a
    negative value is refused."""
    rt = synthetic()
    tr = rt.to_core()
    c = cfg("decode")
    c.ubatch = 16
    c.prompt_tokens = 40
    steps = _core.make_steps(tr, 0, tr.n_prompts, c)
    for p in range(tr.n_prompts):
        b, e = int(rt.prompt_offsets[p]), int(rt.prompt_offsets[p + 1])
        mine = [(s, t) for s, t, q in steps if q == p]
        assert mine[0][0] == b and mine[-1][1] == e
        assert all(x[1] == y[0] for x, y in zip(mine, mine[1:]))
        pe = min(e, b + 40)
        want = [min(16, pe - s) for s in range(b, pe, 16)]  # the prompt's tokens in ubatches of 16
        assert [t - s for s, t in mine if s < pe] == want
        assert all(t - s == 1 for s, t in mine if s >= pe)
    c.prompt_tokens = 0
    assert all(t - s == 1 for s, t, _ in _core.make_steps(tr, 0, tr.n_prompts, c))
    c.prompt_tokens = -1
    with pytest.raises(ValueError, match="prompt_tokens"):
        c.validate()
