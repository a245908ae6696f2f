"""Several devices: one expert slot pool per device that holds MoE layers (hybrimoe.runtime.devices).

Two (and once three) RPC stand-ins on 127.0.0.1 play the GPUs, each with a memory limit of its own so that each has
a label and a free memory of its own. llama.cpp's layer split (``-ngl 99 -ts``) puts each layer on one of them; the
engine runs each layer's GPU share on that layer's device, from that device's slots. Oracle: upstream llama.cpp
with the same placement (``-ngl 99 -ts ... -ot exps=CPU --no-repack``): the same greedy tokens and bit-identical
logits, with a GPU share on every device.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hybrimoe.testing.fixtures import ENGINE_ARCHS, fixture_set
from hybrimoe.testing.upstream import greedy_reference, greedy_with_logits

N_LAYER = 8  # enough layers that a 3:1 split leaves MoE layers on both devices
GiB = 1 << 30


@pytest.fixture(scope="module")
def devices(rpc_server_factory):
    """Three stand-ins with 2, 3 and 4 GiB of "device memory" (two for most tests)."""
    return [rpc_server_factory(memory_bytes=m * GiB) for m in (2, 3, 4)]


@pytest.fixture(scope="module")
def layered_model(tmp_path_factory):
    from hybrimoe.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("multi-device")
    made = {}

    def make(arch: str) -> str:
        if arch not in made:
            kw = dict(fixture_set()[(arch, "Q8_0")], n_layer=N_LAYER)
            made[arch] = str(make_tiny_model(d / f"{arch}-{N_LAYER}l.gguf", **kw))
        return made[arch]

    return make


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> str:
    """qwen3moe, 8 layers, experts of 3.3 MB (n_embd 1024, Q8_0; 240 MB): copies worth prefetching under a desktop
    GPU's cost model, and a pool that outgrows a small device."""
    from hybrimoe.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("wide") / "wide.gguf", "qwen3moe", n_layer=8, n_embd=1024,
                               n_ff_exp=1024, n_expert=8, n_expert_used=2, quant="Q8_0"))


def _endpoints(servers) -> str:
    return ",".join(s.endpoint for s in servers)


def _run_both(path, servers, ts, split_cost_model, moe_cache="50%", n_prompt=24, n_new=16, **extra):
    from hybrimoe import Llama

    common = dict(rpc_servers=_endpoints(servers), n_gpu_layers=99, tensor_split=ts, n_ctx=n_prompt + n_new + 16,
                  n_batch=512, n_ubatch=8, seed=0, verbose=False, no_repack=True)
    tokens, ref_out, ref_lg = greedy_reference(path, n_prompt, n_new, tensor_buft_overrides="exps=CPU", **common)
    llm = Llama(path, moe_cache=moe_cache, moe_cost_model=split_cost_model, **common, **extra)
    out, lg = greedy_with_logits(llm, tokens, n_new)
    return llm, (out, np.asarray(lg)), (ref_out, np.asarray(ref_lg))


def _check_devices(llm, n_devices):
    """Every device ran a GPU share, and each cached only the layers it serves."""
    from hybrimoe.runtime.engine_facts import engine_facts

    eng = llm.moe_engine
    facts = engine_facts(llm.model_path)
    devs = llm.moe_stats()["engine"]["devices"]
    assert eng.n_devices == n_devices == len(devs)
    assert sorted(ml for d in devs for ml in d["moe_layers"]) == list(range(len(facts.moe_layers)))
    for i, d in enumerate(devs):
        assert d["moe_layers"], f"device {i} holds no MoE layer"
        assert d["gpu_experts"] > 0, f"device {i} ({d['device']}) computed nothing"
        for ml in range(len(facts.moe_layers)):
            held = [eng.device_slot_of(i, ml, e) >= 0 for e in range(facts.n_expert)]
            if ml not in d["moe_layers"]:
                assert not any(held), f"device {i} cached an expert of MoE layer {ml}, which it does not serve"
    assert eng.pinned_count() == 0
    return devs


