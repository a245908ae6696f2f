"""The command line as a whole: every numeric flag is range-checked by its type (one line, status 2, before anything
loads), --help shows the defaults, the registry does not hide a broken command, output that cannot be written is one
line (a closed pipe quiet), and ``run`` says when the context stopped it and prints llama.cpp-style timings."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from hybrimoe import commands
from hybrimoe.commands.args import float_in, int_in


def _subparsers() -> dict:
    parser = commands.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_numeric_flag_has_a_checked_type():
    """No command takes a bare int or float: each number goes through hybrimoe.commands.args (ranges, NaN)."""
    bare = [f"{name} {'/'.join(a.option_strings) or a.dest}"
            for name, p in _subparsers().items() for a in p._actions if a.type in (int, float)]
    assert bare == []
    checked = [a for p in _subparsers().values() for a in p._actions if hasattr(a.type, "checked_range")]
    assert len(checked) >= 30  # the walk sees the flags (the shared llama flags alone are a dozen per command)


def _cli(argv, **kw):
    return subprocess.run([sys.executable, "-m", "hybrimoe", *argv], capture_output=True, text=True, timeout=300,
                          **kw)


@pytest.mark.parametrize("argv, flag", [
    (["simulate", "--seed", "-1"], "--seed"),
    (["simulate", "--seed", str(2 ** 32)], "--seed"),
    (["simulate", "--profile-fraction", "1"], "--profile-fraction"),
    (["run", "--temp", "nan"], "--temp"),
    (["run", "--top-p", "0"], "--top-p"),
    (["run", "-t", "0"], "-t/--threads"),
    (["trace", "-o", "x.npz", "-t", "0"], "-t/--threads"),
    (["bench", "-m", "x.gguf", "-t", "0"], "-t/--threads"),
    (["serve", "--port", "70000"], "--port"),
    (["make-tiny-model", "x.gguf", "--router-margin", "inf"], "--router-margin"),
])
def test_numbers_out_of_range_are_one_line_errors(argv, flag, tmp_path):
    r = _cli(argv, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert f"error: argument {flag}:" in last and "Traceback" not in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_shared_flags_validate_alike_in_every_command():
    """-t means the same in run, trace, serve, calibrate and bench: the same type object."""
    types = {name: next(a.type for a in p._actions if "-t" in a.option_strings)
             for name, p in _subparsers().items() if any("-t" in a.option_strings for a in p._actions)}
    assert set(types) >= {"run", "trace", "serve", "calibrate", "bench"}
    assert len({id(t) for t in types.values()}) == 1


def test_checked_types():
    t = int_in(1, also=(-1,))
    assert t("-1") == -1 and t("3") == 3
    for bad in ("0", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            t(bad)
    f = float_in(0.0, 1.0, lo_open=True)
    assert f("1") == 1.0
    for bad in ("0", "nan", "inf", "-0.1", "1.01"):
        with pytest.raises(argparse.ArgumentTypeError):
            f(bad)


def test_help_shows_the_defaults(capsys):
    for name, ctx in (("run", "512"), ("serve", "2048")):
        assert commands.main([name, "--help"]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert f"(default: {ctx})" in out.split("--ctx-size", 1)[1].split("-b,", 1)[0], (name, out)


def test_every_flag_that_takes_a_value_shows_its_default():
    """README: ``hybrimoe COMMAND --help`` lists every flag with its default. A flag that takes a value and is not
    required says it, in argparse's words or its own (a default of 0 included)."""
    missing = []
    for name, p in _subparsers().items():
        formatter = p._get_formatter()
        for a in p._actions:
            if a.option_strings and a.nargs != 0 and not a.required:
                if "default" not in formatter._get_help_string(a).lower():
                    missing.append(f"{name} {'/'.join(a.option_strings)}")
    assert missing == []


def test_no_flag_states_its_default_twice():
    """A help text that says its default itself ("Default: 1, ...") gets no second "(default: 1)" appended."""
    twice, checked = [], 0
    for name, p in _subparsers().items():
        formatter = p._get_formatter()
        for a in p._actions:
            if a.option_strings and a.help and "default" in a.help.lower():
                checked += 1
                if formatter._get_help_string(a) != a.help:
                    twice.append(f"{name} {'/'.join(a.option_strings)}")
    assert checked > 0 and twice == []


