"""The package's import graph is one-way: no cycle among hybrimoe's modules (module- and function-level imports
alike), no library package imports the commands or the server, nothing imports the package root for internals, and
the layers import only the layers above them (hybrimoe/__init__'s table). Read from the source with ``ast``: no
module is imported to check it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import hybrimoe

PKG = Path(hybrimoe.__file__).resolve().parent
#: native modules (built extensions, no .py source)
NATIVE = ("hybrimoe._core", "hybrimoe._engine")
#: each library package and the packages (and top-level modules) it may import; every package may import the
#: private top-level modules (_lib, _ggml, _lazy, _version, envs, outputs) and the native ones
SHARED = {"hybrimoe._lib", "hybrimoe._ggml", "hybrimoe._lazy", "hybrimoe._version", "hybrimoe.envs",
          "hybrimoe.outputs", *NATIVE}
ALLOWED = {
    "model": set(),
    "policy": {"model"},
    "traces": {"model", "policy"},
    "tiny": set(),
    "sim": {"model", "policy", "traces"},
    "runtime": {"model", "policy", "traces", "tiny"},
    "server": {"model", "policy", "traces", "tiny", "runtime"},
    "testing": {"model", "policy", "traces", "tiny", "runtime", "sim"},
    "commands": {"model", "policy", "traces", "tiny", "runtime", "sim", "server"},
}


def modules() -> dict:
    """{dotted name: (path, is package)} of every .py module of the package."""
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (p, is_pkg)
    return out


def import_edges(mods: dict) -> dict:
    """{module: {(imported hybrimoe module, line)}} for every import statement anywhere in each module (function
    bodies included)."""
    known = set(mods) | set(NATIVE)

    def resolve(name: str):
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict = {m: set() for m in mods}
    for m, (path, is_pkg) in mods.items():
        base = m.split(".") if is_pkg else m.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                full = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                targets = [f"{full}.{a.name}" if f"{full}.{a.name}" in known else full for a in node.names]
            for t in targets:
                r = resolve(t)
                if r and r.startswith("hybrimoe") and r != m:
                    edges[m].add((r, node.lineno))
    return edges


def _cycles(edges: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: {t for t, _ in e} for m, e in edges.items()}
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return comps


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def edges():
    return import_edges(modules())


def test_the_walk_sees_imports_at_every_level(edges):
    """The walk itself: function-level imports count (commands import the runtime inside run())."""
    assert any(t == "hybrimoe.runtime.llama" for t, _ in edges["hybrimoe.commands.llama_args"])
    assert any(t == "hybrimoe._core" for t, _ in edges["hybrimoe.policy.presets"])


def test_no_import_cycle(edges):
    assert _cycles(edges) == []


def test_library_packages_import_only_the_layers_above_them(edges):
    bad = []
    for m, targets in edges.items():
        layer = _layer(m)
        if layer not in ALLOWED:
            continue
        for t, line in targets:
            if t in SHARED or _layer(t) == layer:
                continue
            if _layer(t) not in ALLOWED[layer]:
                bad.append(f"{m}:{line} imports {t}")
    assert bad == []


def test_nothing_imports_the_commands_or_the_server_but_the_commands(edges):
    """Only the commands (and ``python -m hybrimoe``, their entry point) import the commands and the server."""
    bad = [f"{m}:{line} imports {t}" for m, targets in edges.items() for t, line in targets
           if _layer(t) in ("commands", "server") and _layer(m) not in ("commands", _layer(t), "__main__")]
    assert bad == []


def test_nothing_imports_the_package_root(edges):
    """The root's lazy re-exports point down into everything; nothing points back up to them (``from hybrimoe import
    Llama`` inside the package would make the root a hub of cycles). ``__main__`` included."""
    bad = [f"{m}:{line}" for m, targets in edges.items() for t, line in targets if t == "hybrimoe"]
    assert bad == []


def test_the_package_root_holds_only_the_shared_modules():
    """The root is not flat again: besides ``__init__`` and ``__main__`` its modules are the shared private ones
    (native loading, the environment table, output files), and every submodule the root's ``__getattr__`` offers
    exists (no leftover name of a module that is gone)."""
    root = {m for m, (path, is_pkg) in modules().items() if not is_pkg and m.count(".") == 1}
    assert root - SHARED - {"hybrimoe.__main__"} == set()
    offered = [f"hybrimoe.{name}" for name in hybrimoe._SUBMODULES]
    assert [m for m in offered if m not in modules() and m not in NATIVE] == []


def test_one_import_style(edges):
    """Absolute imports only inside the package (ruff's TID252 enforces it too)."""
    rel = []
    for m, (path, _) in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                rel.append(f"{m}:{node.lineno}")
    assert rel == []


def test_a_source_checkout_on_the_path_says_it_shadows_the_package():
    """Python run inside the checkout (``python -m pytest`` puts the working directory first on sys.path) imports
    hybrimoe from the source tree, which has no compiled ``_core``: the error says so and what to run instead, not
    only "No module named 'hybrimoe._core'"."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    if any(p.suffix in (".so", ".pyd") for p in (repo / "hybrimoe").glob("_core*")):
        pytest.skip("this checkout holds a built _core (an in-place build): nothing is shadowed")
    r = subprocess.run([sys.executable, "-c", "import hybrimoe; hybrimoe._core"], cwd=repo, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0, r.stdout
    assert "shadows the installed package" in r.stderr and "run pytest" in r.stderr, r.stderr