@pytest.mark.parametrize("ts", [[1.0, 1.0], [3.0, 1.0]], ids=["1-1", "3-1"])
@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_two_devices_match_upstream(arch, ts, devices, layered_model, split_cost_model):
    """Layer split 1:1 and 3:1 over two stand-ins: upstream's tokens and logits, bit for bit; the layers' devices
    are llama.cpp's (a layer's router and its GPU share on one device)."""
    from hybrimoe.runtime.devices import model_layer_devices

    path = layered_model(arch)
    llm, (out, lg), (ref_out, ref_lg) = _run_both(path, devices[:2], ts, split_cost_model)
    try:
        assert out == ref_out
        assert np.array_equal(lg, ref_lg), float(np.max(np.abs(lg - ref_lg)))
        devs = _check_devices(llm, 2)
        setup = llm.moe_setup
        ptrs = [setup.device] + [d.device for d in setup.more_devices]
        on = model_layer_devices(llm.model, setup.facts.moe_layers)
        assert [ptrs.index(p) for p in on] == list(setup.layer_device)
        # the memory limits tell the two stand-ins apart: a label each, for "auto" and calibration
        assert devs[0]["device"] != devs[1]["device"]
        # more layers on the device with the larger share
        n0, n1 = (len(d["moe_layers"]) for d in devs)
        assert n0 > n1 if ts == [3.0, 1.0] else abs(n0 - n1) <= 2
    finally:
        llm.close()


def test_three_devices_match_upstream(devices, layered_model, split_cost_model):
    """Three stand-ins (as three hosts), 1:1:1: upstream's numbers, a GPU share on each."""
    llm, (out, lg), (ref_out, ref_lg) = _run_both(layered_model("qwen3moe"), devices, [1.0, 1.0, 1.0],
                                                  split_cost_model)
    try:
        assert out == ref_out
        assert np.array_equal(lg, ref_lg)
        _check_devices(llm, 3)
    finally:
        llm.close()


def test_budgets_per_device(devices, layered_model, split_cost_model):
    """A share is of each device's own layers; a list sets each device's; "auto" sizes each from its own memory."""
    from hybrimoe.runtime.engine_facts import engine_facts

    path = layered_model("qwen3moe")
    facts = engine_facts(path)
    sb, E = facts.slot_bytes, facts.n_expert
    llm, (out, _), (ref_out, _) = _run_both(path, devices[:2], [3.0, 1.0], split_cost_model, moe_cache="25%",
                                            n_new=4)
    try:
        devs = llm.moe_stats()["engine"]["devices"]
        assert [d["n_slots"] for d in devs] == [int(0.25 * len(d["moe_layers"]) * E) for d in devs]
        assert llm.moe_stats()["engine"]["n_slots"] == sum(d["n_slots"] for d in devs)
    finally:
        llm.close()
    llm, (out, _), (ref_out, _) = _run_both(path, devices[:2], [1.0, 1.0], split_cost_model,
                                            moe_cache=f"{3 * sb},{5 * sb}", n_new=4)
    try:
        assert out == ref_out
        assert [d["n_slots"] for d in llm.moe_stats()["engine"]["devices"]] == [3, 5]
    finally:
        llm.close()
    llm, (out, _), (ref_out, _) = _run_both(path, devices[:2], [1.0, 1.0], split_cost_model, moe_cache="auto",
                                            n_new=4)
    try:
        assert out == ref_out
        devs = llm.moe_stats()["engine"]["devices"]
        # each device's free memory holds every expert of its layers
        assert [d["n_slots"] for d in devs] == [len(d["moe_layers"]) * E for d in devs]
    finally:
        llm.close()


def test_bad_budgets_and_split_modes_are_refused(devices, layered_model, split_cost_model):
    from hybrimoe import Llama

    path = layered_model("qwen3moe")
    common = dict(rpc_servers=_endpoints(devices[:2]), n_gpu_layers=99, n_ctx=64, verbose=False,
                  moe_cost_model=split_cost_model)
    with pytest.raises(ValueError, match=r"lists 3 budget\(s\) for 2 device\(s\).*127\.0\.0\.1-rpc-2048MiB"):
        Llama(path, moe_cache="10%,10%,10%", **common)
    with pytest.raises(ValueError, match="-sm layer"):
        Llama(path, moe_cache="25%", split_mode=2, **common)
    with pytest.raises(ValueError, match="moe_cache"):
        Llama(path, moe_cache="10%,banana", **common)


