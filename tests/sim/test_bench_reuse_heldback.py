"""bench/bench_reuse_heldback.py: the reuse cache's (horizon, rate) chosen on one half of a trace's prompts and
measured on the other. A tiny grid on a synthetic trace: the choice is the grid's best mean ratio over MRS on the
tuning half, and the held-back half runs MRS, the choice and the default."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrimoe import _core
from hybrimoe.traces.synthetic import synthetic_trace

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_reuse_heldback.py"


def test_the_choice_is_the_tuning_halfs_best_and_the_other_half_is_measured(tmp_path):
    trace = tmp_path / "t.npz"
    synthetic_trace("mixtral-8x7b", 900, locality="high", n_prompts=6, seed=0).save(trace)
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(BENCH), "--trace", str(trace), "--hardware", "rtx4090-desktop",
                        "--horizons", "1,4", "--rates", "0.01,0.001", "--max-tokens", "200", "--tune-on", "odd",
                        "--json", str(out)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    tuned = [row for row in got["rows"] if row["half"] == "odd" and row["policy"] != "mrs"]
    assert len(tuned) == 4
    best = max(tuned, key=lambda row: row["over_mrs"])
    assert best["policy"] == f"reuse H={got['chosen'][0]} rate={got['chosen'][1]:g}"
    held = [row for row in got["rows"] if row["half"] == "even"]
    default = _core.ReusePolicy()
    shipped = f"reuse H={default.horizon} rate={default.rate:g}"
    assert {row["policy"] for row in held} == {"mrs", best["policy"], shipped}
    mrs = next(row for row in held if row["policy"] == "mrs")
    assert all(row["over_mrs"] == pytest.approx(row["tokens_per_s"] / mrs["tokens_per_s"]) for row in held)
    assert "(held back)" in r.stdout


@pytest.mark.parametrize("args, says", [(["--hardware", "no-such-box"], "no-such-box"),
                                        (["--horizons", "x"], "--horizons"), (["--horizons", "0"], "--horizons"),
                                        (["--rates", "2"], "--rates"), (["--cache", "bogus"], "bogus"),
                                        (["--max-tokens", "0"], "--max-tokens")])
def test_bad_arguments_are_usage_errors(tmp_path, args, says):
    """Each is named before any run, without a traceback."""
    r = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
