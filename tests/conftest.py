"""Shared fixtures: tiny MoE models (written once per test session) and a ggml RPC server per test process."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

# The engine calibrates its cost model on first use of a model on a device (hybrimoe.calibration.on_first_use). Tests
# give their cost model or get the preset, so that their splits do not depend on timings of the shared CPU; the
# first-use calibration is tested on its own (test_calibrate.py).
os.environ.setdefault("HYBRIMOE_AUTO_CALIBRATE", "0")

ARCHS = ["qwen3moe", "qwen2moe", "olmoe", "llama", "deepseek2"]
QUANTS = ["Q8_0", "Q4_K_M"]


@pytest.fixture(scope="session", autouse=True)
def _cwd_outside_checkout(tmp_path_factory):
    """Every test runs with its working directory outside the checkout, so that a ``python -m hybrimoe`` subprocess
    imports the installed package (with its compiled ``_core``), not the source tree that the cwd would put first on
    ``sys.path``."""
    from hybrimoe.trace import default_trace_path

    old = os.getcwd()
    trace = default_trace_path()  # found from the directory pytest started in (its parents hold shared/)
    if "HYBRIMOE_TRACE" not in os.environ and trace.is_file():
        os.environ["HYBRIMOE_TRACE"] = str(trace.resolve())
    os.chdir(tmp_path_factory.mktemp("cwd"))
    try:
        yield
    finally:
        os.chdir(old)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(model_dir):
    """``tiny_model(arch, quant, **knobs) -> Path``: a tiny MoE GGUF, written once per session per recipe."""
    from hybrimoe.tiny import fixture_set, make_tiny_model

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


@pytest.fixture(scope="session")
def rpc_server():
    """A ``ggml-rpc-server --device CPU`` on 127.0.0.1 for this test process (it serves one client at a time)."""
    from hybrimoe.rpc import RPCServer

    with RPCServer(threads=1) as server:
        yield server


@pytest.fixture(scope="session")
def rpc_server_factory():
    """Starts more RPC servers on demand (keyword arguments of ``hybrimoe.rpc.RPCServer``), all stopped at the end
    of the session: a server a test process has registered must outlive every later Llama, because upstream's
    ``llama_cpp.Llama`` (the tests' oracle) uses every registered device."""
    from hybrimoe.rpc import RPCServer

    servers = []

    def start(**kw):
        srv = RPCServer(threads=1, **kw).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()


def greedy_tokens(llm, prompt: str, n: int) -> list[int]:
    """Greedy continuation of ``prompt`` (``n`` tokens at most; stops at end of generation)."""
    from hybrimoe.cli import generate_tokens

    toks = llm.tokenize(prompt.encode(), add_bos=True, special=False)
    return generate_tokens(llm, toks, n, temp=0.0)


@pytest.fixture
def greedy():
    return greedy_tokens


def last_logits(llm) -> np.ndarray:
    """Logits of the last evaluated token (float32 [n_vocab]); llama-cpp-python keeps them in its context only
    (its ``scores`` array is filled only with ``logits_all``)."""
    from hybrimoe import oracle

    out = oracle.last_logits(llm)
    assert np.isfinite(out).all() and np.abs(out).max() > 0, "logits not computed"
    return out


@pytest.fixture
def logits():
    return last_logits


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    # CI runs the property tests with a fixed seed: a red CI run must be reproducible, not a draw
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")


# ---- engine helpers (tests/test_engine*.py) ---------------------------------------------------------------------

def prompt_of(llm, n: int) -> list[int]:
    """Exactly ``n`` prompt tokens (BOS first), from a fixed English text repeated as needed."""
    from hybrimoe.oracle import prompt_tokens

    return prompt_tokens(llm, n)


def run_greedy(llm, tokens: list[int], n: int = 32) -> tuple[list[int], np.ndarray]:
    """Greedy continuation (``n`` tokens at most) and the logits of the last evaluated token."""
    from hybrimoe.cli import generate_tokens

    out = generate_tokens(llm, tokens, n, temp=0.0)
    return out, last_logits(llm)


def run_engine_and_close(llm, n_prompt: int, n_gen: int, control: str = ""):
    """``(prompt tokens, greedy tokens, last logits, moe_stats())`` of one engine run of ``n_prompt`` prompt tokens
    and ``n_gen`` generated ones, optionally with a negative control (``Engine.set_negative_control``); asserts
    that no expert stays pinned afterwards, and closes ``llm`` in every case."""
    try:
        if control:
            llm.moe_engine.set_negative_control(control)
        tokens = prompt_of(llm, n_prompt)
        out, lg = run_greedy(llm, tokens, n_gen)
        st = llm.moe_stats()
        assert llm.moe_engine.pinned_count() == 0
    finally:
        llm.close()
    return tokens, out, lg, st


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    """Normalised mean squared error sum((a-ref)^2) / sum(ref^2)."""
    from hybrimoe import oracle

    return oracle.nmse(a, ref)


# A planner cost model under which CPU and GPU are comparable for the tiny fixtures, so that splits are mixed
# (the hardware presets would keep such tiny experts on the CPU); seconds and bytes/s, schema hybrimoe.cost_model/1.
SPLIT_COST = {"schema": "hybrimoe.cost_model/1", "cpu_a_s": 4e-4, "cpu_b_s": 4e-5, "cpu_startup_s": 1e-5,
              "gpu_a_s": 1e-4, "gpu_b_s": 1e-6, "h2d_bandwidth_Bps": 2e8, "h2d_latency_s": 2e-5,
              "act_a_s": 5e-5, "act_b_s": 1e-7, "layer_a_s": 1e-4, "layer_b_s": 1e-6, "dense_a_s": 1e-4,
              "dense_b_s": 1e-6}


@pytest.fixture(scope="session")
def split_cost_model(tmp_path_factory) -> str:
    import json

    p = tmp_path_factory.mktemp("cost") / "split-cost.json"
    p.write_text(json.dumps(SPLIT_COST))
    return str(p)


@pytest.fixture
def engine_tools():
    """Helper functions for engine tests: prompt_of, run_greedy, run_engine_and_close, nmse."""
    return type("EngineTools", (), {"prompt_of": staticmethod(prompt_of), "run_greedy": staticmethod(run_greedy),
                                    "run_engine_and_close": staticmethod(run_engine_and_close),
                                    "nmse": staticmethod(nmse)})
