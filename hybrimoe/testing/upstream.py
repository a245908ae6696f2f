"""The upstream comparison: hybrimoe against upstream llama.cpp with the same placement (the tests' main yardstick,
and the GPU check's in ``scripts/gpu_check.py``, which runs without the test tree): a fixed prompt, greedy decoding
with the last logits, and the normalised error of two logit vectors."""
from __future__ import annotations

import numpy as np

from hybrimoe._lib import llama_cpp_module
from hybrimoe.runtime.generate import FIXED_TEXT, generate_tokens


def prompt_tokens(llm, n: int) -> list[int]:
    """Exactly ``n`` prompt tokens (BOS first) of :data:`hybrimoe.runtime.generate.FIXED_TEXT`, repeated as
    needed."""
    toks = llm.tokenize(FIXED_TEXT.encode(), add_bos=True, special=False)
    more = llm.tokenize(FIXED_TEXT.encode(), add_bos=False, special=False)
    while len(toks) < n:
        toks = toks + more
    return toks[:n]


def last_logits(llm) -> np.ndarray:
    """A copy of the logits (float32 ``[n_vocab]``) of the last evaluated token.

    Raises:
        AssertionError: they were not computed (not finite, or all zero).
    """
    lc = llama_cpp_module().llama_cpp
    out = np.ctypeslib.as_array(lc.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),)).copy()
    if not (np.isfinite(out).all() and np.abs(out).max() > 0):
        raise AssertionError("logits not computed")
    return out


def greedy_with_logits(llm, tokens: list[int], n: int = 32) -> tuple[list[int], np.ndarray]:
    """Greedy continuation of ``tokens`` (``n`` tokens at most) and the logits of the last evaluated token."""
    out = generate_tokens(llm, tokens, n, temp=0.0)
    return out, last_logits(llm)


def decode_together(llm, prompts: list[list[int]], steps: int) -> list[list[np.ndarray]]:
    """Greedy decode of several sequences in one batch per step (sequence ids 0..len(prompts)-1, ``n_seq_max`` at
    least that many): step 0 evaluates every prompt, each later step one token per sequence (its previous argmax).
    Returns, per step, each sequence's last logits (float32 ``[n_vocab]``, copies).

    Raises:
        AssertionError: ``llama_decode`` failed.
    """
    from hybrimoe._lib import llama_cpp_module

    lc = llama_cpp_module().llama_cpp
    ctx, n_vocab = llm.ctx, llm.n_vocab()
    batch = lc.llama_batch_init(max(64, sum(len(p) for p in prompts)), 0, len(prompts))
    got = []
    try:
        cur, pos = [list(p) for p in prompts], [0] * len(prompts)
        for _ in range(steps):
            batch.n_tokens = 0
            last = []
            for s, toks in enumerate(cur):
                for i, tok in enumerate(toks):
                    j = batch.n_tokens
                    batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, pos[s] + i, 1
                    batch.seq_id[j][0] = s
                    batch.logits[j] = i == len(toks) - 1
                    batch.n_tokens += 1
                last.append(batch.n_tokens - 1)
                pos[s] += len(toks)
            assert lc.llama_decode(ctx, batch) == 0
            step = [np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, j), shape=(n_vocab,)).copy() for j in last]
            got.append(step)
            cur = [[int(np.argmax(x))] for x in step]
    finally:
        lc.llama_batch_free(batch)
    return got


def greedy_run(path, tokens: list[int], n: int, **kw) -> tuple[list[int], np.ndarray, dict]:
    """A :class:`hybrimoe.Llama` of ``path`` with keywords ``kw``: the greedy continuation of ``tokens`` (``n`` tokens
    at most), the last logits and ``moe_stats()``; the Llama is closed in every case."""
    from hybrimoe.runtime.llama import Llama

    llm = Llama(str(path), **kw)
    try:
        out, lg = greedy_with_logits(llm, tokens, n)
        return out, lg, llm.moe_stats()
    finally:
        llm.close()


def greedy_reference(path, n_prompt: int, n: int, **kw) -> tuple[list[int], list[int], np.ndarray]:
    """A :class:`hybrimoe.Llama` of ``path`` with keywords ``kw`` (the oracle's placement): ``n_prompt`` prompt tokens
    (:func:`prompt_tokens`), their greedy continuation (``n`` tokens at most) and the last logits; the Llama is closed
    in every case."""
    from hybrimoe.runtime.llama import Llama

    llm = Llama(str(path), **kw)
    try:
        tokens = prompt_tokens(llm, n_prompt)
        return (tokens,) + greedy_with_logits(llm, tokens, n)
    finally:
        llm.close()


def greedy_text(llm, prompt: str, n: int) -> list[int]:
    """Greedy continuation of the text ``prompt`` (BOS first; ``n`` tokens at most, stops at end of generation)."""
    toks = llm.tokenize(prompt.encode(), add_bos=True, special=False)
    return generate_tokens(llm, toks, n, temp=0.0)


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    """Normalised mean squared error ``sum((a - ref)^2) / sum(ref^2)``, in float64 (0 for identical vectors)."""
    a, ref = np.asarray(a, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.sum((a - ref) ** 2) / max(np.sum(ref ** 2), 1e-30))


def run_engine_and_close(llm, n_prompt: int, n_gen: int, control: str = ""):
    """``(prompt tokens, greedy tokens, last logits, moe_stats())`` of one engine run of ``n_prompt`` prompt tokens
    and ``n_gen`` generated ones, optionally with a negative control (``Engine.set_negative_control``); checks that
    no expert stays pinned afterwards, and closes ``llm`` in every case.

    Raises:
        AssertionError: an expert is still pinned after the run.
    """
    try:
        if control:
            llm.moe_engine.set_negative_control(control)
        tokens = prompt_tokens(llm, n_prompt)
        out, lg = greedy_with_logits(llm, tokens, n_gen)
        st = llm.moe_stats()
        pinned = llm.moe_engine.pinned_count()
        if pinned:
            raise AssertionError(f"{pinned} expert(s) still pinned after the run")
    finally:
        llm.close()
    return tokens, out, lg, st


#: a planner cost model under which CPU and GPU are comparable for the tiny fixtures, so that splits are mixed (the
#: hardware files would keep such tiny experts on the CPU); seconds and bytes/s, schema hybrimoe.cost_model/1
SPLIT_COST = {"schema": "hybrimoe.cost_model/1", "cpu_a_s": 4e-4, "cpu_b_s": 4e-5, "cpu_startup_s": 1e-5,
              "gpu_a_s": 1e-4, "gpu_b_s": 1e-6, "h2d_bandwidth_Bps": 2e8, "h2d_latency_s": 2e-5,
              "act_a_s": 5e-5, "act_b_s": 1e-7, "layer_a_s": 1e-4, "layer_b_s": 1e-6, "dense_a_s": 1e-4,
              "dense_b_s": 1e-6}
