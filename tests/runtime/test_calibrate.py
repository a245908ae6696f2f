"""``hybrimoe calibrate`` and the first-use calibration on the RPC stand-in: a valid cost model with its sources,
stored where the engine finds it and used when no cost model is given; the first use measures on the model it
loaded. (Figures on the stand-in mean nothing.)"""
from __future__ import annotations

import json
import os

import pytest

from hybrimoe.commands import main as hybrimoe_main


def _label(server) -> str:
    """The calibration store's device label of an RPC server (hybrimoe._ggml.device_label)."""
    from hybrimoe import _ggml

    return _ggml.device_label(_ggml.add_rpc_server(server.endpoint)[0])


def test_calibrate_writes_a_cost_model_the_engine_uses(tiny_model, rpc_server, tmp_path, monkeypatch):
    from hybrimoe import Llama, policy
    from hybrimoe.runtime import calibration
    from hybrimoe.runtime.engine_facts import slot_bytes

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_model("qwen3moe", "Q8_0")
    assert hybrimoe_main(["calibrate", "-m", str(path), "--rpc", rpc_server.endpoint, "--quick"]) == 0
    stored = calibration.stored(path, _label(rpc_server))
    assert stored is not None and stored.parent == tmp_path / "cache" / "calibration"
    cm = policy.load_cost_model(stored)  # schema-checked by hybrimoe.policy's reader
    doc = json.loads(stored.read_text())
    # every field has a source, and "cpu_weights" says which kernels the CPU share was measured on (Q8_0 has no
    # repacked kernels on x86)
    assert doc["schema"] == policy.COST_MODEL_SCHEMA
    assert set(doc["sources"]) == set(policy.COST_FIELDS) | {"cpu_weights"}
    assert "Q8_0" in doc["sources"]["cpu_weights"]
    assert all(doc[f] == getattr(cm, f) for f in policy.COST_FIELDS)  # the numbers as written, exactly
    assert "fit over" in doc["sources"]["cpu_a_s"] and "timed copies" in doc["sources"]["h2d_bandwidth_Bps"]
    assert cm.h2d_bandwidth_Bps > 0 and cm.cpu_a_s + cm.cpu_b_s + cm.cpu_startup_s > 0
    llm = Llama(str(path), rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, moe_cache=4 * slot_bytes(path),
                n_ctx=128, verbose=False)
    try:
        llm("Once upon a time", max_tokens=4, temperature=0)
        assert llm.moe_stats()["engine"]["cost_model"] == str(stored)
    finally:
        llm.close()


def test_calibrations_are_kept_per_cpu_weight_option(tiny_model, rpc_server, tmp_path, monkeypatch):
    """The CPU share's kernels depend on the layout of the CPU weights and on the fused path: a calibration with
    --no-repack or --moe-cpu-fused is stored apart from the default one, each records which kernels it measured, and
    each is found only for its option."""
    from hybrimoe.runtime import calibration
    from hybrimoe.runtime.engine_facts import cpu_repacked_types

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_model("qwen3moe", "Q4_K_M")  # gate and up Q4_K
    label = _label(rpc_server)
    for flags, option in (([], "repack"), (["--no-repack"], "plain"), (["--moe-cpu-fused"], "repack-fused")):
        assert calibration.stored(path, label, option) is None
        assert hybrimoe_main(["calibrate", "-m", str(path), "--rpc", rpc_server.endpoint, "--quick", *flags]) == 0
        found = calibration.stored(path, label, option)
        assert found is not None and found.name.endswith(f"--cpu-{option}.json")
        note = json.loads(found.read_text())["sources"]["cpu_weights"]
        repacked = option != "plain" and "Q4_K" in cpu_repacked_types()
        parts = dict(part.strip().split(": ", 1) for part in note.removeprefix("CPU share on ").split(";")
                     if ": " in part)
        on_repacked = parts.get("repacked (upstream's CPU_REPACK kernels)", "")
        assert ("gate Q4_K" in on_repacked and "up Q4_K" in on_repacked) == repacked, note
        assert repacked or "gate Q4_K" in parts["file layout (plain kernels)"], note
        assert ("fused (one op per layer)" in note) == option.endswith("-fused"), note
    assert calibration.stored(path, label, "repack-nohost") is None