def test_layers_on_the_host_use_the_main_device(devices, layered_model, split_cost_model):
    """-ngl 0 (llama.cpp's default) leaves every layer on the host: one slot pool, on the main device (-mg)."""
    from hybrimoe import Llama

    path = layered_model("qwen3moe")
    llm = Llama(path, rpc_servers=_endpoints(devices[:2]), n_gpu_layers=0, main_gpu=1, n_ctx=64, verbose=False,
                moe_cache="25%", moe_cost_model=split_cost_model)
    try:
        assert llm.moe_engine.n_devices == 1
        dev = llm.moe_stats()["engine"]["devices"][0]
        assert llm.moe_setup.device_label == dev["device"]
        assert dev["host_moe_layers"] == dev["moe_layers"] == list(range(len(llm.moe_setup.facts.moe_layers)))
        assert llm.moe_setup.device_label.endswith("-3072MiB")  # devices[1]
    finally:
        llm.close()


_CHILD = textwrap.dedent("""
    import json, sys, threading, time
    from hybrimoe import Llama
    from hybrimoe.runtime.rpc import RPCServer

    model, cost, scenario = sys.argv[1], sys.argv[2], sys.argv[3]
    out = {}
    a = RPCServer(threads=1, memory_bytes=2 << 30).start()
    b = RPCServer(threads=1, memory_bytes=3 << 30).start()
    out["lost"] = b.endpoint
    llm = Llama(model, rpc_servers=a.endpoint + "," + b.endpoint, n_gpu_layers=99, tensor_split=[1.0, 1.0],
                n_ctx=512, n_ubatch=8, verbose=False, moe_cache="50%", moe_cost_model=cost)
    llm("Once upon a time", max_tokens=2, temperature=0)

    def kill():
        b.proc.kill()
        b.proc.wait()
        out["t_kill"] = time.monotonic()

    def attempt(fn):
        try:
            fn()
            out.setdefault("errors", []).append(None)
        except RuntimeError as e:
            out.setdefault("errors", []).append(str(e).replace("\\n", " "))
        out["t_error"] = time.monotonic()

    if scenario == "decode":
        kill()
        attempt(lambda: llm("Once upon a time there", max_tokens=2, temperature=0))
    elif scenario == "prefill":
        tokens = [llm.token_bos()] + [3 + (7 * i) % 200 for i in range(300)]  # many ubatches of 8
        runs = lambda: sum(llm.moe_stats()["runs"])
        base, done = runs(), threading.Event()

        def killer():
            while runs() < base + 6 and not done.is_set():
                time.sleep(0.0005)
            out["decode_running_at_kill"] = not done.is_set()
            kill()

        th = threading.Thread(target=killer)
        th.start()
        try:
            attempt(lambda: llm.eval(tokens))
        finally:
            done.set()
            th.join()
    elif scenario == "close":
        kill()
    t = time.monotonic()
    llm.close()
    out["close_s"] = time.monotonic() - t
    a.stop()
    print("RESULT " + json.dumps(out), flush=True)
""")


@pytest.mark.parametrize("scenario", ["decode", "prefill", "close"])
def test_one_of_two_devices_gone(scenario, layered_model, split_cost_model):
    """The second device's server killed before a decode, during a prefill, or before close: a clear error naming
    that server (decode, prefill), within 10 s, and close() returns; no hang (the child has 150 s)."""
    import json

    path = layered_model("qwen3moe")
    r = subprocess.run([sys.executable, "-c", _CHILD, path, split_cost_model, scenario], capture_output=True,
                       text=True, timeout=150)
    res = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and res, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(res[0][len("RESULT "):])
    assert out["close_s"] < 10.0
    if scenario == "close":
        return
    if scenario == "prefill":
        assert out["decode_running_at_kill"], "the prompt ended before the kill: make it longer"
    err = out["errors"][0]
    assert err is not None and out["lost"] in err, err
    assert out["t_error"] - out["t_kill"] < 10.0


def test_a_device_with_too_little_memory_is_named(rpc_server_factory, wide_model, split_cost_model):
    """A budget that does not fit one device's free memory: the error names that device and the bytes."""
    from hybrimoe import Llama

    big = rpc_server_factory(memory_bytes=2 * GiB)
    small = rpc_server_factory(memory_bytes=40 << 20)
    # the second device's three MoE layers hold 24 experts of 3.3 MB, 80 MB
    path = wide_model
    with pytest.raises(ValueError, match=r"bytes free on device 127\.0\.0\.1-rpc-40MiB"):
        Llama(str(path), rpc_servers=f"{big.endpoint},{small.endpoint}", n_gpu_layers=99, tensor_split=[1.0, 1.0],
              n_ctx=64, verbose=False, moe_cache="10%,100%", moe_cost_model=split_cost_model)


