"""Bad input gets a clear error naming the problem, never a crash, and nothing the user had is touched."""
from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(args, cwd):
    return subprocess.run([sys.executable, "-m", "hybrimoe", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_missing_model(tmp_path):
    from hybrimoe import Llama

    with pytest.raises(FileNotFoundError, match="not found"):
        Llama(str(tmp_path / "nope.gguf"), verbose=False)
    r = run_cli(["run", "-m", str(tmp_path / "nope.gguf"), "-p", "hi"], tmp_path)
    assert r.returncode != 0 and "not found" in r.stderr and "Traceback" not in r.stderr


def test_not_gguf_and_truncated(tmp_path, tiny_model):
    from hybrimoe import Llama

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"hello, not a model" * 10)
    with pytest.raises(ValueError, match="not a GGUF"):
        Llama(str(junk), verbose=False)
    good = tiny_model("qwen3moe", "Q8_0").read_bytes()
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="truncated"):
        Llama(str(trunc), verbose=False)
    assert trunc.stat().st_size == len(good) // 2  # the user's file is left as it was
    r = run_cli(["run", "-m", str(trunc), "-p", "hi"], tmp_path)
    assert r.returncode != 0 and "truncated" in r.stderr and "Traceback" not in r.stderr


def test_empty_prompt(tiny_model, tmp_path):
    from hybrimoe import Llama

    path = str(tiny_model("qwen3moe", "Q8_0"))
    llm = Llama(path, n_ctx=64, verbose=False)
    with pytest.raises(ValueError, match="empty"):
        llm.create_completion("", max_tokens=4)
    llm.close()
    r = run_cli(["run", "-m", path, "-p", ""], tmp_path)
    assert r.returncode == 2 and "empty" in r.stderr


def test_bad_offload_options(tiny_model):
    from hybrimoe import Llama

    path = str(tiny_model("qwen3moe", "Q8_0"))
    with pytest.raises(ValueError, match="REGEX|regex|buffer type"):
        Llama(path, verbose=False, tensor_buft_overrides="exps")
    with pytest.raises(ValueError, match="unknown buffer type"):
        Llama(path, verbose=False, tensor_buft_overrides="exps=NOPE0")
    with pytest.raises(ValueError, match="HOST:PORT"):
        Llama(path, verbose=False, rpc_servers="localhost")
    with pytest.raises(ValueError, match="n_cpu_moe"):
        Llama(path, verbose=False, n_cpu_moe=-1)
    with pytest.raises(ValueError, match="n_cpu_moe"):
        Llama(path, verbose=False, cpu_moe=True, n_cpu_moe=-1)


def test_cpu_moe_with_n_cpu_moe_says_the_second_adds_nothing(tiny_model):
    """--cpu-moe already keeps every layer's experts in host memory: with --n-cpu-moe too, the placement is
    --cpu-moe's (as upstream, where both overrides apply) and a warning names the option that adds nothing."""
    from hybrimoe import Llama
    from hybrimoe.runtime.params import moe_overrides

    assert moe_overrides(cpu_moe=True) == moe_overrides(cpu_moe=True, n_cpu_moe=0)
    with pytest.warns(UserWarning, match="n_cpu_moe=1 .* adds nothing"):
        both = moe_overrides(cpu_moe=True, n_cpu_moe=1)
    assert both == moe_overrides(cpu_moe=True) != moe_overrides(n_cpu_moe=1)
    path = str(tiny_model("qwen3moe", "Q8_0"))
    with pytest.warns(UserWarning, match="adds nothing"):
        llm = Llama(path, verbose=False, cpu_moe=True, n_cpu_moe=2)
    llm.close()


@pytest.mark.parametrize("flag", [{"cpu_moe": True}, {"n_cpu_moe": 2}])
def test_upstream_placement_flags_with_the_engine_say_they_do_nothing(tiny_model, flag):
    """With the MoE engine on (here the RAM tier, CPU only) every routed expert stays in host memory whatever
    --cpu-moe / --n-cpu-moe say: they are accepted (as upstream's scripts pass them) with a warning naming the flag,
    and the run gives the same tokens as without them."""
    from hybrimoe import Llama

    path = str(tiny_model("qwen3moe", "Q8_0"))
    name = next(iter(flag))
    with pytest.warns(UserWarning, match=f"{name}.* has no effect with the MoE engine"):
        llm = Llama(path, verbose=False, moe_ram_cache="100%", **flag)
    try:
        got = llm("hello", max_tokens=6, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()
    ref = Llama(path, verbose=False, moe_ram_cache="100%")
    try:
        assert got == ref("hello", max_tokens=6, temperature=0.0)["choices"][0]["text"]
    finally:
        ref.close()


def test_rpc_server_not_there(tiny_model, tmp_path):
    """A server that is not there: a clear error, in a child process so that an abort could not take pytest."""
    from hybrimoe.runtime.rpc import free_port

    path = str(tiny_model("qwen3moe", "Q8_0"))
    r = run_cli(["run", "-m", path, "-p", "hi", "-n", "2", "--rpc", f"127.0.0.1:{free_port()}", "-ngl", "99"],
                tmp_path)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "not reachable" in r.stderr


def test_import_order_error(tmp_path):
    import os

    code = "import llama_cpp\nfrom hybrimoe import Llama\n"
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}  # set by this process's hybrimoe
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode != 0
    assert "Import hybrimoe first" in r.stderr


