"""``hybrimoe calibrate`` (issue 5, item 1) on the RPC stand-in: writes a valid cost model with its sources, and
the engine uses the stored calibration when no cost model is given. (Figures on the stand-in mean nothing.)"""
from __future__ import annotations

import json

import pytest


def test_calibrate_writes_a_cost_model_the_engine_uses(tiny_model, rpc_server, tmp_path, monkeypatch):
    from hybrimoe import Llama, calibrate, policy
    from hybrimoe.engine import slot_bytes

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_model("qwen3moe", "Q8_0")
    assert calibrate.main(["-m", str(path), "--rpc", rpc_server.endpoint, "--quick"]) == 0
    stored = calibrate.stored(path, rpc_server.endpoint)
    assert stored is not None and stored.parent == tmp_path / "cache" / "calibration"
    cm = policy.load_cost_model(stored)  # schema-checked by hybrimoe.policy's reader
    doc = json.loads(stored.read_text())
    assert doc["schema"] == policy.COST_MODEL_SCHEMA and set(doc["sources"]) == set(policy.COST_FIELDS)
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


def test_first_use_runs_a_short_calibration_once(tiny_model, rpc_server, tmp_path, monkeypatch, capfd):
    """No stored calibration: the engine's first use measures one (progress bar shown), stores it and uses it; the
    next use loads it without measuring; an empty cache (moe_cache=0) needs none."""
    from hybrimoe import Llama, calibrate, policy
    from hybrimoe.engine import slot_bytes

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", "1")
    monkeypatch.setenv("HYBRIMOE_PROGRESS", "1")
    path = tiny_model("qwen2moe", "Q8_0")
    kw = dict(rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, n_ctx=128, verbose=False)
    llm = Llama(str(path), moe_cache=0, **kw)
    llm.close()
    assert calibrate.stored(path, rpc_server.endpoint) is None
    capfd.readouterr()
    llm = Llama(str(path), moe_cache=4 * slot_bytes(path), **kw)
    try:
        err = capfd.readouterr().err
        stored = calibrate.stored(path, rpc_server.endpoint)
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
    from hybrimoe.engine import slot_bytes

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", "0")
    path = tiny_model("qwen3moe", "Q8_0")
    llm = Llama(str(path), rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, moe_cache=4 * slot_bytes(path),
                n_ctx=128, verbose=False)
    try:
        assert "preset rtx4090-desktop" in llm.moe_stats()["engine"]["cost_model"]
    finally:
        llm.close()


@pytest.mark.parametrize("args, match", [(["-o", "/nonexistent-dir/c.json"], "cannot write"),
                                         (["--rpc", "127.0.0.1:1"], "not reachable")])
def test_calibrate_bad_input(args, match, tiny_model, capsys):
    from hybrimoe import calibrate

    assert calibrate.main(["-m", str(tiny_model("qwen3moe", "Q8_0")), "--quick", *args]) == 1
    assert match in capsys.readouterr().err


def test_calibrate_not_a_moe_model(tmp_path, capsys):
    from hybrimoe import calibrate

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    assert calibrate.main(["-m", str(bad), "--quick"]) == 1
    assert "not a GGUF" in capsys.readouterr().err


def test_an_unwritable_store_keeps_the_measured_calibration_for_the_run(tiny_model, rpc_server, tmp_path,
                                                                        monkeypatch):
    from hybrimoe import Llama
    from hybrimoe.engine import slot_bytes

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
    from hybrimoe import Llama, calibrate
    from hybrimoe.engine import slot_bytes

    def broken(*a, **k):
        raise RuntimeError("measurement failed")

    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", "1")
    monkeypatch.setattr(calibrate, "calibrate", broken)
    path = tiny_model("qwen3moe", "Q8_0")
    with pytest.warns(RuntimeWarning, match="first-use calibration failed .measurement failed.; using the"):
        llm = Llama(str(path), rpc_servers=rpc_server.endpoint, n_gpu_layers=-1, moe_cache=4 * slot_bytes(path),
                    n_ctx=128, verbose=False)
    try:
        assert "preset rtx4090-desktop (first-use calibration failed: measurement failed" in \
            llm.moe_stats()["engine"]["cost_model"]
        assert calibrate.stored(path, rpc_server.endpoint) is None
    finally:
        llm.close()
