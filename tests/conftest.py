"""Shared fixtures: tiny MoE models (written once per test session) and a ggml RPC server per test process."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

ARCHS = ["qwen3moe", "qwen2moe", "olmoe", "llama", "deepseek2"]
QUANTS = ["Q8_0", "Q4_K_M"]


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
            kw = dict(recipes.get((arch, quant), {"arch": arch, "quant": quant}))
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
    out = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
    assert np.isfinite(out).all() and np.abs(out).max() > 0, "logits not computed"
    return out


@pytest.fixture
def logits():
    return last_logits


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "2")
