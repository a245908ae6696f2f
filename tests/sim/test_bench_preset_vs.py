"""bench/bench_preset_vs.py: a candidate preset against another over the never-worse grid. A tiny grid runs, its
ratios are the simulator's own records divided, and bad arguments are usage errors before any run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrimoe import policy as pol
from hybrimoe.sim.simulator import Setup
from hybrimoe.traces.synthetic import synthetic_trace

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_preset_vs.py"


def run_bench(*args, cwd):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_a_tiny_grid_divides_the_simulators_records(tmp_path):
    out = tmp_path / "rows.json"
    r = run_bench("--shapes", "mixtral-8x7b", "--hardware", "rtx4090-desktop", "--caches", "25%", "--stages",
                  "decode", "--tokens", "120", "--json", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    synthetic = [row for row in rows if row["trace"].startswith("mixtral")]
    assert [row["trace"] for row in synthetic] == ["mixtral-8x7b-low", "mixtral-8x7b-high"]
    # the same runs here: the bench's ratio is the candidate's tokens/s over the base's
    row = synthetic[0]
    tr = synthetic_trace("mixtral-8x7b", 120 * 5 // 4 + 200, locality="low", seed=0)
    s = Setup(tr, pol.load_hardware("rtx4090-desktop"), "25%", "decode", max_tokens=120, seed=1)
    base, cand = s.run("hybrimoe")["tokens_per_s"], s.run("hybrimoe-reuse")["tokens_per_s"]
    assert row["base"] == pytest.approx(base) and row["candidate"] == pytest.approx(cand)
    assert row["ratio"] == pytest.approx(cand / base) and (row["flags"] == ["slower"]) == (cand / base < 0.99)
    assert "decode: " in r.stdout and "median" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--candidate", "nonsense"], "unknown preset 'nonsense'"),
    (["--stages", "Decode"], "--stages"),
    (["--hardware", "rtx4090"], "--hardware 'rtx4090'"),
    (["--caches", "150%"], "--caches"),
    (["--caches", "25%,"], "--caches"),
    (["--seeds", "x"], "--seeds"),
    (["--seeds=-1"], "--seeds"),
    (["--caches", "1MB", "--shapes", "mixtral-8x7b", "--hardware", "rtx4090-desktop", "--stages", "decode"],
     "smaller than one expert"),
    (["--shapes", "mixtral"], "unknown shape 'mixtral'"),
    (["--tokens", "0"], "--tokens 0"),
    (["--json", "/nonexistent/dir/x.json"], "no folder"),
    (["--trace", "missing.npz"], "no such file"),
])
def test_bad_arguments_are_usage_errors_before_any_run(tmp_path, args, message):
    r = run_bench(*args, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "| trace | seed |" not in r.stdout or "1MB" in args  # a budget is checked against each trace's experts
