"""The simulator over several GPUs (hybrimoe._core.simulate_devices, hybrimoe.sim.simulator.Setup's ``devices``).

- one device through simulate_devices is simulate, to the bit;
- llama.cpp's layer split (layer_devices) is the one the engine reads from llama.cpp (tests/runtime/
  test_multi_device.py checks that side against a real load);
- each device's cache holds only its own layers, its counters add up to the run's, and a device prefetches only its
  own layers;
- a shared link is never faster than a link per device for the same plans (the copies queue on one link);
- bad arguments are refused with the reason.
"""
from __future__ import annotations

import pytest

from hybrimoe import _core
from hybrimoe.policy.hardware import load_hardware
from hybrimoe.sim.simulator import TS_NCMOE, Setup, layer_devices
from hybrimoe.traces.synthetic import synthetic_trace


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace("qwen3-30b-a3b", 600, locality="high", seed=3)


def test_layer_split_as_llama_cpp():
    # 8 layers + the output layer, split 1:1: il / 9 < 0.5 -> layers 0-4 on the first device
    assert layer_devices(0, 8, 2) == [0] * 5 + [1] * 3
    assert layer_devices(0, 8, 2, [3, 1]) == [0] * 7 + [1]
    # a leading dense layer counts: MoE layer m is model layer m + 1
    assert layer_devices(1, 7, 2, [3, 1]) == [0] * 6 + [1]
    assert layer_devices(0, 6, 1) == [0] * 6
    with pytest.raises(ValueError, match="proportions"):
        layer_devices(0, 8, 2, [1, 1, 1])


@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_one_device_is_simulate(trace, stage):
    s = Setup(trace, load_hardware("rtx4090-desktop"), "25%", stage, max_tokens=300, seed=2)
    a_parts, b_parts = s.build("hybrimoe"), s.build("hybrimoe")
    a = _core.simulate(s.core_trace, *a_parts[:3], s.planner, s.truth_cost, s.truth, a_parts[3], s.first, s.end)
    b = _core.simulate_devices(s.core_trace, [(*b_parts[:3], s.planner, s.truth_cost)], [], False, s.truth,
                               b_parts[3], s.first, s.end)
    assert a.total_s == b.total_s
    assert a.cache.accesses == b.cache.accesses and a.cache.misses == b.cache.misses
    assert a.bytes_h2d == b.bytes_h2d == b.device_bytes_h2d[0]