def test_import_hybrimoe_first_then_llama_cpp_uses_our_lib(tmp_path):
    code = ("import hybrimoe, llama_cpp, pathlib\n"
            "print(pathlib.Path(llama_cpp.llama_cpp._base_path).resolve() == hybrimoe.LIB_DIR.resolve())\n"
            "from hybrimoe import Llama\nprint('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "ok"]


def test_generation_stops_at_context_end(tiny_model, tmp_path):
    path = str(tiny_model("qwen3moe", "Q8_0"))
    r = run_cli(["run", "-m", path, "-p", "hello there", "-n", "500", "-c", "64", "--temp", "0",
                 "--output-format", "json"], tmp_path)
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout)
    assert 64 <= out["n_ctx"] < 503  # llama.cpp may round the context up
    assert len(out["prompt_tokens"]) + len(out["tokens"]) == out["n_ctx"]
    r = run_cli(["run", "-m", path, "-p", "hello " * 600, "-c", "64"], tmp_path)
    assert r.returncode == 1 and f"context holds {out['n_ctx']}" in r.stderr and "Traceback" not in r.stderr


def test_override_split_at_first_equals_as_upstream(tiny_model):
    from hybrimoe import Llama

    with pytest.raises(ValueError, match="unknown buffer type 'CPU=CPU'"):
        Llama(str(tiny_model("qwen3moe", "Q8_0")), verbose=False, tensor_buft_overrides="exps=CPU=CPU")


def test_make_tiny_model_failure_keeps_existing_file(tmp_path):
    from hybrimoe.tiny import make_tiny_model

    target = tmp_path / "keep.gguf"
    target.write_bytes(b"precious")
    with pytest.raises(ValueError):
        make_tiny_model(target, "qwen3moe", n_head=0)
    with pytest.raises(ValueError):
        make_tiny_model(target, "qwen3moe", router_margin=float("nan"))
    assert target.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.gguf"]  # no temporary file left


def test_moe_stats_without_engine_says_so(tmp_path):
    r = run_cli(["run", "-p", "hi", "-n", "2", "--moe-stats", "--moe-hook"], tmp_path)
    assert r.returncode == 2 and "--moe-stats" in r.stderr and "needs --moe-cache" in r.stderr, r.stderr


def test_top_level_help_is_a_whole_sentence(tmp_path):
    r = run_cli(["--help"], tmp_path)
    assert r.returncode == 0
    desc = r.stdout.split("\n\n")[1].strip()
    assert desc.endswith("bench.") and "``" not in desc, desc


def _required(parser) -> list[str]:
    """A value for each positional argument and required flag of a subcommand's parser (a file name: nothing is read
    before the flags are parsed)."""
    out = []
    for a in parser._actions:
        if not a.option_strings:
            out.append("x.gguf")
        elif a.required:
            out += [a.option_strings[0], "x.gguf"]
    return out


def _typo(flag: str) -> str:
    """``flag`` with the two letters after its dashes swapped (--moe-cache: --moe-cahce is another slip)."""
    return flag[:2] + flag[3] + flag[2] + flag[4:]


@pytest.mark.parametrize("argv, hint", [(["run", "-p", "Hi", "-n", "8", "--moe-cahce", "25%"], "--moe-cache"),
                                        (["run", "--tmep", "0"], "--temp"),
                                        (["serve", "--prot", "8080"], "--port")])
def test_a_mistyped_flag_gets_the_closest_and_the_commands_usage(argv, hint, capsys):
    from hybrimoe import commands

    assert commands.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: hybrimoe {argv[0]} "), err
    assert f"hybrimoe {argv[0]}: error: unrecognized arguments:" in err and f"(did you mean {hint}?)" in err, err


def test_every_command_suggests_its_own_flags(capsys):
    """The rule holds in every subcommand: its longest flag, mistyped, is named back with that command's usage."""
    import argparse

    from hybrimoe import commands

    parser = commands.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(subs) == set(commands.COMMANDS)
    for name, sub in subs.items():
        flag = max((s for a in sub._actions for s in a.option_strings if s.startswith("--")), key=len)
        assert commands.main([name, *_required(sub), _typo(flag)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"usage: hybrimoe {name} ") and f"(did you mean {flag}?)" in err, (name, err)


def test_a_mistyped_command_gets_the_closest(capsys):
    from hybrimoe import commands

    assert commands.main(["rnu", "-p", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'rnu'; did you mean 'run'?" in err, err
    assert commands.main(["zzzz"]) == 2  # nothing close: argparse's own message
    assert "invalid choice: 'zzzz'" in capsys.readouterr().err
