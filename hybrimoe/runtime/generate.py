"""The token loop of ``hybrimoe run`` (and of the tests' and scripts' comparisons): greedy or sampled generation on a
:class:`hybrimoe.Llama`, with why it stopped and llama.cpp's own timings, and the default tiny model."""
from __future__ import annotations

import codecs
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hybrimoe._lib import llama_cpp_module
from hybrimoe.envs import cache_dir
from hybrimoe.tiny import make_tiny_model

#: English text the prompts of calibrations and comparisons are cut from (any tokenizer gives a few tokens per word)
FIXED_TEXT = ("Once upon a time there was a little robot who lived in a quiet town by the sea. Every morning it "
              "walked to the harbour, counted the boats and wrote their names in a small blue book. ")


def default_model_path() -> Path:
    """The default model of ``hybrimoe run``: a tiny qwen3moe Q8_0 GGUF in the cache, written on first use.

    Raises:
        OSError: the cache directory cannot be written.
    """
    path = cache_dir() / "models" / "tiny-qwen3moe-q8_0-seed0.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.gguf")
        try:
            make_tiny_model(tmp, "qwen3moe", seed=0, quant="Q8_0")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        print(f"hybrimoe: wrote the default tiny model {path}", file=sys.stderr)
    return path


@dataclass
class Generation:
    """What :func:`generate` produced: ``tokens`` (the generated ids), ``stop`` (``"eog"``: an end-of-generation
    token; ``"length"``: ``n_predict`` reached; ``"context"``: the context is full), and llama.cpp's timings of the
    run (``llama_perf_context``): prompt tokens evaluated and seconds, single-token decodes and seconds."""

    tokens: list = field(default_factory=list)
    stop: str = "length"
    n_prompt_eval: int = 0
    prompt_s: float = 0.0
    n_decode: int = 0
    decode_s: float = 0.0


def generate(llm, prompt_tokens: list[int], n_predict: int, *, temp: float = 0.0, top_k: int = 40,
             top_p: float = 0.95, stream=None) -> Generation:
    """Generates up to ``n_predict`` tokens after ``prompt_tokens``; stops at end-of-generation tokens and at the
    end of the context (llama-cpp-python would fail to find a KV slot).

    With ``stream`` (a text file), writes each token's text as it comes (UTF-8 decoded incrementally). Sampling as
    llama-cpp-python's ``Llama.generate`` (temp 0: greedy).
    """
    lc = llama_cpp_module().llama_cpp
    vocab = lc.llama_model_get_vocab(llm.model)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = Generation()
    room = llm.n_ctx() - len(prompt_tokens)
    limit = min(n_predict, room)
    if limit <= 0:
        out.stop = "context" if n_predict > 0 else "length"
        return out
    lc.llama_perf_context_reset(llm.ctx)
    for tok in llm.generate(prompt_tokens, temp=temp, top_k=top_k, top_p=top_p, reset=True):
        if lc.llama_vocab_is_eog(vocab, tok):
            out.stop = "eog"
            break
        out.tokens.append(int(tok))
        if stream is not None:
            piece = llm.detokenize([tok], prev_tokens=prompt_tokens + out.tokens[:-1])
            stream.write(decoder.decode(piece))
            stream.flush()
        if len(out.tokens) >= limit:
            out.stop = "length" if limit == n_predict else "context"
            break
    if stream is not None:
        stream.write(decoder.decode(b"", final=True))
    lc.llama_synchronize(llm.ctx)  # llama.cpp adds a decode to its timings once its compute has ended
    perf = lc.llama_perf_context(llm.ctx)
    out.n_prompt_eval, out.prompt_s = int(perf.n_p_eval), float(perf.t_p_eval_ms) * 1e-3
    out.n_decode, out.decode_s = int(perf.n_eval), float(perf.t_eval_ms) * 1e-3
    return out


def generate_tokens(llm, prompt_tokens: list[int], n_predict: int, *, temp: float = 0.0, top_k: int = 40,
                    top_p: float = 0.95, stream=None) -> list[int]:
    """The generated token ids of :func:`generate` (same arguments)."""
    return generate(llm, prompt_tokens, n_predict, temp=temp, top_k=top_k, top_p=top_p, stream=stream).tokens