def test_run_help_shows_the_offload_and_thread_defaults(capsys):
    import os

    assert commands.main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 0)" in out.split("--n-gpu-layers", 1)[1].split("--seed", 1)[0], out
    n = os.cpu_count() or 1
    assert f"{max(n // 2, 1)} for generation, {n} for prompt processing" in out.split("--threads", 1)[1].split(
        "-c,", 1)[0], out
    assert "(default: none)" in out.split("--override-tensor", 1)[1].split("-cmoe", 1)[0], out


def test_an_import_error_inside_a_command_is_not_hidden(monkeypatch):
    """A built-in command whose module fails to import is a bug: it propagates (no "unavailable" entry)."""
    monkeypatch.setitem(sys.modules, "hybrimoe.commands.info", None)  # importing it now raises ImportError
    with pytest.raises(ImportError):
        commands.build_parser()


def test_missing_server_packages_are_named(monkeypatch, capsys):
    """Only the server extra's own packages are reported as a missing extra, with both ways to install it; another
    ImportError inside the server is raised."""
    from hybrimoe.commands import serve

    monkeypatch.setitem(sys.modules, "fastapi", None)
    for mod in [m for m in sys.modules if m.startswith("hybrimoe.server")]:
        monkeypatch.delitem(sys.modules, mod)
    assert serve.run(commands.build_parser().parse_args(["serve"])) == 1
    err = capsys.readouterr().err
    assert "fastapi is missing" in err and "pip install 'hybrimoe[server]'" in err and "pip install '.[server]'" in err
    assert serve.missing_extra(ImportError("x", name="hybrimoe.server.metrics")) == ""


def test_closed_pipe_and_full_disk(tmp_path):
    """stdout to a closed pipe: quiet, status 141 (as a process killed by SIGPIPE); to a full device: one line."""
    code = ("import sys; from hybrimoe.commands import main; "
            "sys.exit(main(['synth', '--shape', 'mixtral-8x7b', '-n', '100', '-o', sys.argv[1]]))")
    full = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.npz")], stdout=open("/dev/full", "w"),
                          stderr=subprocess.PIPE, text=True, timeout=300)
    assert full.returncode == 1, full.stderr
    assert full.stderr.strip().splitlines() == [
        "hybrimoe synth: error: cannot write the output: No space left on device"], full.stderr
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "b.npz")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # the reader is gone before the command writes
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141 and err == "", err


