"""Every command that writes a file refuses an existing one without --force, always refuses its own input, checks
before any work, and writes atomically with the umask's mode."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from hybrimoe.outputs import atomic_open, check_output


def run_cli(args, cwd):
    return subprocess.run([sys.executable, "-m", "hybrimoe", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def _snapshot(p):
    return p.read_bytes()


def test_check_output_rules(tmp_path):
    inp = tmp_path / "model.gguf"
    inp.write_bytes(b"GGUF-model")
    out = tmp_path / "out.json"
    assert check_output(out, "--json") == out  # a new file is fine
    out.write_text("old")
    with pytest.raises(ValueError, match=r"--json .*exists.*--force"):
        check_output(out, "--json")
    check_output(out, "--json", force=True)
    for force in (False, True):
        with pytest.raises(ValueError, match=r"--json .*input \(-m "):
            check_output(inp, "--json", force=force, inputs=[("-m", str(inp))])
    link = tmp_path / "alias.gguf"
    os.link(inp, link)  # another name for the same file is the same input
    with pytest.raises(ValueError, match="input"):
        check_output(link, "--csv", force=True, inputs=[("-m", inp)])
    with pytest.raises(ValueError, match="is a directory"):
        check_output(tmp_path, "-o", force=True)
    with pytest.raises(ValueError, match="does not exist"):
        check_output(tmp_path / "nope" / "x.json", "-o")


def test_atomic_write_keeps_the_old_file_on_error_and_uses_the_umask(tmp_path):
    out = tmp_path / "out.txt"
    out.write_text("precious")
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(out, "w") as fh:
            fh.write("half")
            raise KeyboardInterrupt
    assert out.read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]  # no temporary file left
    new = tmp_path / "new.txt"
    old = os.umask(0o022)
    try:
        with atomic_open(new, "w") as fh:
            fh.write("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(new.stat().st_mode) == 0o644


def test_calibrate_refuses_its_model_and_existing_output(tmp_path, tiny_model):
    model = tmp_path / "victim.gguf"
    model.write_bytes(tiny_model("qwen3moe", "Q8_0").read_bytes())
    before = _snapshot(model)
    for extra in ([], ["--force"]):
        r = run_cli(["calibrate", "-m", str(model), "--quick", "-o", str(model), *extra], tmp_path)
        assert r.returncode != 0 and "input (-m" in r.stderr and "Traceback" not in r.stderr
    existing = tmp_path / "cal.json"
    existing.write_text("mine")
    r = run_cli(["calibrate", "-m", str(model), "--quick", "-o", str(existing)], tmp_path)
    assert r.returncode != 0 and "--force" in r.stderr
    assert existing.read_text() == "mine" and _snapshot(model) == before


def test_bench_refuses_inputs_and_existing_outputs(tmp_path, tiny_model):
    model = tmp_path / "victim2.gguf"
    model.write_bytes(tiny_model("qwen3moe", "Q8_0").read_bytes())
    before = _snapshot(model)
    base = ["bench", "-m", str(model), "--stand-in", "-p", "8", "-n", "2", "-r", "1", "--policies", "hybrimoe"]
    for flag in ("--csv", "--json", "--plot"):
        r = run_cli([*base, flag, str(model), "--force"], tmp_path)
        assert r.returncode != 0 and "input (-m" in r.stderr, (flag, r.stderr)
    existing = tmp_path / "t.csv"
    existing.write_text("mine")
    r = run_cli([*base, "--csv", str(existing)], tmp_path)
    assert r.returncode != 0 and "--csv" in r.stderr and "--force" in r.stderr
    assert existing.read_text() == "mine" and _snapshot(model) == before
    r = run_cli([*base, "--json", str(tmp_path / "same.out"), "--csv", str(tmp_path / "same.out")], tmp_path)
    assert r.returncode != 0 and "input (--json" in r.stderr  # two outputs on one file


def test_simulate_refuses_its_trace_and_existing_outputs(tmp_path):
    from hybrimoe.traces.synthetic import synthetic_trace

    tr = tmp_path / "partial.npz"
    synthetic_trace("mixtral-8x7b", 64, seed=0).save(tr)
    before = _snapshot(tr)
    r = run_cli(["simulate", "--trace", str(tr), "--json", str(tr), "--force", "--no-progress"], tmp_path)
    assert r.returncode != 0 and "input (--trace" in r.stderr and "Traceback" not in r.stderr
    out = tmp_path / "r.json"
    out.write_text("mine")
    r = run_cli(["simulate", "--trace", str(tr), "--json", str(out), "--no-progress"], tmp_path)
    assert r.returncode != 0 and "--force" in r.stderr and out.read_text() == "mine"
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "timeline.png").write_text("mine")
    r = run_cli(["simulate", "--trace", str(tr), "--plot", str(plots), "--no-progress"], tmp_path)
    assert r.returncode != 0 and "timeline.png" in r.stderr and (plots / "timeline.png").read_text() == "mine"
    assert _snapshot(tr) == before


def test_trace_refuses_its_model_even_with_force(tmp_path, tiny_model):
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_model("qwen3moe", "Q8_0").read_bytes())
    before = _snapshot(model)
    r = run_cli(["trace", "-m", str(model), "-p", "hi", "-o", str(model), "--force"], tmp_path)
    assert r.returncode != 0 and "input (-m" in r.stderr and _snapshot(model) == before


def test_make_tiny_model_uses_the_umask(tmp_path):
    r = subprocess.run(["sh", "-c", f"umask 022 && {sys.executable} -m hybrimoe make-tiny-model t.gguf"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE((tmp_path / "t.gguf").stat().st_mode) == 0o644
