"""hybrimoe.envs is the one table of HYBRIMOE_* variables and the one place the package reads them: every such name in
the repository (code, scripts, CI, docs) is in the table, and no other module of the package reads one."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

import hybrimoe
from hybrimoe import envs

PKG = Path(hybrimoe.__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[1]  # the checkout these tests belong to
NAME = re.compile(r"\bHYBRIMOE_[A-Z0-9_]*[A-Z0-9]\b")
#: in C, C++, patches and CMake, HYBRIMOE_ also names macros and CMake variables: there only what is read from the
#: environment counts
NATIVE_ENV = re.compile(r"(?:getenv\(\s*\"|\$ENV\{)(HYBRIMOE_[A-Z0-9_]+)")
NATIVE = (".h", ".hpp", ".c", ".cpp", ".cu", ".patch", ".cmake", ".txt")


def _repo_files() -> list[Path]:
    """The checkout's tracked files (the installed package alone when git cannot list them)."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return sorted(PKG.rglob("*.py"))
    return [ROOT / f for f in out.splitlines() if (ROOT / f).is_file()]


def test_every_variable_named_anywhere_is_in_the_table():
    seen = {}
    files = _repo_files()
    # CMake options and variables (option(HYBRIMOE_X ...), set(HYBRIMOE_X ...)) share the prefix and are no
    # environment variables, wherever they are mentioned
    cmake_names = {m for f in files if f.suffix in (".cmake", ".txt")
                   for m in re.findall(r"(?:option|set)\(\s*(HYBRIMOE_\w+)", f.read_text(errors="replace"))}
    for f in files:
        if f.resolve() == Path(__file__).resolve():
            continue  # this file's HYBRIMOE_X, _Y and _Z are the examples of the check's own test below
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        names = NATIVE_ENV.findall(text) if f.suffix in NATIVE else NAME.findall(text)
        for name in names:
            if name not in cmake_names:
                seen.setdefault(name, str(f.relative_to(ROOT)))
    assert seen, "the walk found no HYBRIMOE_ variable at all"
    missing = {n: f for n, f in seen.items() if n not in envs.VARIABLES}
    assert missing == {}


def _env_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every os.environ / os.getenv read or write of a HYBRIMOE_ string literal."""
    out = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value):
            target = node.slice
        elif isinstance(node, ast.Call) and re.search(r"(environ\.(get|pop|setdefault)|getenv)$",
                                                       ast.unparse(node.func)):
            target = node.args[0] if node.args else None
        if isinstance(target, ast.Constant) and isinstance(target.value, str) and target.value.startswith("HYBRIMOE_"):
            out.append((node.lineno, target.value))
    return out


def test_only_envs_reads_the_environment():
    bad = []
    for p in PKG.rglob("*.py"):
        if p.name == "envs.py" and p.parent == PKG:
            continue
        bad += [f"{p.relative_to(PKG)}:{line} {name}" for line, name in _env_reads(ast.parse(p.read_text()))]
    assert bad == []


def test_the_walk_finds_a_read():
    """The check itself: a module that reads HYBRIMOE_X directly is found."""
    code = 'import os\nx = os.environ.get("HYBRIMOE_X")\ny = os.environ["HYBRIMOE_Y"]\nz = os.getenv("HYBRIMOE_Z")\n'
    assert [n for _, n in _env_reads(ast.parse(code))] == ["HYBRIMOE_X", "HYBRIMOE_Y", "HYBRIMOE_Z"]


def test_readers(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIMOE_CACHE_DIR", str(tmp_path))
    assert envs.cache_dir() == tmp_path
    monkeypatch.delenv("HYBRIMOE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.cache_dir() == tmp_path / "xdg" / "hybrimoe"
    for value, on in (("0", False), ("off", False), ("False", False), ("1", True), ("", True)):
        monkeypatch.setenv("HYBRIMOE_AUTO_CALIBRATE", value)
        assert envs.auto_calibrate() is on, value
    for value, t in (("2.5", 2.5), ("-1", envs.RPC_TIMEOUT_S), ("x", envs.RPC_TIMEOUT_S)):
        monkeypatch.setenv("HYBRIMOE_RPC_TIMEOUT_S", value)
        assert envs.rpc_timeout_s() == t
    monkeypatch.setenv("HYBRIMOE_MAX_BUFFER_BYTES", "4096")
    assert envs.max_buffer_bytes() == 4096
    for bad in ("0", "-3", "1e3", "lots"):
        monkeypatch.setenv("HYBRIMOE_MAX_BUFFER_BYTES", bad)
        with pytest.raises(ValueError, match="HYBRIMOE_MAX_BUFFER_BYTES must be a positive number of bytes"):
            envs.max_buffer_bytes()


@pytest.mark.parametrize("reader, name", [(envs.ram_direct_io, "HYBRIMOE_RAM_DIRECT_IO"),
                                          (envs.ram_two_pass, "HYBRIMOE_RAM_TWO_PASS")])
def test_switches_take_on_and_off_and_refuse_typos(reader, name, monkeypatch):
    """The RAM tier's on/off switches: on when unset or 1/yes/true/on, off for 0/no/false/off (any case, spaces
    around); a typo is refused naming the variable, not read as on."""
    monkeypatch.delenv(name, raising=False)
    assert reader() is True
    for on in ("1", " ON ", "yes", "True", ""):
        monkeypatch.setenv(name, on)
        assert reader() is True, on
    for off in ("0", " off ", "No", "FALSE"):
        monkeypatch.setenv(name, off)
        assert reader() is False, off
    for bad in ("maybe", "2", "of"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            reader()