def test_run_says_when_the_context_stopped_it_and_prints_timings(tiny_model, tmp_path):
    r = _cli(["run", "-m", str(tiny_model("qwen3moe", "Q8_0")), "-n", "100000", "-c", "64", "--temp", "0"],
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # (llama.cpp pads the context: 64 asked for holds 256 tokens here)
    assert "generation stopped at the end of the context (" in r.stderr and "-c raises it" in r.stderr
    assert "prompt eval time =" in r.stderr and "eval time =" in r.stderr and "tokens per second" in r.stderr


def test_run_prints_the_engines_hit_rate(tiny_model, rpc_server, split_cost_model, tmp_path):
    r = _cli(["run", "-m", str(tiny_model("qwen3moe", "Q8_0")), "-n", "8", "--temp", "0", "--rpc",
              rpc_server.endpoint, "-ngl", "99", "--moe-cache", "50%", "--moe-cost-model", split_cost_model],
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "engine hit rate" in r.stderr and "activated experts resident" in r.stderr
    assert "put every expert on the CPU" not in r.stderr  # the split cost model puts some on the GPU


def test_run_says_why_no_expert_ran_on_the_gpu(tiny_model, rpc_server, tmp_path):
    """With a cost model whose copies cost more than the CPU's compute, the planner keeps every expert on the CPU
    and run says so, with the cost model's figures for one expert of the model."""
    from hybrimoe.policy.cost_model import load_cost_model
    from hybrimoe.runtime.engine_facts import engine_facts
    from hybrimoe.testing.upstream import SPLIT_COST

    path = tiny_model("qwen3moe", "Q8_0")
    slow = tmp_path / "slow-copies.json"
    slow.write_text(json.dumps(dict(SPLIT_COST, cpu_a_s=1e-6, cpu_b_s=1e-7, h2d_bandwidth_Bps=1e7,
                                    h2d_latency_s=1e-3)))
    r = _cli(["run", "-m", str(path), "-n", "8", "--temp", "0", "--rpc", rpc_server.endpoint, "-ngl", "99",
              "--moe-cache", "50%", "--moe-cost-model", str(slow), "--moe-stats"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "/ GPU 0," in r.stderr, r.stderr
    cost, f = load_cost_model(slow), engine_facts(path)
    expert = f.total_expert_bytes / (f.n_expert * len(f.moe_layers))
    why = [line for line in r.stderr.splitlines() if "the planner put every expert on the CPU" in line]
    assert len(why) == 1, r.stderr
    assert f"{cost.h2d(expert) * 1e6:.0f} us to copy an expert" in why[0] and f"the CPU {cost.cpu(1) * 1e6:.0f} us" \
        in why[0], why


def test_run_without_a_gpu_cache_prints_no_gpu_line(tiny_model, tmp_path):
    """The RAM tier alone (no GPU cache): its line, and none about a GPU cache that does not exist."""
    from hybrimoe.runtime.engine_facts import engine_facts

    path = tiny_model("qwen3moe", "Q8_0")
    f = engine_facts(path)
    r = _cli(["run", "-m", str(path), "-n", "4", "--temp", "0", "--moe-ram-cache", str(f.n_expert * f.ram_slot_bytes),
              "--moe-cost-model", "rtx4090-desktop"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "RAM tier hit rate" in r.stderr and "engine hit rate" not in r.stderr, r.stderr


def test_llama_cpp_warnings_only_with_verbose(tiny_model, tmp_path):
    """Without --verbose only hybrimoe's own lines reach stderr (llama.cpp's warnings, e.g. gpt-oss's SWA cache note,
    are hidden as llama-cpp-python hides them for verbose=False); with it llama.cpp's log is there."""
    path = str(tiny_model("gpt-oss", None))
    quiet = _cli(["run", "-m", path, "-n", "4", "--temp", "0"], cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stderr.strip(), quiet.stderr
    assert all(line.startswith("hybrimoe") for line in quiet.stderr.strip().splitlines()), quiet.stderr
    loud = _cli(["run", "-m", path, "-n", "4", "--temp", "0", "--verbose"], cwd=tmp_path)
    assert loud.returncode == 0 and "using full-size SWA cache" in loud.stderr, loud.stderr[-2000:]


@pytest.mark.parametrize("command", ["run", "trace", "serve", "bench"])
def test_flash_attention_defaults_to_auto_as_upstream(command):
    """-fa/--flash-attn takes llama.cpp's values, with llama.cpp's tools' default (auto) in every command."""
    p = _subparsers()[command]
    action = next(a for a in p._actions if "-fa" in a.option_strings)
    assert action.default == "auto"
    # llama.cpp's words (common/arg.cpp is_truthy / is_falsey / is_autoy), each as on, off or auto
    for word, want in (("enabled", "on"), ("1", "on"), ("false", "off"), ("OFF", "off"), ("-1", "auto")):
        assert action.type(word) == want


def test_an_unknown_flash_attn_word_is_a_one_line_error(tmp_path):
    r = _cli(["run", "-fa", "bogus"], cwd=tmp_path)
    assert r.returncode == 2 and "argument -fa/--flash-attn: unknown value 'bogus'" in r.stderr, r.stderr


@pytest.mark.parametrize("argv, expected", [([], -1), (["-fa", "off"], 0), (["--flash-attn", "on"], 1)])
def test_the_flash_attn_flag_reaches_the_context(tiny_model, argv, expected):
    """What ``run`` and ``serve`` load (``load_llama``) gets the flag's value, the default included."""
    from hybrimoe.commands.llama_args import load_llama

    path = tiny_model("qwen3moe", "Q8_0")
    args = commands.build_parser().parse_args(["run", "-m", str(path), *argv])
    llm = load_llama(args, path, "hybrimoe run")
    try:
        assert int(llm.context_params.flash_attn_type) == expected
    finally:
        llm.close()
