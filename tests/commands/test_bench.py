"""``hybrimoe bench`` (hybrimoe against upstream's placements) end to end on the RPC stand-in: one row per mode in
JSON and CSV, the same tokens in every mode, clear errors for bad input. No speed is asserted (the stand-in is the
same CPU)."""
from __future__ import annotations

import csv
import json

import pytest


def _bench(args):
    from hybrimoe.commands import main

    return main(["bench"] + [str(a) for a in args])


def test_bench_writes_one_row_per_mode(tiny_model, rpc_server, tmp_path, capsys):
    path = tiny_model("qwen3moe", "Q8_0")
    out_json, out_csv, out_png = tmp_path / "b.json", tmp_path / "b.csv", tmp_path / "b.png"
    rc = _bench(["-m", path, "--rpc", rpc_server.endpoint, "--moe-cache", "50%", "-p", 16, "-n", 4, "-r", 2,
                 "--json", out_json, "--csv", out_csv, "--plot", out_png])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    modes = [r["mode"] for r in doc["rows"]]
    assert modes[0] == "upstream -ot exps=CPU" and modes[1].startswith("upstream --n-cpu-moe ")
    assert modes[2].startswith("upstream -ngl ")
    assert modes[3:] == [f"hybrimoe {p}" for p in
                         ("hybrimoe", "hybrimoe-lru", "ktransformers", "upstream-ncmoe", "gpu-on-demand")]
    for r in doc["rows"]:
        assert r["pp_tps"] > 0 and r["tg_tps"] > 0 and r["same_tokens_as_first"] == 2, r
        assert r["gpu_expert_bytes"] <= doc["budget_bytes"]
        if r["mode"].startswith("hybrimoe"):
            assert 0 <= r["hit_rate"] <= 1 and r["h2d_bytes_per_token"] >= 0
    with open(out_csv) as f:
        assert [row["mode"] for row in csv.DictReader(f)] == modes
    assert out_png.stat().st_size > 0
    table = capsys.readouterr().out
    assert "| mode |" in table and "pp16 t/s" in table and "tg4 t/s" in table


def test_bench_with_replay(tiny_model, rpc_server, tmp_path):
    import numpy as np

    path = tiny_model("qwen3moe", "Q8_0")
    ids = np.stack([np.stack([np.array([i % 8, (i + 3) % 8]) for _ in range(2)]) for i in range(30)])
    trace = tmp_path / "t.npz"
    np.savez(trace, expert_ids=ids.astype(np.int16), prompt_offsets=np.array([0, 30]), num_experts=8, top_k=2,
             expert_bytes=np.full(2, 1e6), format_version=1)
    out = tmp_path / "b.json"
    assert _bench(["-m", path, "--rpc", rpc_server.endpoint, "-p", 8, "-n", 2, "-r", 1, "--upstream", "exps",
                   "--policies", "hybrimoe", "--replay-trace", trace, "--json", out]) == 0
    doc = json.loads(out.read_text())
    assert doc["replay_trace"] == str(trace) and len(doc["rows"]) == 2


@pytest.mark.parametrize("extra, match", [(["--json", "/nonexistent-dir/x.json"], "cannot write"),
                                          (["--csv", "/tmp"], "is a directory"),
                                          (["--plot", "x.txt"], ".png, .pdf or .svg"),
                                          (["--policies", "hybrimo"], "unknown policy 'hybrimo'"),
                                          (["--policies", "hot-set"], "'hot-set' needs --moe-profile"),
                                          (["--moe-profile", "/nonexistent/p.npz"], "trace file not found"),
                                          (["--upstream", "exps,foo"], "unknown mode(s) foo"),
                                          (["--policies", "", "--upstream", ""], "nothing to run"),
                                          (["--moe-cost-model", "nope"], "nope"),
                                          (["--stand-in"], "either --rpc or --stand-in"),
                                          (["--moe-cache", "-3"], "negative"),
                                          (["--ram-policies", "lru"], "needs --moe-ram-cache")])
def test_bench_bad_input(extra, match, tiny_model, rpc_server, capsys):
    rc = _bench(["-m", tiny_model("qwen3moe", "Q8_0"), "--rpc", rpc_server.endpoint, *extra])
    assert rc == 1
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("-r", "0"), ("-p", "0"), ("-n", "-1"), ("-t", "0")])
def test_bench_bad_numbers_are_flag_errors(flag, value, tiny_model, capsys):
    """A number out of range is refused by the parser, as in every command: status 2, one line naming the flag."""
    rc = _bench(["-m", tiny_model("qwen3moe", "Q8_0"), "--stand-in", flag, value])
    err = capsys.readouterr().err
    assert rc == 2 and f"argument {flag}/" in err and "must be >= 1" in err, err


