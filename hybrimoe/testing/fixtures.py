"""pytest fixtures shared by hybrimoe's test suite (``tests/conftest.py`` loads this module as a plugin): tiny MoE
models written once per session, ggml RPC servers on 127.0.0.1 as the accelerator stand-in, and a planner cost model
that makes splits mixed on the tiny models. Needs pytest (the ``test`` extra); nothing else in hybrimoe imports it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hybrimoe.envs import TRACE_ENV
from hybrimoe.runtime.rpc import RPCServer
from hybrimoe.testing.upstream import SPLIT_COST
from hybrimoe.tiny import fixture_set, make_tiny_model
from hybrimoe.traces.format import default_trace_path

#: the architectures of the engine's exactness matrix (tests/runtime/test_engine*.py) and their quant types
ENGINE_ARCHS = ("qwen3moe", "qwen2moe", "olmoe", "llama", "deepseek2")
ENGINE_QUANTS = ("Q8_0", "Q4_K_M")


def start_dir(config: pytest.Config) -> Path:
    """The folder pytest started in: paths the user means relative to where they ran pytest are resolved against
    it, never against the working directory (:func:`_cwd_outside_checkout` moves that out of the checkout)."""
    return Path(config.invocation_params.dir)


@pytest.fixture(scope="session", autouse=True)
def _cwd_outside_checkout(tmp_path_factory, request):
    """Every test runs with its working directory outside the checkout, so that a ``python -m hybrimoe`` subprocess
    imports the installed package (with its compiled ``_core``), not the source tree that the cwd would put first on
    ``sys.path``. The development trace, when found from the directory pytest started in, is passed on to
    subprocesses through ``HYBRIMOE_TRACE``."""
    old = os.getcwd()
    trace = default_trace_path(start_dir(request.config))
    if TRACE_ENV not in os.environ and trace.is_file():
        os.environ[TRACE_ENV] = str(trace.resolve())
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        yield
    finally:
        os.chdir(old)


@pytest.fixture(scope="session")
def dev_trace_path(request) -> Path:
    """Where the DeepSeek-V2-Lite development trace is, or would be (``../shared/traces/`` beside the folder pytest
    started in, or ``$HYBRIMOE_TRACE``), whether or not it is there."""
    return default_trace_path(start_dir(request.config))


@pytest.fixture(scope="session")
def dev_trace(dev_trace_path) -> Path:
    """The DeepSeek-V2-Lite development trace; the test is skipped (with the reason) where it is absent, as on a
    fresh clone without ``../shared``."""
    if not dev_trace_path.is_file():
        pytest.skip(f"routing trace not present at {dev_trace_path} (set HYBRIMOE_TRACE)")
    return dev_trace_path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(model_dir):
    """``tiny_model(arch, quant, **knobs) -> Path``: a tiny MoE GGUF, written once per session per recipe."""
    recipes = fixture_set()
    made: dict = {}

    def make(arch: str = "qwen3moe", quant: str | None = "Q8_0", **knobs) -> Path:
        key = (arch, quant, tuple(sorted(knobs.items())))
        if key not in made:
            if (arch, quant) in recipes:
                kw = dict(recipes[(arch, quant)])
            elif quant == "mix" and (arch, "Q4_K_M") in recipes:  # K-quant shapes, per-tensor mixed types
                kw = dict(recipes[(arch, "Q4_K_M")], quant="mix")
            else:
                kw = {"arch": arch, "quant": quant}
            kw.update(knobs)
            made[key] = make_tiny_model(model_dir / f"{arch}-{quant}-{len(made)}.gguf", **kw)
        return Path(made[key])

    return make


#: expert quant types of the repacked-weight and fused-share tests: file types, or per-tensor mixes with the routed
#: experts of one type (the types ggml-cpu may repack: tests/runtime/test_engine_repack.py, test_fused_cpu.py)
EXPERT_QUANTS = {
    "Q4_0": "Q4_0",
    "Q4_K_M": "Q4_K_M",
    "IQ4_NL": {"base": "Q8_0", "ffn_.*_exps": "IQ4_NL"},
    "MXFP4": {"base": "Q8_0", "ffn_.*_exps": "MXFP4"},
    "Q8_0": "Q8_0",
    "Q5_0": {"base": "Q8_0", "ffn_.*_exps": "Q5_0"},
}


@pytest.fixture(scope="session")
def expert_quant_model(model_dir):
    """``expert_quant_model(arch, quant) -> str``: the K-quant-shaped tiny fixture of ``arch`` (rows of 256: every
    type fits) with :data:`EXPERT_QUANTS` ``[quant]``, written once per session."""
    made: dict = {}

    def make(arch: str, quant: str) -> str:
        if (arch, quant) not in made:
            kw = dict(fixture_set()[(arch, "Q4_K_M")], quant=EXPERT_QUANTS[quant])
            made[(arch, quant)] = str(make_tiny_model(model_dir / f"{arch}-experts-{quant}.gguf", **kw))
        return made[(arch, quant)]

    return make


@pytest.fixture(scope="session")
def rpc_server():
    """A ``ggml-rpc-server --device CPU`` on 127.0.0.1 for this test process (it serves one client at a time)."""
    with RPCServer(threads=1) as server:
        yield server


@pytest.fixture(scope="session")
def rpc_server_factory():
    """Starts more RPC servers on demand (keyword arguments of :class:`hybrimoe.runtime.rpc.RPCServer`), all stopped at
    the end of the session: a server a test process has registered must outlive every later Llama, because
    upstream's ``llama_cpp.Llama`` (the tests' oracle) uses every registered device."""
    servers = []

    def start(**kw):
        srv = RPCServer(threads=1, **kw).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()


@pytest.fixture(scope="session")
def split_cost_model(tmp_path_factory) -> str:
    """A cost-model file of :data:`hybrimoe.testing.upstream.SPLIT_COST` (mixed CPU/GPU splits on the tiny
    models)."""
    p = tmp_path_factory.mktemp("cost") / "split-cost.json"
    p.write_text(json.dumps(SPLIT_COST))
    return str(p)