def test_first_use_runs_a_short_calibration_once(tiny_model, rpc_server, tmp_path, monkeypatch, capfd):
    """No stored calibration: the engine's first use measures one (progress bar shown), stores it and uses it; the
    next use loads it without measuring; an empty cache (moe_cache=0) needs none."""
    from hybrimoe import Llama, policy
    from hybrimoe.runtime import calibration
    from hybrimoe.runtime.engine_facts import slot_bytes

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", "1")
    monkeypatch.setenv("HYBRIMOE_PROGRESS", "1")
    path = tiny_model("qwen2moe", "Q8_0")
    kw = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=128, verbose=False)
    llm = Llama(str(path), moe_cache=0, **kw)
    llm.close()
    assert calibration.stored(path, _label(rpc_server)) is None
    capfd.readouterr()
    llm = Llama(str(path), moe_cache=4 * slot_bytes(path), **kw)
    try:
        err = capfd.readouterr().err
        stored = calibration.stored(path, _label(rpc_server))
        assert stored is not None and llm.moe_stats()["engine"]["cost_model"] == str(stored)
        assert "measuring a short one" in err and "calibrating (first use)" in err and "100%" in err, err
        doc = json.loads(stored.read_text())
        assert doc["sources"]["cpu_a_s"].startswith("first-use calibration (quick): fit over")
        policy.load_cost_model(stored)
        llm("Once upon a time", max_tokens=2, temperature=0)
    finally:
        llm.close()
    mtime = stored.stat().st_mtime_ns
    llm = Llama(str(path), moe_cache=4 * slot_bytes(path), **kw)
    try:
        assert "measuring" not in capfd.readouterr().err
        assert llm.moe_stats()["engine"]["cost_model"] == str(stored) and stored.stat().st_mtime_ns == mtime
    finally:
        llm.close()


def test_without_calibration_the_preset_is_named(tiny_model, rpc_server, tmp_path, monkeypatch):
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import slot_bytes

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", "0")
    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, moe_cache=4 * slot_bytes(path),
                n_ctx=128, verbose=False)
    from hybrimoe.envs import DEFAULT_COST_HARDWARE

    try:
        assert f"preset {DEFAULT_COST_HARDWARE}" in llm.moe_stats()["engine"]["cost_model"]
    finally:
        llm.close()


@pytest.mark.parametrize("args, match", [(["-o", "/nonexistent-dir/c.json"], "cannot write"),
                                         (["--rpc", "127.0.0.1:1"], "not reachable")])
def test_calibrate_bad_input(args, match, tiny_model, capsys):
    assert hybrimoe_main(["calibrate", "-m", str(tiny_model("qwen3moe", "Q8_0")), "--quick", *args]) == 1
    assert match in capsys.readouterr().err


def test_calibrate_not_a_moe_model(tmp_path, capsys):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    assert hybrimoe_main(["calibrate", "-m", str(bad), "--quick"]) == 1
    assert "not a GGUF" in capsys.readouterr().err


def test_an_unwritable_store_keeps_the_measured_calibration_for_the_run(tiny_model, rpc_server, tmp_path,
                                                                        monkeypatch):
    from hybrimoe import Llama
    from hybrimoe.runtime.engine_facts import slot_bytes

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(blocker))
    monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", "1")
    path = tiny_model("qwen3moe", "Q8_0")
    with pytest.warns(RuntimeWarning, match="cannot store the first-use calibration in .*used for this run only"):
        llm = Llama(str(path), rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, moe_cache=4 * slot_bytes(path),
                    n_ctx=128, verbose=False)
    try:
        assert llm.moe_stats()["engine"]["cost_model"] == "first-use calibration (not stored)"
    finally:
        llm.close()