def test_bench_hot_set_with_a_profile(tiny_model, rpc_server, tmp_path, capsys):
    """--moe-profile (a version-1 trace file of the model's shape): hot-set runs, and the simulator's replay of its
    decisions (and of ktransformers') agrees exactly."""
    import numpy as np

    path = tiny_model("qwen3moe", "Q8_0")
    rng = np.random.default_rng(3)
    ids = np.array([[rng.choice(8, 2, replace=False, p=[.4, .2, .1, .1, .05, .05, .05, .05]) for _ in range(2)]
                    for _ in range(40)], dtype=np.int16)
    prof = tmp_path / "p.npz"
    np.savez(prof, expert_ids=ids, prompt_offsets=np.array([0, 40]), num_experts=8, top_k=2,
             expert_bytes=np.full(2, 1e6), format_version=1)
    out = tmp_path / "b.json"
    assert _bench(["-m", path, "--rpc", rpc_server.endpoint, "-p", 8, "-n", 2, "-r", 1, "--upstream", "exps",
                   "--policies", "hot-set,ktransformers", "--moe-profile", prof, "--moe-cache", "50%",
                   "--json", out]) == 0
    doc = json.loads(out.read_text())
    assert doc["moe_profile"] == str(prof)
    rows = {r["mode"]: r for r in doc["rows"]}
    assert rows["hybrimoe hot-set"]["decisions_agree"] and rows["hybrimoe ktransformers"]["decisions_agree"]
    assert "2/2 policies agree exactly" in capsys.readouterr().out


def test_bench_trace_of_another_model(tiny_model, rpc_server, tmp_path, capsys):
    import numpy as np

    trace = tmp_path / "t.npz"
    ids = np.broadcast_to(np.array([0, 1], np.int16), (4, 5, 2))  # each row a set of 2 experts, as a trace holds
    np.savez(trace, expert_ids=ids, prompt_offsets=np.array([0, 4]), num_experts=8,
             top_k=2, expert_bytes=np.full(5, 1e6), format_version=1)
    rc = _bench(["-m", tiny_model("qwen3moe", "Q8_0"), "--rpc", rpc_server.endpoint, "--replay-trace", trace])
    assert rc == 1 and "has 5 MoE layers" in capsys.readouterr().err


def test_bench_without_a_gpu(tiny_model, capsys, monkeypatch):
    from hybrimoe import _ggml

    cpu_only = [d for d in _ggml.devices() if d["type"] == _ggml.DEV_CPU]
    monkeypatch.setattr(_ggml, "devices", lambda memory=True: cpu_only)  # as on a machine without a GPU
    assert _bench(["-m", tiny_model("qwen3moe", "Q8_0")]) == 1
    err = capsys.readouterr().err
    assert "no GPU found" in err and "CUDA or Vulkan" in err and "--stand-in" in err, err


def _min_ram_budget(path) -> int:
    """The smallest RAM budget for bench's 512-token ubatches: every expert of one MoE layer."""
    from hybrimoe.runtime.engine_facts import engine_facts

    f = engine_facts(path)
    return f.n_expert * f.ram_slot_bytes


def test_bench_ram_tier_cpu_only(tiny_model, tmp_path, capsys, monkeypatch):
    """--moe-ram-cache: upstream's mmap against the RAM tier's policies, CPU only with no GPU on the machine; the RAM
    tier gives upstream's tokens (same_tokens_as_first), and at the smallest budget (one layer's experts) every
    decode token reads experts from the file, counted by the tier."""
    from hybrimoe import _ggml

    cpu_only = [d for d in _ggml.devices() if d["type"] == _ggml.DEV_CPU]
    monkeypatch.setattr(_ggml, "devices", lambda memory=True: cpu_only)
    path = tiny_model("qwen3moe", "Q8_0")
    out = tmp_path / "b.json"
    rc = _bench(["-m", path, "--moe-ram-cache", _min_ram_budget(path), "-p", 16, "-n", 4, "-r", 2,
                 "--ram-policies", "mrs,lru", "--json", out])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["device"] == "CPU" and doc["budget_bytes"] == 0
    rows = {r["mode"]: r for r in doc["rows"]}
    assert list(rows) == ["upstream mmap (CPU, --no-repack)", "hybrimoe RAM mrs", "hybrimoe RAM lru"]
    for r in rows.values():
        assert r["same_tokens_as_first"] == 2, r
        assert r["tg_disk_bytes_per_token"] >= 0 and r["tg_major_faults_per_token"] >= 0
    for mode in ("hybrimoe RAM mrs", "hybrimoe RAM lru"):
        assert 0 <= rows[mode]["ram_hit_rate"] < 1 and rows[mode]["ram_bytes_read_per_token"] > 0, rows[mode]
    assert "ram_hit_rate" not in rows["upstream mmap (CPU, --no-repack)"]
    table = capsys.readouterr().out
    assert "disk MiB/token pp, tg" in table and "hybrimoe RAM lru" in table