@pytest.mark.parametrize("stage", ["decode", "prefill"])
def test_two_devices_keep_their_own_layers(trace, stage):
    s = Setup(trace, load_hardware("2x-rtx3090"), "25%", stage, max_tokens=300, seed=2)
    assert s.n_devices == 2 and not s.shared_link
    assert sorted(set(s.layer_device)) == [0, 1]
    caches, scheds, pres, cfg = s.build("hybrimoe")
    res = s.simulate(caches, scheds, pres, s.planner, cfg)
    E = trace.num_experts
    for d, c in enumerate(caches):
        held = {k // E for k in c.resident_keys()}
        assert held <= {m for m, x in enumerate(s.layer_device) if x == d}, (d, held)
        # each device's budget is 25% of its own layers' experts
        mine = sum(b for b, x in zip(s.expert_bytes, s.layer_device) if x == d) * E
        assert c.budget_bytes == pytest.approx(0.25 * mine)
    assert len(res.device_cache) == 2
    assert sum(c.accesses for c in res.device_cache) == res.cache.accesses
    assert sum(res.device_bytes_h2d) == pytest.approx(res.bytes_h2d)
    assert sum(res.device_link_busy_s) == pytest.approx(res.link_busy_s)
    assert all(c.accesses > 0 for c in res.device_cache)


def test_a_shared_link_queues_the_copies(trace):
    """The same static-free plans over one link take at least as long as over a link each, and the devices' copies
    then never overlap in time (their busy seconds add up to no more than the run)."""
    times = {}
    for shared in (False, True):
        s = Setup(trace, load_hardware("2x-rtx3090"), "10%", "prefill", max_tokens=300, seed=2)
        caches, scheds, pres, cfg = s.build("gpu-on-demand")
        devs = [(c, sc, p, s.planner, s.truth_cost) for c, sc, p in zip(caches, scheds, pres)]
        res = _core.simulate_devices(s.core_trace, devs, s.layer_device, shared, s.truth, cfg, s.first, s.end)
        times[shared] = res.total_s
        assert res.link_busy_s > 0
    assert times[True] >= times[False]


def test_static_placements_over_several_gpus(trace):
    """upstream -ts with --n-cpu-moe N keeps every layer from N on, on its own GPU; ktransformers' and
    upstream-ncmoe's -ot rules keep each GPU's leading or last layers that fit."""
    s = Setup(trace, load_hardware("2x-rtx3090"), "50%", "decode", max_tokens=200, seed=2)
    E, L = trace.num_experts, trace.n_layers
    caches, *_ = s.build(TS_NCMOE)
    held = sorted({k // E for c in caches for k in c.resident_keys()})
    assert held == list(range(held[0], L))  # one contiguous tail of the model
    for name, end in (("ktransformers", "first"), ("upstream-ncmoe", "last")):
        caches, *_ = s.build(name)
        for d, c in enumerate(caches):
            mine = [m for m in range(L) if s.layer_device[m] == d]
            got = sorted({k // E for k in c.resident_keys()})
            n = len(got)
            assert n > 0
            assert got == (mine[:n] if end == "first" else mine[-n:]), (name, d, got)
    for name in ("hybrimoe", TS_NCMOE, "ktransformers", "upstream-ncmoe", "hot-set"):
        assert s.run(name)["tokens_per_s"] > 0
    one = Setup(trace, load_hardware("rtx4090-desktop"), "50%", "decode", max_tokens=200, seed=2)
    with pytest.raises(ValueError, match="several GPUs"):
        one.build(TS_NCMOE)


def test_bad_device_arguments(trace):
    s = Setup(trace, load_hardware("2x-rtx3090"), "25%", "decode", max_tokens=100, seed=2)
    caches, scheds, pres, cfg = s.build("hybrimoe")
    devs = [(c, sc, p, s.planner, s.truth_cost) for c, sc, p in zip(caches, scheds, pres)]
    with pytest.raises(ValueError, match="layer_device"):
        _core.simulate_devices(s.core_trace, devs, [0, 1], False, s.truth, cfg, s.first, s.end)
    with pytest.raises(ValueError, match="not one of the 2 devices"):
        _core.simulate_devices(s.core_trace, devs, [2] * trace.n_layers, False, s.truth, cfg, s.first, s.end)
    with pytest.raises(ValueError, match="share one ExpertCache"):
        _core.simulate_devices(s.core_trace, [devs[0], devs[0]], s.layer_device, False, s.truth, cfg, s.first,
                               s.end)
    with pytest.raises(ValueError, match="at least one device"):
        _core.simulate_devices(s.core_trace, [], [], False, s.truth, cfg, s.first, s.end)


def test_simulate_command_over_several_gpus(trace, tmp_path, capsys):
    """hybrimoe simulate on a hardware file with two GPUs: the header says so, the records carry the devices; the
    several-GPU placement on one GPU and a budget list are refused with the reason (exit 2, no traceback)."""
    import json

    from hybrimoe.commands import main as hybrimoe_main

    path = tmp_path / "q.npz"
    trace.save(path)
    rec = tmp_path / "r.json"
    argv = ["simulate", "--trace", str(path), "--max-tokens", "200", "--no-progress"]
    assert hybrimoe_main(argv + ["--hardware", "2x-rtx3090", "--policies", f"hybrimoe,{TS_NCMOE}",
                                 "--json", str(rec)]) == 0
    out = capsys.readouterr().out
    assert "2 GPUs, MoE layers" in out and TS_NCMOE in out
    recs = json.loads(rec.read_text())
    assert [r["devices"] for r in recs] == [2, 2] and len(recs[0]["layer_device"]) == trace.n_layers
    assert hybrimoe_main(argv + ["--policies", f"hybrimoe,{TS_NCMOE}"]) == 2
    assert "several GPUs" in capsys.readouterr().err
    assert hybrimoe_main(argv + ["--hardware", "2x-rtx3090", "--moe-cache", "2GB,1GB"]) == 2
    assert "a list per GPU" in capsys.readouterr().err
    assert hybrimoe_main(argv + ["--devices", "3", "--policies", "hybrimoe"]) == 0
    assert "3 GPUs of paper-a6000's kind" in capsys.readouterr().out
