"""Several prompts generated together: continuous batching over the sequences of one llama context.

llama-server decodes all its slots (``-np N``) in one batch per step; llama-cpp-python's ``create_completion``
decodes one sequence. :class:`BatchGenerator` does what llama-server does, from Python: each request gets a slot (a
sequence id of the context, up to ``n_seq_max``); every step is one ``llama_decode`` that carries the next token of
each slot that is generating and, within ``n_batch`` tokens, chunks of the prompts of the slots that are
prefilling; a request waiting for a slot takes the first one that frees, and a finished request's KV cells are
removed at once (``llama_memory_seq_rm``). For an offloaded MoE model that is the point: in one batch an expert
copied to the GPU or read from disk once serves every sequence that routes to it.

The KV cache is llama.cpp's, as the context was made: with llama.cpp's default (not unified) each sequence has
``n_ctx / n_seq_max`` cells (``llama_n_ctx_seq``), as llama-server splits its context between slots.

Sampling is a llama.cpp sampler chain per request, with that request's parameters, in llama-cpp-python's order
(``Llama._init_sampler``: penalties, then greedy at temperature 0, else top-k, typical, top-p, min-p, temperature and
the seeded draw; a logit bias after the penalties), sampling from its sequence's row of the batch's logits
(``llama_sampler_sample``). The results are
llama-cpp-python's completion objects.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from hybrimoe._lib import llama_cpp_module

#: create_completion's sampling keywords and defaults (llama-cpp-python's), each a value for every prompt or a list
#: with one per prompt
SAMPLING_DEFAULTS = dict(max_tokens=16, temperature=0.8, top_p=0.95, min_p=0.05, typical_p=1.0, stop=None,
                         frequency_penalty=0.0, presence_penalty=0.0, repeat_penalty=1.0, top_k=40, seed=None,
                         logit_bias=None)


@dataclass
class _Request:
    index: int
    prompt: list
    params: dict
    slot: int = -1
    fed: int = 0                     # prompt tokens decoded so far
    out: list = field(default_factory=list)
    text: bytes = b""
    finish: Optional[str] = None
    sampler: object = None
    row: int = -1                    # its logits' row in the batch just decoded (-1: none)
    logits: list = field(default_factory=list)
    times: list = field(default_factory=list)


class BatchGenerator:
    """Generates for several prompts in one batch per step (continuous batching) on a :class:`hybrimoe.Llama` whose
    context holds several sequences (``Llama(..., n_seq_max=N)``, llama-server's ``-np N``).

    ``run`` admits up to ``n_seq_max`` requests at once; the others wait for a slot. Every step is one decode: the
    next token of each generating request, then prompt tokens of the prefilling ones, oldest first, up to
    ``n_batch`` tokens in all. The single-sequence state of ``llm`` (llama-cpp-python's prompt cache) is reset
    before and after, so ``create_completion`` afterwards starts from an empty context.

    Raises (``run``): ValueError for no prompts, an empty prompt, a list of per-prompt values of the wrong length,
    an unknown keyword, or a prompt that with its ``max_tokens`` does not fit one sequence's context
    (``llama_n_ctx_seq``); RuntimeError when a decode fails (as ``Llama.eval``).
    """

    def __init__(self, llm, *, record_logits: bool = False, logit_bias: Optional[dict] = None):
        self.llm = llm
        #: a logit bias (token id -> added logit) for every request without one of its own
        self.logit_bias = logit_bias
        self.record_logits = bool(record_logits)
        #: per request of the last run: its generated token ids (the end-of-generation token not included)
        self.tokens: list[list[int]] = []
        #: per request of the last run, with ``record_logits``: the logits (float32 ``[n_vocab]`` copies) each of
        #: its tokens was sampled from, in order
        self.logits: list[list] = []
        #: per request of the last run: when each of its tokens was sampled (``time.perf_counter()`` seconds)
        self.token_times: list[list[float]] = []
        self._lc = llama_cpp_module().llama_cpp
        self.n_slots = int(self._lc.llama_n_seq_max(llm.ctx))
        self.n_ctx_seq = int(self._lc.llama_n_ctx_seq(llm.ctx))
        self.n_batch = int(llm.n_batch)
        #: tokens in each decode of the last run, in order (prompt chunks and generated tokens together)
        self.batch_sizes: list[int] = []
        #: sequences in each decode of the last run (at most n_slots)
        self.batch_sequences: list[int] = []

    def _requests(self, prompts, kw) -> list[_Request]:
        unknown = set(kw) - set(SAMPLING_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown keyword(s) {', '.join(sorted(unknown))} (known: {', '.join(SAMPLING_DEFAULTS)})")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of prompts (strings or token lists)")
        n = len(prompts)
        per = {}
        for k, default in SAMPLING_DEFAULTS.items():
            v = kw.get(k, default)
            if isinstance(v, list) and not (k == "stop" and all(isinstance(x, str) for x in v)):
                if len(v) != n:
                    raise ValueError(f"{k}: {len(v)} values for {n} prompts")
                per[k] = v
            else:
                per[k] = [v] * n
        reqs = []
        for i, p in enumerate(prompts):
            if isinstance(p, (str, bytes)):
                text = p.encode() if isinstance(p, str) else p
                toks = self.llm.tokenize(text, add_bos=True, special=True) if text else []
            else:
                toks = [int(t) for t in p]
            if not toks:
                raise ValueError(f"prompt {i} is empty: give at least one character or token")
            params = {k: per[k][i] for k in SAMPLING_DEFAULTS}
            mt = params["max_tokens"]
            if mt is None or mt <= 0:
                params["max_tokens"] = self.n_ctx_seq - len(toks)
            if len(toks) + params["max_tokens"] > self.n_ctx_seq:
                raise ValueError(f"prompt {i}: {len(toks)} tokens + max_tokens {params['max_tokens']} exceed the "
                                 f"{self.n_ctx_seq} tokens of one sequence's context (n_ctx {self.llm.n_ctx()} over "
                                 f"n_seq_max {self.n_slots})")
            stop = params["stop"]
            params["stop"] = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
            reqs.append(_Request(i, toks, params))
        return reqs

    def _sampler(self, params: dict):
        """The request's sampler chain, in llama-cpp-python's order (``Llama._init_sampler``: penalties, then greedy
        at temperature 0, else top-k, typical, top-p, min-p, temperature and the seeded draw), with its logit bias
        after the penalties."""
        from llama_cpp._internals import LlamaSampler

        llm = self.llm
        seed = llm._seed if params["seed"] is None else int(params["seed"])
        s = LlamaSampler()
        s.add_penalties(n_vocab=llm.n_vocab(), penalty_last_n=llm.last_n_tokens_size,
                        penalty_repeat=params["repeat_penalty"], penalty_freq=params["frequency_penalty"],
                        penalty_present=params["presence_penalty"])
        bias = params["logit_bias"] if params["logit_bias"] is not None else self.logit_bias
        if bias:
            s.add_logit_bias(llm.n_vocab(), {int(t): float(b) for t, b in bias.items()})
        temp = params["temperature"]
        if temp < 0.0:
            s.add_dist(seed)
        elif temp == 0.0:
            s.add_greedy()
        else:
            s.add_top_k(params["top_k"])
            s.add_typical(params["typical_p"], 1)
            s.add_top_p(params["top_p"], 1)
            s.add_min_p(params["min_p"], 1)
            s.add_temp(temp)
            s.add_dist(seed)
        return s

    def _clear(self) -> None:
        self.llm.reset()
        mem = self._lc.llama_get_memory(self.llm.ctx)
        if mem:
            self._lc.llama_memory_clear(mem, True)

    def run(self, prompts, **kw) -> list[dict]:
        """Completions of ``prompts`` (strings, tokenized with BOS as ``create_completion`` does, or token lists), in
        order, as llama-cpp-python's ``create_completion`` returns them (``text_completion`` objects with one choice
        and ``usage``). Keywords: :data:`SAMPLING_DEFAULTS`, each one value or a list of one per prompt. Raises as
        the class says."""
        lc, llm = self._lc, self.llm
        reqs = self._requests(prompts, kw)
        waiting = list(reqs)
        active: list[_Request] = []
        free = list(range(self.n_slots))
        self.batch_sizes, self.batch_sequences = [], []
        self._clear()
        mem = lc.llama_get_memory(llm.ctx)
        batch = lc.llama_batch_init(self.n_batch, 0, 1)
        n_vocab = llm.n_vocab()
        try:
            while waiting or active:
                while waiting and free:
                    r = waiting.pop(0)
                    r.slot = free.pop(0)
                    r.sampler = self._sampler(r.params)
                    active.append(r)
                batch.n_tokens = 0

                def put(r, tok, pos, logits):
                    j = batch.n_tokens
                    batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, pos, 1
                    batch.seq_id[j][0] = r.slot
                    batch.logits[j] = logits
                    batch.n_tokens += 1
                    if logits:
                        r.row = j

                for r in active:  # generated tokens first: one each
                    r.row = -1
                    if r.fed == len(r.prompt) and r.out:
                        put(r, r.out[-1], len(r.prompt) + len(r.out) - 1, True)
                for r in active:  # then prompt chunks, in admission order
                    room = self.n_batch - batch.n_tokens
                    if r.fed < len(r.prompt) and room > 0:
                        take = min(room, len(r.prompt) - r.fed)
                        for i in range(take):
                            put(r, r.prompt[r.fed + i], r.fed + i, r.fed + i == len(r.prompt) - 1)
                        r.fed += take
                self.batch_sizes.append(int(batch.n_tokens))
                self.batch_sequences.append(len({int(batch.seq_id[j][0]) for j in range(batch.n_tokens)}))
                llm._decode_batch(batch)
                for r in list(active):
                    if r.row < 0:
                        continue
                    if self.record_logits:
                        row = lc.llama_get_logits_ith(llm.ctx, r.row)
                        r.logits.append(np.ctypeslib.as_array(row, shape=(n_vocab,)).copy())
                    tok = int(r.sampler.sample(llm._ctx, r.row))
                    r.times.append(time.perf_counter())
                    self._advance(r, tok)
                    if r.finish is not None:
                        lc.llama_memory_seq_rm(mem, r.slot, -1, -1)  # its cells, at once
                        r.sampler.close()
                        r.sampler = None
                        free.append(r.slot)
                        free.sort()
                        active.remove(r)
        finally:
            lc.llama_batch_free(batch)
            for r in active:
                if r.sampler is not None:
                    r.sampler.close()
            self._clear()
        self.tokens = [list(r.out) for r in reqs]
        self.logits = [r.logits for r in reqs]
        self.token_times = [r.times for r in reqs]
        return [self._completion(r) for r in reqs]

    def _advance(self, r: _Request, tok: int) -> None:
        lc, llm = self._lc, self.llm
        if lc.llama_vocab_is_eog(llm._model.vocab, tok):
            r.finish = "stop"
            return
        r.out.append(tok)
        r.text = llm.detokenize(r.out, prev_tokens=r.prompt)
        text = r.text.decode("utf-8", errors="ignore")
        cut = [text.find(s) for s in r.params["stop"] if s and s in text]
        if cut:
            r.text = text[:min(cut)].encode()
            r.finish = "stop"
        elif len(r.out) >= r.params["max_tokens"]:
            r.finish = "length"

    def _completion(self, r: _Request) -> dict:
        return {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": self.llm.model_path,
                "choices": [{"text": r.text.decode("utf-8", errors="ignore"), "index": 0, "logprobs": None,
                             "finish_reason": r.finish}],
                "usage": {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.out),
                          "total_tokens": len(r.prompt) + len(r.out)}}


def create_completions(llm, prompts: Sequence[Union[str, list]], **kw) -> list[dict]:
    """:meth:`BatchGenerator.run` on ``llm`` (see :meth:`hybrimoe.Llama.create_completions`)."""
    return BatchGenerator(llm).run(prompts, **kw)