@pytest.mark.parametrize("extra, match", [(["--moe-cache", "25%"], "has no GPU mode"),
                                          (["--ram-policies", "belady"], "clairvoyant"),
                                          (["--ram-policies", "fifo"], "known: mrs, lru, lfu, reuse, the simulator"),
                                          (["--ram-policies", "lru,mrs,lru"], "names lru twice"),
                                          (["--ram-policies", ""], "--ram-policies is empty"),
                                          (["--stand-in"], "CPU only"),
                                          (["--policies", "hybrimoe"], "--ram-policies, not --policies"),
                                          (["--upstream", "exps"], "--upstream does not apply"),
                                          (["-ngl", "0"], "-ngl does not apply"),
                                          (["--moe-cost-model", "nope"], "nope")])
def test_bench_ram_tier_bad_input(extra, match, tiny_model, capsys):
    path = tiny_model("qwen3moe", "Q8_0")
    assert _bench(["-m", path, "--moe-ram-cache", _min_ram_budget(path), *extra]) == 1
    assert match in capsys.readouterr().err


def test_bench_ram_tier_at_each_read_ahead(tiny_model, tmp_path, monkeypatch):
    """--read-ahead: every mode runs at each read_ahead_kb of the model's block device (set where the process may),
    each row says the value in force, and the value found is put back afterwards."""
    import os

    from hybrimoe import _ggml
    from hybrimoe.runtime.readahead import read_ahead_file, read_ahead_kb

    cpu_only = [d for d in _ggml.devices() if d["type"] == _ggml.DEV_CPU]
    monkeypatch.setattr(_ggml, "devices", lambda memory=True: cpu_only)
    path = tiny_model("qwen3moe", "Q8_0")
    before = read_ahead_kb(path)
    out = tmp_path / "b.json"
    assert _bench(["-m", path, "--moe-ram-cache", _min_ram_budget(path), "-p", 8, "-n", 2, "-r", 1,
                   "--ram-policies", "mrs", "--read-ahead", "128,256", "--json", out]) == 0
    doc = json.loads(out.read_text())
    assert [(r["mode"].split(" @ ")[0], r["read_ahead_asked_kb"]) for r in doc["rows"]] == [
        ("upstream mmap (CPU, --no-repack)", 128), ("hybrimoe RAM mrs", 128),
        ("upstream mmap (CPU, --no-repack)", 256), ("hybrimoe RAM mrs", 256)]
    assert doc["read_ahead"]["found_kb"] == before and read_ahead_kb(path) == before
    knob = read_ahead_file(path)
    if knob is not None and os.access(knob, os.W_OK):
        assert [r["read_ahead_kb"] for r in doc["rows"]] == [128, 128, 256, 256]
        assert all(" @ read_ahead_kb " in r["mode"] for r in doc["rows"])


@pytest.mark.parametrize("value", ["abc", "0", "128,,x"])
def test_read_ahead_values_are_checked(value, tiny_model, capsys):
    path = tiny_model("qwen3moe", "Q8_0")
    assert _bench(["-m", path, "--moe-ram-cache", _min_ram_budget(path), "--read-ahead", value]) == 1
    assert f"--read-ahead {value}: give read_ahead_kb values" in capsys.readouterr().err


def test_read_ahead_needs_the_ram_tier(tiny_model, capsys):
    assert _bench(["-m", tiny_model("qwen3moe", "Q8_0"), "--stand-in", "--read-ahead", "128"]) == 1
    assert "--read-ahead sets how much a page fault reads" in capsys.readouterr().err


@pytest.mark.parametrize("budget, match", [("100000GiB", "more than the"), ("20%", "a ubatch of 512 tokens"),
                                           ("lots", "cannot parse")])
def test_bench_ram_budget_checked_before_loading(budget, match, tiny_model, capsys):
    assert _bench(["-m", tiny_model("qwen3moe", "Q8_0"), "--moe-ram-cache", budget]) == 1
    assert match in capsys.readouterr().err