def test_each_device_plans_with_its_own_calibration(devices, layered_model, split_cost_model, tmp_path,
                                                    monkeypatch):
    """A calibration stored under the second device's label (hybrimoe calibrate --rpc A,B stores one per device) is
    that device's planner; the first, without one, uses the preset; a moe_cost_model given is every device's."""
    from hybrimoe import Llama
    from hybrimoe.runtime.calibration import calibration_path, save
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.runtime.setup import resolve_engine_cost_model

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", "0")
    path = layered_model("qwen3moe")
    label = f"127.0.0.1-rpc-{3 * 1024}MiB"  # devices[1]
    cm = resolve_engine_cost_model(split_cost_model, engine_facts(path))
    mine = save(cm, {}, calibration_path(path, label, "repack"))
    common = dict(rpc_servers=_endpoints(devices[:2]), n_gpu_layers=99, tensor_split=[1.0, 1.0], n_ctx=64,
                  verbose=False, moe_cache="50%")
    llm = Llama(path, **common)
    try:
        devs = llm.moe_stats()["engine"]["devices"]
        assert devs[1]["device"] == label and devs[1]["cost_model"] == str(mine)
        assert devs[0]["cost_model"].startswith("preset ")
    finally:
        llm.close()
    llm = Llama(path, moe_cost_model=split_cost_model, **common)
    try:
        devs = llm.moe_stats()["engine"]["devices"]
        assert devs[0]["cost_model"] == split_cost_model and devs[1]["cost_model"] == "the first device's"
    finally:
        llm.close()


@pytest.mark.parametrize("policy", ["hybrimoe", "hybrimoe-lru", "ktransformers"])
def test_the_simulator_replays_each_devices_decisions(policy, devices, wide_model):
    """The engine's decision log over two devices, replayed per device through the simulator's copy of the rules
    (hybrimoe.runtime.decision_replay): the same decisions, record by record, the second device's prefetches
    planned at the first device's last layers (prefetch-only records) included. Experts of 3.3 MB under a desktop
    GPU's cost model, so that the prefetcher copies."""
    from hybrimoe import Llama, _core
    from hybrimoe.runtime.decision_replay import replay_engine_log
    from hybrimoe.testing.upstream import greedy_with_logits, prompt_tokens

    llm = Llama(wide_model, rpc_servers=_endpoints(devices[:2]), n_gpu_layers=99, tensor_split=[1.0, 1.0],
                n_ctx=128, n_ubatch=8, verbose=False, moe_cache="25%", moe_policy=policy,
                moe_cost_model="rtx4090-desktop")
    try:
        llm.moe_log()
        greedy_with_logits(llm, prompt_tokens(llm, 24), 8)
        log = llm.moe_take_log()
        assert {llm.moe_engine.device_of(r["layer"]) for r in log} == {0, 1}
        if policy != "ktransformers":  # a prefetcher: the second device prefetches at the first one's last layers
            ahead = [r for r in log if r["prefetch_only"]]
            assert ahead and all(llm.moe_engine.device_of(p["layer"]) == 1 for r in ahead for p in r["predictions"])
            assert any(r["prefetched"] for r in ahead)
        assert _core.first_difference(log, replay_engine_log(llm, log)) == ""
    finally:
        llm.close()


def test_main_gpu_out_of_range_is_named(devices, layered_model):
    """-mg past the last device: one clear error naming the flag and the devices (llama.cpp's own is only in its
    log), before the model loads."""
    from hybrimoe import Llama

    with pytest.raises(ValueError, match=r"main_gpu=5 \(-mg\): there are 2 devices \(0: 127\.0\.0\.1-rpc-2048MiB"):
        Llama(layered_model("qwen3moe"), rpc_servers=_endpoints(devices[:2]), n_gpu_layers=99, main_gpu=5, n_ctx=64,
              verbose=False)


def test_run_names_each_devices_layers():
    from hybrimoe.commands.args import id_ranges

    assert id_ranges([0, 1, 2, 3, 4, 7]) == "0-4, 7"
    assert id_ranges([7]) == "7" and id_ranges([]) == "none"
    assert id_ranges([5, 3, 4, 9, 10]) == "3-5, 9-10"