def test_a_failed_first_use_calibration_falls_back_to_the_preset(tiny_model, rpc_server, tmp_path, monkeypatch):
    """A measurement that fails (or a store that cannot be written) costs a warning, not the model."""
    from hybrimoe import Llama
    from hybrimoe.runtime import calibration
    from hybrimoe.runtime.engine_facts import slot_bytes

    def broken(*a, **k):
        raise RuntimeError("measurement failed")

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", "1")
    monkeypatch.setattr(calibration, "measure", broken)
    path = tiny_model("qwen3moe", "Q8_0")
    with pytest.warns(RuntimeWarning, match="first-use calibration failed .measurement failed.; using the"):
        llm = Llama(str(path), rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, moe_cache=4 * slot_bytes(path),
                    n_ctx=128, verbose=False)
    try:
        assert "preset rtx4090-desktop (first-use calibration failed: measurement failed" in \
            llm.moe_stats()["engine"]["cost_model"]
        assert calibration.stored(path, _label(rpc_server)) is None
    finally:
        llm.close()


def test_first_use_measures_on_the_loaded_model_within_its_context(tiny_model, rpc_server, tmp_path, monkeypatch):
    """The first-use calibration loads nothing more (one Llama constructed, one model load), measures within the
    user's n_ubatch (16: ubatches of 1, 4 and 16 tokens, no 64), and leaves the context as it found it: the first
    generation equals that of a Llama given the stored calibration as its cost model."""
    from hybrimoe import Llama
    from hybrimoe._lib import llama_cpp_module
    from hybrimoe.runtime import calibration

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", "1")
    path = tiny_model("qwen3moe", "Q8_0")
    lc = llama_cpp_module().llama_cpp
    loads = []
    real_load = lc.llama_model_load_from_file
    monkeypatch.setattr(lc, "llama_model_load_from_file", lambda *a: loads.append(a) or real_load(*a))
    kw = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=128, n_batch=16, n_ubatch=16, verbose=False)
    llm = Llama(str(path), moe_cache="100%", **kw)
    try:
        assert len(loads) == 1
        stored = calibration.stored(path, _label(rpc_server))
        assert llm.moe_stats()["engine"]["cost_model"] == str(stored)
        src = json.loads(stored.read_text())["sources"]
        assert "ubatches [1, 4, 16]" in src["cpu_a_s"] and "ubatches [1, 4, 16]" in src["gpu_a_s"], src
        first = llm("Once upon a time", max_tokens=8, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()
    again = Llama(str(path), moe_cache="100%", moe_cost_model=str(stored), **kw)
    try:
        assert again("Once upon a time", max_tokens=8, temperature=0)["choices"][0]["text"] == first
    finally:
        again.close()


def test_first_use_with_too_few_slots_keeps_the_presets_gpu_costs(tiny_model, rpc_server, tmp_path, monkeypatch):
    """One GPU slot cannot hold the experts of two calibration ubatches: the GPU fields stay at the preset's values
    (the sources say why), the CPU and copy fields are measured."""
    from hybrimoe import Llama
    from hybrimoe.runtime import calibration
    from hybrimoe.runtime.engine_facts import engine_facts, slot_bytes
    from hybrimoe.runtime.setup import resolve_engine_cost_model

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", "1")
    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, moe_cache=slot_bytes(path), n_ctx=128,
                verbose=False)
    try:
        stored = calibration.stored(path, _label(rpc_server))
        doc = json.loads(stored.read_text())
        preset = resolve_engine_cost_model(None, engine_facts(path))
        for f in ("gpu_a_s", "gpu_b_s", "act_a_s"):
            assert "not measured: 1 GPU slots hold the experts of fewer than two" in doc["sources"][f]
            assert doc[f] == getattr(preset, f)
        assert "fit over" in doc["sources"]["cpu_b_s"] and "timed copies" in doc["sources"]["h2d_bandwidth_Bps"]
    finally:
        llm.close()


def test_a_damaged_stored_calibration_is_set_aside_and_measured_again(tiny_model, rpc_server, tmp_path,
                                                                       monkeypatch):
    """A stored calibration that cannot be read costs a warning, not the model: the file is kept as .bad (the
    user's bytes are not lost) and the first use measures and stores a new one."""
    from hybrimoe import Llama, policy
    from hybrimoe.runtime import calibration
    from hybrimoe.runtime.engine_facts import slot_bytes

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", "1")
    path = tiny_model("qwen3moe", "Q8_0")
    target = calibration.calibration_path(path, _label(rpc_server))
    target.parent.mkdir(parents=True)
    target.write_text('{"schema": "hybrimoe.cost_model/3", "cpu_a_s": ')
    with pytest.warns(RuntimeWarning, match="cannot be used .*moved to .*json.bad, a new one is measured"):
        llm = Llama(str(path), rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, moe_cache=4 * slot_bytes(path),
                    n_ctx=128, verbose=False)
    try:
        assert llm.moe_stats()["engine"]["cost_model"] == str(target)
        assert target.with_name(target.name + ".bad").read_text().startswith('{"schema"')
        assert json.loads(target.read_text())["schema"] == policy.COST_MODEL_SCHEMA
    finally:
        llm.close()