def test_noisy_figures_are_flagged():
    """A mode whose tokens/s vary across repetitions by more than 10% of their mean (pp or tg) is named in a
    warning line and marked noisy in its row; steady modes and rows with an error are not flagged."""
    from hybrimoe.runtime.benchmark import NOISY_CV, noise_warnings

    steady = dict(mode="steady", n_prompt=64, n_gen=16, repetitions=3, pp_tps=100.0, pp_tps_sd=5.0,
                  tg_tps=10.0, tg_tps_sd=0.5)
    shaky = dict(steady, mode="shaky", tg_tps_sd=2.5)
    edge = dict(steady, mode="edge", pp_tps_sd=100.0 * NOISY_CV)   # exactly at the limit: not flagged
    failed = dict(mode="failed", error="out of memory")
    rows = [steady, shaky, edge, failed]
    lines = noise_warnings(rows)
    assert len(lines) == 1 and lines[0].startswith("noisy: shaky: tg16 25%"), lines
    assert [r.get("noisy") for r in rows] == [False, True, False, None]


def test_cli_warnings_are_one_line_each(tmp_path):
    """Every command prints the library's warnings in the CLI's style, ``hybrimoe: warning: ...`` on one line,
    never Python's ``file.py:LINE: RuntimeWarning`` form with the source line after it (here: bench's first-use
    calibration on a stand-in, which warns that tiny experts give an underdetermined fit)."""
    import os
    import subprocess
    import sys

    from hybrimoe.tiny import make_tiny_model

    path = str(make_tiny_model(tmp_path / "d.gguf", "deepseek2"))   # F32: its quick calibration is underdetermined
    env = dict(os.environ, HYBRIMOE_CACHE_DIR=str(tmp_path / "cache"), HYBRIMOE_AUTO_CALIBRATE="1")
    r = subprocess.run([sys.executable, "-m", "hybrimoe", "bench", "-m", path, "--stand-in", "--moe-cache", "25%",
                        "-p", "16", "-n", "4", "-r", "1", "--policies", "hybrimoe", "--upstream", "exps"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "hybrimoe: warning: calibration:" in r.stderr
    assert "Warning:" not in r.stderr and ".py:" not in r.stderr, r.stderr


def test_bench_ram_budget_errors_name_the_flag_once(tiny_model, capsys):
    """A RAM budget below the minimum: the flag named once, and no advice of a smaller ubatch (bench has no -ub)."""
    from hybrimoe.runtime.engine_facts import engine_facts

    path = tiny_model("qwen3moe", "Q8_0")
    two = str(2 * engine_facts(path).ram_slot_bytes)
    assert _bench(["-m", path, "--moe-ram-cache", two]) == 1
    err = capsys.readouterr().err
    assert f"--moe-ram-cache: moe_ram_cache='{two}' holds 2 experts" in err and "moe_ram_cache: " not in err, err
    assert "n_ubatch" not in err, err


def test_bench_cpu_only_compares_the_cpu_paths(tiny_model, tmp_path, capsys):
    """No GPU needed: upstream's default CPU path, upstream --no-repack and the engine's CPU share on both layouts,
    interleaved; every mode gives the same greedy tokens (the engine's CPU share is upstream's numbers)."""
    path = tiny_model("qwen3moe", "Q4_K_M")
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    assert _bench(["-m", path, "--cpu-only", "-p", 16, "-n", 4, "-r", 2, "-t", 1, "--json", out_json,
                   "--plot", out_png]) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["upstream (default: repacked)", "upstream --no-repack",
                                         "hybrimoe CPU share, --no-repack", "hybrimoe CPU share (repacked)",
                                         "hybrimoe fused CPU share", "hybrimoe fused, fast"]
    for r in rows:
        assert len(r["pp_tps"]) == len(r["tg_tps"]) == len(r["loadavg"]) == 2 and r["pp_min"] <= r["pp_median"], r
    # the engine's CPU share on each layout gives that layout's upstream tokens
    assert rows[3]["tokens"] == rows[0]["tokens"] == rows[4]["tokens"] and rows[2]["tokens"] == rows[1]["tokens"]
    table = capsys.readouterr().out
    assert "pp16 t/s median (min..max)" in table and "vs first pp, tg" in table
    assert out_png.stat().st_size > 0


@pytest.mark.parametrize("flags", [["--rpc", "127.0.0.1:1"], ["--moe-cache", "25%"], ["--policies", "hybrimoe"]])
def test_bench_cpu_only_refuses_gpu_flags(flags, tiny_model, capsys):
    assert _bench(["-m", tiny_model("qwen3moe", "Q8_0"), "--cpu-only", *flags]) == 1
    assert "do(es) not apply with --cpu-only" in capsys.readouterr().err
