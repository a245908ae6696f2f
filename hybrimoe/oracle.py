"""Helpers for comparing hybrimoe with its oracle, upstream llama.cpp with the same placement: a fixed prompt,
greedy decoding with the last logits, and the normalised error of two logit vectors. Used by the tests
(``tests/conftest.py``) and by the GPU check (``scripts/gpu_check.py``), which runs without the test tree."""
from __future__ import annotations

import numpy as np

#: English text the prompts are cut from (any tokenizer gives a few tokens per word).
FIXED_TEXT = ("Once upon a time there was a little robot who lived in a quiet town by the sea. Every morning it "
              "walked to the harbour, counted the boats and wrote their names in a small blue book. ")


def prompt_tokens(llm, n: int) -> list[int]:
    """Exactly ``n`` prompt tokens (BOS first) of :data:`FIXED_TEXT`, repeated as needed."""
    toks = llm.tokenize(FIXED_TEXT.encode(), add_bos=True, special=False)
    more = llm.tokenize(FIXED_TEXT.encode(), add_bos=False, special=False)
    while len(toks) < n:
        toks = toks + more
    return toks[:n]


def last_logits(llm) -> np.ndarray:
    """A copy of the logits (float32 ``[n_vocab]``) of the last evaluated token."""
    from hybrimoe._lib import llama_cpp_module

    lc = llama_cpp_module().llama_cpp
    return np.ctypeslib.as_array(lc.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),)).copy()


def greedy_with_logits(llm, tokens: list[int], n: int = 32) -> tuple[list[int], np.ndarray]:
    """Greedy continuation of ``tokens`` (``n`` tokens at most) and the logits of the last evaluated token."""
    from hybrimoe.cli import generate_tokens

    out = generate_tokens(llm, tokens, n, temp=0.0)
    return out, last_logits(llm)


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    """Normalised mean squared error ``sum((a - ref)^2) / sum(ref^2)``, in float64 (0 for identical vectors)."""
    a, ref = np.asarray(a, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.sum((a - ref) ** 2) / max(np.sum(ref ** 2), 1e-30))