def test_gpt_oss_engine_layers_calibrate(tmp_path, rpc_server, monkeypatch, recwarn):
    """gpt-oss's experts (biases, SwiGLU-OAI) run on the engine: the first-use calibration measures its MoE
    layers and stores the result; ``hybrimoe calibrate``, ``run`` and ``bench`` work on it without a warning that
    layers ran on upstream's path."""
    import subprocess
    import sys

    from hybrimoe import Llama
    from hybrimoe.runtime import calibration
    from hybrimoe.tiny import make_tiny_model

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", "1")
    path = make_tiny_model(tmp_path / "g.gguf", "gpt-oss")
    llm = Llama(str(path), rpc_servers=rpc_server.endpoint, n_gpu_layers=99, moe_cache="25%", n_ctx=128,
                verbose=False)
    try:
        src = llm.moe_stats()["engine"]["cost_model"]
        assert "nothing to calibrate" not in src, src
        assert calibration.stored(path, _label(rpc_server)) is not None
        assert not [w for w in recwarn if "calibration failed" in str(w.message)]
        llm("Hi", max_tokens=2, temperature=0)
        assert not llm.moe_stats()["unsupported"]
    finally:
        llm.close()
    env = dict(os.environ, HYBRIMOE_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "calibrate", "-m", str(path), "--rpc", rpc_server.endpoint,
                        "--quick", "-o", str(tmp_path / "g.json")], capture_output=True, text=True, timeout=300,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert (tmp_path / "g.json").exists()
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "run", "-m", str(path), "--rpc", rpc_server.endpoint,
                        "-ngl", "99", "--moe-cache", "25%", "-n", "4", "--temp", "0", "-p", "Hi"], capture_output=True,
                       text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "upstream's path" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "bench", "-m", str(path), "--rpc", rpc_server.endpoint,
                        "-p", "16", "-n", "4", "-r", "1", "--policies", "hybrimoe", "--upstream", "exps"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "| hybrimoe hybrimoe |" in r.stdout, r.stderr


def test_a_stand_in_on_a_new_port_finds_its_calibration(tiny_model, tmp_path):
    """An RPC server on this machine is the same device on any port: a calibration made on one stand-in is found
    by a run on another one reporting the same memory (no first-use measurement), and not by one reporting other
    memory. CLI runs in processes of their own (their RPC devices stay out of this process's ggml registry)."""
    import subprocess
    import sys

    from hybrimoe.runtime.rpc import RPCServer

    path = str(tiny_model("qwen3moe", "Q8_0"))
    env = dict(os.environ, HYBRIMOE_CACHE_DIR=str(tmp_path / "cache"), HYBRIMOE_AUTO_CALIBRATE="1")

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "hybrimoe", *args], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=300)
        assert r.returncode == 0, r.stderr
        return r

    run = ["run", "-m", path, "-p", "hi", "-n", "2", "--temp", "0", "-ngl", "99", "--moe-cache", "50%"]
    with RPCServer(memory_bytes=2**30) as a:
        cli("calibrate", "-m", path, "--rpc", a.endpoint, "--quick")
    stored = list((tmp_path / "cache" / "calibration").glob("*.json"))
    assert len(stored) == 1 and "127.0.0.1-rpc-1024MiB" in stored[0].name, stored
    with RPCServer(memory_bytes=2**30) as b:
        assert "no calibration" not in cli(*run, "--rpc", b.endpoint).stderr
    with RPCServer(memory_bytes=2**31) as c:
        assert "no calibration" in cli(*run, "--rpc", c.endpoint).stderr
