"""Several prompts generated together: continuous batching over the sequences of one llama context.

llama-server decodes all its slots (``-np N``) in one batch per step; llama-cpp-python's ``create_completion``
decodes one sequence. :class:`BatchGenerator` does what llama-server does, from Python: each request gets a slot (a
sequence id of the context, up to ``n_seq_max``); every step is one ``llama_decode`` that carries the next token of
each slot that is generating and, within ``n_batch`` tokens, chunks of the prompts of the slots that are
prefilling; a request waiting for a slot takes the first one that frees, and a finished request's KV cells are
removed at once (``llama_memory_seq_rm``). For an offloaded MoE model that is the point: in one batch an expert
copied to the GPU or read from disk once serves every sequence that routes to it.

The KV cache is llama.cpp's, as the context was made: with llama.cpp's default (not unified) each sequence has
``n_ctx / n_seq_max`` cells (``llama_n_ctx_seq``), as llama-server splits its context between slots; llama.cpp then
splits a step that mixes sequences into ubatches of equal tokens per sequence (``llama_batch_allocr::split_equal``),
so a step holding a prompt chunk and other sequences' tokens runs as several ubatches, each a pass over the expert
weights. With a unified KV cache (``kv_unified=True``, upstream ``-kvu``; ``hybrimoe serve --parallel N``'s
default within the model's training context) a step is cut into ubatches of ``n_ubatch`` tokens in order
(``split_simple``; hybrid and recurrent models' memories split per sequence either way), and each request is held
to ``n_ctx / n_seq_max`` tokens all the same.

Sampling is a llama.cpp sampler chain per request, with that request's parameters, in llama-cpp-python's order
(``Llama._init_sampler``: penalties, the grammar, then greedy at temperature 0, else top-k, typical, top-p, min-p,
temperature and the seeded draw; a logit bias after the penalties), sampling from its sequence's row of the batch's
logits (``llama_sampler_sample``); logprobs come from the same row. The results are llama-cpp-python's completion
objects.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from hybrimoe._lib import llama_cpp_module

#: create_completion's sampling keywords and defaults (llama-cpp-python's), each a value for every prompt or a list
#: with one per prompt
SAMPLING_DEFAULTS = dict(max_tokens=16, temperature=0.8, top_p=0.95, min_p=0.05, typical_p=1.0, stop=None,
                         frequency_penalty=0.0, presence_penalty=0.0, repeat_penalty=1.0, top_k=40, seed=None,
                         logit_bias=None, stopping_criteria=None, grammar=None, logprobs=None)
#: the numeric keywords (checked on the caller's thread: a bad value fails its own request, not a step)
_NUMERIC = ("temperature", "top_p", "min_p", "typical_p", "frequency_penalty", "presence_penalty", "repeat_penalty",
            "top_k")


@dataclass
class _Request:
    index: int
    prompt: list
    params: dict
    source: object = None            # the prompt as given (a string or a token list): logprobs' text offsets
    slot: int = -1
    fed: int = 0                     # prompt tokens decoded so far
    out: list = field(default_factory=list)
    text: bytes = b""
    finish: Optional[str] = None
    sampler: object = None
    row: int = -1                    # its logits' row in the batch just decoded (-1: none)
    sent: int = 0                    # characters of its text handed to its caller (BatchScheduler)
    cancelled: bool = False
    error: Optional[BaseException] = None
    events: object = None            # BatchScheduler: a queue of (text delta, finish reason or None, logprobs)
    logits: list = field(default_factory=list)
    times: list = field(default_factory=list)
    # with logprobs: per generated token, (its log-probability, [(token id, log-probability)] of the top ones)
    lps: list = field(default_factory=list)
    lp_sent: int = 0                 # entries of lps handed to its caller (a stream's logprobs)
    arrived: float = 0.0             # BatchScheduler.submit's time.monotonic()


def checked_grammar(llm, grammar):
    """``grammar`` (a ``llama_cpp.LlamaGrammar`` or GBNF text) as a LlamaGrammar that llama.cpp parses for ``llm``'s
    vocabulary. Raises ValueError for another type or a grammar llama.cpp's parser refuses (it prints where):
    llama-cpp-python would add the parser's NULL sampler to its chain and crash at the first token."""
    from llama_cpp.llama_grammar import LlamaGrammar

    if isinstance(grammar, str):
        grammar = LlamaGrammar.from_string(grammar, verbose=False)
    if not isinstance(grammar, LlamaGrammar):
        raise ValueError(f"grammar must be a llama_cpp.LlamaGrammar or GBNF text, not {type(grammar).__name__}")
    lc = llama_cpp_module().llama_cpp
    smpl = lc.llama_sampler_init_grammar(llm._model.vocab, grammar._grammar.encode("utf-8"),
                                         grammar._root.encode("utf-8"))
    if not smpl:
        raise ValueError("llama.cpp could not parse the grammar (GBNF; its parser printed where)")
    lc.llama_sampler_free(smpl)
    return grammar


def checked_sampling(llm, params: dict) -> dict:
    """``params`` (sampling keywords of ``create_completion``; only those given are checked) with a grammar made a
    :func:`checked_grammar` and logprobs False made None. Raises ValueError for a value llama.cpp's samplers cannot
    take, where llama-cpp-python would raise a ctypes error, crash, or (a logit bias on a token id outside the
    vocabulary) print an IndexError and ignore the bias."""
    out = dict(params)
    mt = out.get("max_tokens")
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int)):
        raise ValueError(f"max_tokens must be an integer or None, got {mt!r}")
    for k in _NUMERIC:
        v = out.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise ValueError(f"{k} must be a number, got {v!r}")
    seed = out.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    bias = out.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise ValueError("logit_bias must map token ids to numbers")
        n_vocab = llm.n_vocab()
        for t, b in bias.items():
            try:
                tok, val = int(t), float(b)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias {t!r}: {b!r} is not a token id and a number") from None
            if not 0 <= tok < n_vocab or val != val:
                raise ValueError(f"logit_bias names token {t!r}; this model's ids are 0..{n_vocab - 1}")
    stop = out.get("stop")
    if stop is not None and not isinstance(stop, (str, list, tuple)):
        raise ValueError("stop must be a string or a list of strings")
    if out.get("grammar") is not None:
        out["grammar"] = checked_grammar(llm, out["grammar"])
    lp = out.get("logprobs")
    if lp is False:
        out["logprobs"] = None
    elif lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp < 0):
        raise ValueError(f"logprobs must be None or a number of top tokens >= 0, got {lp!r}")
    return out


class BatchGenerator:
    """Generates for several prompts in one batch per step (continuous batching) on a :class:`hybrimoe.Llama` whose
    context holds several sequences (``Llama(..., n_seq_max=N)``, llama-server's ``-np N``).

    ``run`` admits up to ``n_seq_max`` requests at once; the others wait for a slot. Every step is one decode: the
    next token of each generating request, then prompt tokens of the prefilling ones, oldest first, up to
    ``n_batch`` tokens in all. The single-sequence state of ``llm`` (llama-cpp-python's prompt cache) is reset
    before and after, so ``create_completion`` afterwards starts from an empty context.

    Raises (``run``): ValueError for no prompts, an empty prompt, a list of per-prompt values of the wrong length,
    an unknown keyword, a value the samplers cannot take (a grammar llama.cpp does not parse, logprobs below 0), or
    a prompt that does not fit one sequence's context (``llama_n_ctx_seq``; as
    ``create_completion``, ``max_tokens`` is cut to what the context leaves); RuntimeError when a decode fails (as
    ``Llama.eval``).
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
        #: one KV cache for every sequence (the context's kv_unified)
        self.kv_unified = bool(getattr(llm.context_params, "kv_unified", False))
        if self.n_slots > 1 and self.n_ctx_seq >= int(llm.n_ctx()):
            # a unified KV cache (kv_unified): every sequence may take any cell, so each request is held to its
            # share, as with separate streams, and the slots together always fit
            self.n_ctx_seq = int(llm.n_ctx()) // self.n_slots
        self.n_batch = int(llm.n_batch)
        if self.n_slots > self.n_batch:
            raise ValueError(f"n_seq_max {self.n_slots} is above n_batch {self.n_batch}: a step must hold one token "
                             "of every sequence")
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
                n_vocab = self.llm.n_vocab()
                if any(not 0 <= t < n_vocab for t in toks):  # llama_decode would fail the whole step
                    raise ValueError(f"prompt {i} holds a token id outside this model's 0..{n_vocab - 1}")
            if not toks:
                raise ValueError(f"prompt {i} is empty: give at least one character or token")
            params = {k: per[k][i] for k in SAMPLING_DEFAULTS}
            self._check(i, params)
            # as create_completion: a prompt must leave room for one token; max_tokens (none or <= 0: the rest of
            # the context) is cut to what the sequence's context leaves
            if len(toks) >= self.n_ctx_seq:
                raise ValueError(f"Requested tokens ({len(toks)}) exceed context window of {self.n_ctx_seq} "
                                 f"(prompt {i}; one sequence's share of n_ctx {self.llm.n_ctx()} over n_seq_max "
                                 f"{self.n_slots})")
            mt = params["max_tokens"]
            room = self.n_ctx_seq - len(toks)
            params["max_tokens"] = room if mt is None or mt <= 0 else min(int(mt), room)
            stop = params["stop"]
            params["stop"] = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
            reqs.append(_Request(i, toks, params, source=p))
        return reqs

    def _check(self, i: int, params: dict) -> None:
        """Raises ValueError, naming the prompt, for a value llama.cpp's samplers cannot take (checked before the
        request is queued: :func:`checked_sampling`); a grammar becomes a checked LlamaGrammar, logprobs False
        None."""
        try:
            params.update(checked_sampling(self.llm, params))
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None

    def _sampler(self, params: dict):
        """The request's sampler chain, in llama-cpp-python's order (``Llama._init_sampler``: penalties, the grammar,
        then greedy at temperature 0, else top-k, typical, top-p, min-p, temperature and the seeded draw), with its
        logit bias after the penalties. A grammar sampler of its own per request: its parse state follows that
        request's tokens only (llama.cpp's ``llama_sampler_sample`` accepts each sampled token into the chain)."""
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
        if params["grammar"] is not None:
            s.add_grammar(llm._model, params["grammar"])
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
        reqs = self._requests(prompts, kw)
        self.open()
        try:
            self.waiting.extend(reqs)
            while self.waiting or self.active:
                self.step()
                if self.failed:
                    raise self.failed[0].error
        finally:
            self.close()
        self.tokens = [list(r.out) for r in reqs]
        self.logits = [r.logits for r in reqs]
        self.token_times = [r.times for r in reqs]
        return [self.completion(r) for r in reqs]

    # ---- the stepping, for run() and for a server's scheduler (BatchScheduler) --------------------------------

    def open(self) -> None:
        """Starts a session of steps: an empty context (and prompt cache), every slot free."""
        lc = self._lc
        self.waiting: list[_Request] = []
        self.active: list[_Request] = []
        self.failed: list[_Request] = []
        self.free = list(range(self.n_slots))
        self.batch_sizes, self.batch_sequences = [], []
        self._clear()
        self._mem = lc.llama_get_memory(self.llm.ctx)
        self._batch = lc.llama_batch_init(self.n_batch, 0, 1)

    def close(self) -> None:
        """Ends the session: the batch freed, the samplers of unfinished requests closed, the context emptied."""
        self._free()
        self._clear()

    def _free(self) -> None:
        # the session's own native objects only (safe on any thread: no shared state)
        if getattr(self, "_batch", None) is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        for r in self.active:
            if r.sampler is not None:
                r.sampler.close()
                r.sampler = None

    def drop(self, r: _Request, why: str) -> None:
        """Takes ``r`` out (finished, or its client gone: ``why`` becomes its finish reason unless it has one):
        its KV cells are removed at once and its slot is free for the next request."""
        if r in self.waiting:
            self.waiting.remove(r)
        if r.finish is None:
            r.finish = why
        if r in self.active:
            self._lc.llama_memory_seq_rm(self._mem, r.slot, -1, -1)
            if r.sampler is not None:
                r.sampler.close()
                r.sampler = None
            self.free.append(r.slot)
            self.free.sort()
            self.active.remove(r)

    def step(self) -> list[_Request]:
        """One decode: admits waiting requests to free slots, then decodes the next token of each generating request
        and prompt chunks of the prefilling ones (up to ``n_batch`` tokens), samples, and drops the requests that
        finished. Returns the requests that got a token. Raises RuntimeError when the decode failed (the requests
        stay: the caller drops them)."""
        lc, llm, batch = self._lc, self.llm, self._batch
        self.failed: list[_Request] = []
        while self.waiting and self.free:
            # the slot first: a concurrent count of waiting requests less free slots never comes out low
            slot = self.free.pop(0)
            r = self.waiting.pop(0)
            try:
                r.sampler = self._sampler(r.params)
            except Exception as e:  # its own failure: the others go on
                self.free.insert(0, slot)
                r.error, r.finish = e, "error"
                self.failed.append(r)
                continue
            r.slot = slot
            self.active.append(r)
        if not self.active:
            return []
        batch.n_tokens = 0

        def put(r, tok, pos, logits):
            j = batch.n_tokens
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, pos, 1
            batch.seq_id[j][0] = r.slot
            batch.logits[j] = logits
            batch.n_tokens += 1
            if logits:
                r.row = j

        for r in self.active:  # generated tokens first: one each
            r.row = -1
            if r.fed == len(r.prompt) and r.out:
                put(r, r.out[-1], len(r.prompt) + len(r.out) - 1, True)
        for r in self.active:  # then prompt chunks, in admission order
            room = self.n_batch - batch.n_tokens
            if r.fed < len(r.prompt) and room > 0:
                take = min(room, len(r.prompt) - r.fed)
                for i in range(take):
                    put(r, r.prompt[r.fed + i], r.fed + i, r.fed + i == len(r.prompt) - 1)
                r.fed += take
        self.batch_sizes.append(int(batch.n_tokens))
        self.batch_sequences.append(len({int(batch.seq_id[j][0]) for j in range(batch.n_tokens)}))
        llm._decode_batch(batch)
        got = []
        for r in list(self.active):
            if r.row < 0:
                continue
            if self.record_logits:
                row = lc.llama_get_logits_ith(llm.ctx, r.row)
                r.logits.append(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).copy())
            tok = int(r.sampler.sample(llm._ctx, r.row))
            r.times.append(time.perf_counter())
            n_top, had = r.params["logprobs"], len(r.out)
            if n_top is not None:
                lp = self._logprobs(r.row, tok, n_top)
            self._advance(r, tok)
            if n_top is not None and len(r.out) > had:  # as create_completion: the generated tokens, not the EOG
                r.lps.append(lp)
            crit = r.params["stopping_criteria"]
            if r.finish is None and crit is not None:
                # llama-cpp-python's StoppingCriteriaList: (the sequence's ids, the logits the token came from)
                row = np.ctypeslib.as_array(lc.llama_get_logits_ith(llm.ctx, r.row), shape=(llm.n_vocab(),))
                if crit(np.asarray(r.prompt + r.out, dtype=np.intc), row):
                    r.finish = "stop"
            got.append(r)
            if r.finish is not None:
                self.drop(r, r.finish)
        return got

    def _logprobs(self, row: int, tok: int, n_top: int):
        """(log-probability of ``tok``, [(id, log-probability)] of the ``n_top`` likeliest) from the logits of batch
        row ``row``, as llama-cpp-python computes them (``Llama.logits_to_logprobs``; ties to the higher id)."""
        from llama_cpp import Llama as _LcpLlama

        n_vocab = self.llm.n_vocab()
        lp = _LcpLlama.logits_to_logprobs(np.ctypeslib.as_array(self._lc.llama_get_logits_ith(self.llm.ctx, row),
                                                                shape=(n_vocab,)))
        top = []
        if n_top:  # the n_top largest (a partition, not a sort of the vocabulary), then in order, ties to the higher id
            part = np.argpartition(-lp, min(n_top, n_vocab) - 1)[:n_top]
            top = part[np.lexsort((-part, -lp[part]))]
        return float(lp[tok]), [(int(i), float(lp[i])) for i in top]

    def _logprobs_object(self, r: _Request, prompt, start: int = 0) -> dict:
        """``r``'s ``logprobs`` as ``create_completion`` gives them without echo: per generated token its text,
        offset (from the end of ``prompt``, its length in characters, or in tokens for a token list, as
        llama-cpp-python counts it), log-probability and a dict of the top ones (its own included); from its
        ``start``-th generated token on (a stream's next chunk: llama-cpp-python streams one token's entry per
        chunk)."""
        llm, toks = self.llm, r.out[: len(r.lps)]
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        bos = llm.token_bos()

        def text(ids, prev=None):
            return llm.detokenize(ids, prev_tokens=prev).decode("utf-8", errors="ignore")

        for idx, (tok, (lp, top)) in enumerate(zip(toks, r.lps)):
            if idx < start or tok == bos:
                continue
            s = text([tok], toks[:idx])
            out["text_offset"].append(len(prompt) + len(text(toks[:idx])))
            out["tokens"].append(s)
            out["token_logprobs"].append(lp)
            d = {text([i], toks[:idx]): v for i, v in top}
            d[s] = lp
            out["top_logprobs"].append(d)
        return out

    def request(self, prompt, **kw) -> _Request:
        """One request (``prompt``: a string or token list; keywords as :meth:`run`'s, one value each), checked as
        ``run`` checks them (ValueError, worded for a single prompt)."""
        try:
            return self._requests([prompt], kw)[0]
        except ValueError as e:  # one request: "prompt 0" names nothing to its caller
            msg = str(e)
            msg = msg.removeprefix("prompt 0: ") if msg.startswith("prompt 0: ") else \
                "the prompt " + msg.removeprefix("prompt 0 ") if msg.startswith("prompt 0 ") else msg
            raise ValueError(msg) from None

    def items(self, r: _Request) -> list:
        """``r``'s stream items after a step (:meth:`BatchScheduler.stream`'s ``(text delta, finish reason or None,
        logprobs or None)``): one per generated token, and the finish on its own once it finished."""
        text = r.text.decode("utf-8", errors="ignore")
        # text that could still be the start of a stop string is held back until it is not (or the request ends)
        hold = 0 if r.finish is not None else max((len(x) - 1 for x in r.params["stop"] if x), default=0)
        delta = text[r.sent:max(r.sent, len(text) - hold)]
        r.sent += len(delta)
        lps = None
        if r.params["logprobs"] is not None and len(r.lps) > r.lp_sent:
            lps = self._logprobs_object(r, r.source, r.lp_sent)
            r.lp_sent = len(r.lps)
        out = []
        # one event per token, as llama-server streams, even when its text is empty (part of a character, or held
        # back for a stop string): a client sees each token's time
        if r.finish is None or delta or lps is not None:
            out.append((delta, None, lps))
        if r.finish is not None:  # the finish on its own, as llama-cpp-python's streams end (an empty text)
            out.append(("", r.finish, None))
        return out

    def stream_alone(self, r: _Request, lock=None, on_step=None):
        """``r`` generated alone, stepped on the caller's thread (no thread of its own): yields its items as
        :meth:`BatchScheduler.stream` does. The context is cleared first (:meth:`open`); ``lock`` is held around
        each step, ``on_step(self)`` called after it. Raises the step's error. A caller that stops early (a client
        gone; the generator closed, or collected later on any thread) leaves the context as it is: only the batch
        and the sampler are freed, which touches no shared state. Its KV cells go at the next :meth:`open`, or at
        llama-cpp-python's next ``eval``, which removes every cell past its ``n_tokens`` (0 after :meth:`open`)."""
        import contextlib

        lock = lock if lock is not None else contextlib.nullcontext()
        with lock:
            self.open()
        done = False
        try:
            self.waiting.append(r)
            while self.waiting or self.active:
                with lock:
                    got = self.step()
                if self.failed:
                    raise self.failed[0].error
                if on_step is not None:
                    on_step(self)
                for x in got:
                    yield from self.items(x)
            done = True
        finally:
            if done:
                with lock:
                    self.close()
            else:
                self._free()

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

    def completion(self, r: _Request, model: Optional[str] = None) -> dict:
        """``r``'s result as llama-cpp-python's ``create_completion`` returns it (``model``: the name to give, else
        the model's path)."""
        lps = None if r.params["logprobs"] is None else self._logprobs_object(r, r.source)
        return {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": model or self.llm.model_path,
                "choices": [{"text": r.text.decode("utf-8", errors="ignore"), "index": 0, "logprobs": lps,
                             "finish_reason": r.finish}],
                "usage": {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.out),
                          "total_tokens": len(r.prompt) + len(r.out)}}


class QueueFull(RuntimeError):
    """A request found the scheduler's queue full (``BatchScheduler(max_waiting=...)``)."""


class BatchScheduler:
    """Continuous batching for concurrent callers (``hybrimoe serve --parallel N``): a thread of its own runs
    :meth:`BatchGenerator.step` while requests are active, and callers on any thread :meth:`submit` requests and
    read them as text deltas (:meth:`stream`) or whole (:meth:`result`). A request joins at the next step and leaves
    when it finishes or its caller :meth:`cancel` s it (its KV cells freed at once).

    ``lock``: held around every step (the served model's decode lock: a shutdown waits for the step); ``on_step``:
    called after every step with the generator (statistics); ``on_change``: called with no argument when requests
    left without a step (cancelled); ``max_waiting``: requests waiting for a slot at most
    (None: no bound), past which :meth:`submit` raises :class:`QueueFull`. The model's single-sequence methods must
    not decode while the scheduler runs (it owns every sequence of the context).

    ``gather_s``, ``gather_max_s``: when a request arrives at an idle scheduler, the first step waits until no other
    has arrived for ``gather_s`` seconds (at most ``gather_max_s`` after the first's arrival, and not once every slot
    has a request), so that requests sent together start in one step. Clients that send at once reach the server a
    few milliseconds apart; without the wait the first prompt is prefilled alone, and a prefill step of a model
    larger than RAM is a read of every expert it does not hold, seconds long, which the others then repeat. 0: no
    wait.
    """

    GATHER_S = 0.01
    GATHER_MAX_S = 0.05
    RECENT_STEPS = 256

    def __init__(self, llm, *, lock=None, on_step=None, on_change=None, max_waiting: Optional[int] = None,
                 gather_s: float = GATHER_S, gather_max_s: float = GATHER_MAX_S):
        import collections
        import threading

        self.gen = BatchGenerator(llm)
        self.max_waiting = max_waiting
        self._lock = lock if lock is not None else threading.Lock()
        self._on_step = on_step
        self._on_change = on_change
        self._cv = threading.Condition()
        self._incoming: list[_Request] = []
        self._stopping = False
        if not (0 <= gather_s <= gather_max_s):
            raise ValueError(f"need 0 <= gather_s <= gather_max_s, got {gather_s!r} and {gather_max_s!r}")
        self._gather_s, self._gather_max_s = float(gather_s), float(gather_max_s)
        #: the last steps run: (tokens, sequences, seconds of the step, sampling included), at most RECENT_STEPS
        self.recent_steps: "collections.deque[tuple[int, int, float]]" = collections.deque(maxlen=self.RECENT_STEPS)
        #: steps run, tokens decoded, and how many steps held each number of sequences
        self.steps = 0
        self.tokens_decoded = 0
        self.sequences_per_step: "collections.Counter[int]" = collections.Counter()
        self.gen.open()
        self._thread = threading.Thread(target=self._loop, name="hybrimoe-batch", daemon=True)
        self._thread.start()

    @property
    def n_slots(self) -> int:
        return self.gen.n_slots

    def state(self) -> dict:
        """Slots and queue now: ``slots`` (n_seq_max), ``active`` (requests holding a slot), ``waiting`` (for a slot:
        not admitted, beyond the free slots), ``steps``,
        ``tokens_decoded``, ``sequences_per_step`` ({sequences: steps}), ``kv_unified`` (one KV cache for all the
        slots), ``recent_steps`` (the last up to :data:`RECENT_STEPS` steps as ``[tokens, sequences, seconds]``,
        oldest first; seconds of the step, sampling included), and ``per_slot``: one dict per slot, by id,
        as llama-server's ``/slots`` reports them: ``id``, ``state`` (``idle``, ``prefilling`` or ``generating``),
        ``n_ctx`` (the slot's context, tokens), ``n_prompt_tokens``, ``n_prompt_tokens_processed`` (decoded so far)
        and ``n_decoded`` (tokens generated) of the request holding it (0 when idle)."""
        with self._cv:
            waiting = max(0, len(self._incoming) + len(self.gen.waiting) - len(self.gen.free))
        per_slot = [{"id": i, "state": "idle", "n_ctx": self.gen.n_ctx_seq, "n_prompt_tokens": 0,
                     "n_prompt_tokens_processed": 0, "n_decoded": 0} for i in range(self.gen.n_slots)]
        for r in list(self.gen.active):  # a copy: the batch thread changes the list between steps
            if 0 <= r.slot < len(per_slot):
                per_slot[r.slot].update(state="prefilling" if r.fed < len(r.prompt) else "generating",
                                        n_prompt_tokens=len(r.prompt), n_prompt_tokens_processed=r.fed,
                                        n_decoded=len(r.out))
        return {"slots": self.gen.n_slots, "kv_unified": self.gen.kv_unified, "active": len(self.gen.active),
                "waiting": waiting, "steps": self.steps,
                "tokens_decoded": self.tokens_decoded,
                "sequences_per_step": dict(sorted(self.sequences_per_step.items())),
                "recent_steps": [[n, q, round(dt, 4)] for n, q, dt in list(self.recent_steps)], "per_slot": per_slot}

    def submit(self, prompt, **kw) -> _Request:
        """Queues one request (``prompt``: a string or token list; keywords as :meth:`BatchGenerator.run`'s, one
        value each). Raises ValueError as ``run`` does, :class:`QueueFull` past ``max_waiting``, RuntimeError once
        closed."""
        import queue

        r = self.gen.request(prompt, **kw)
        r.events = queue.Queue()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the batch scheduler is closed")
            # requests not yet admitted, less the slots free for them: those wait
            waiting = len(self._incoming) + len(self.gen.waiting) - len(self.gen.free)
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise QueueFull(f"{max(waiting, 0)} requests already wait for one of the {self.gen.n_slots} slots "
                                f"(at most {self.max_waiting} may)")
            r.arrived = time.monotonic()
            self._incoming.append(r)
            self._cv.notify()
        return r

    def cancel(self, r: _Request) -> None:
        """Drops ``r`` at the next step (its caller went away): its slot and KV cells are freed."""
        with self._cv:
            r.cancelled = True
            self._cv.notify()

    def stream(self, r: _Request):
        """``r``'s text as it is generated: yields ``(text delta, finish reason or None, logprobs or None)``, one
        item per generated token (its text may be empty: part of a character, or held back for a stop string) and a
        last one with the finish reason; with logprobs asked, an item's are its tokens' (the ``logprobs`` object of
        a streamed ``create_completion`` chunk). Raises the step's error if the decode failed. Closing the generator
        early cancels ``r``."""
        done = False
        try:
            while True:
                item = r.events.get()
                if item is None:
                    done = True
                    if r.error is not None:
                        raise r.error
                    return
                yield item
        finally:
            if not done:
                self.cancel(r)

    def result(self, r: _Request, model: Optional[str] = None) -> dict:
        """``r``'s completion once it finished (as ``create_completion`` returns it)."""
        for _ in self.stream(r):
            pass
        return self.gen.completion(r, model)

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Stops the thread after its step; requests not finished end with an error."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout_s)

    def _deliver(self, r: _Request) -> None:
        for item in self.gen.items(r):
            r.events.put(item)
        if r.finish is not None:
            r.events.put(None)

    def _fail(self, r: _Request, e: BaseException) -> None:
        r.error = e
        self.gen.drop(r, "error")
        r.events.put(None)

    def _loop(self) -> None:
        gen = self.gen
        while True:
            with self._cv:
                idle = not (gen.waiting or gen.active)
                while not (self._stopping or self._incoming or gen.waiting or gen.active):
                    self._cv.wait()
                if idle and self._gather_s > 0 and self._incoming:
                    # requests sent together: one first step (the class's docstring); timed from the arrivals
                    last = self._incoming[0].arrived + self._gather_max_s
                    while not self._stopping and self._incoming and len(self._incoming) < gen.n_slots:
                        left = min(self._incoming[-1].arrived + self._gather_s, last) - time.monotonic()
                        if left <= 0:
                            break
                        self._cv.wait(left)
                if self._stopping:
                    break
            try:
                with self._lock:  # what arrived while the last step ran (or while this waited) joins this one
                    with self._cv:
                        gen.waiting.extend(self._incoming)
                        self._incoming.clear()
                        gone = [r for r in gen.waiting + gen.active if r.cancelled]
                    for r in gone:
                        gen.drop(r, "cancelled")
                        r.events.put(None)
                    if gone and self._on_change is not None:
                        self._on_change()
                    if not (gen.waiting or gen.active):
                        continue
                    try:
                        t0, before = time.perf_counter(), len(gen.batch_sizes)
                        got = gen.step()
                        if len(gen.batch_sizes) > before:  # a decode ran
                            self.recent_steps.append((gen.batch_sizes[-1], gen.batch_sequences[-1],
                                                      time.perf_counter() - t0))
                    except Exception as e:  # the decode failed: every request in it fails with the error
                        for r in list(gen.active):
                            self._fail(r, e)
                        if self._on_change is not None:
                            self._on_change()
                        continue
                for r in gen.failed:
                    r.events.put(None)
                self.steps += 1
                self.tokens_decoded += gen.batch_sizes[-1] if gen.batch_sizes else 0
                self.sequences_per_step[gen.batch_sequences[-1] if gen.batch_sequences else 0] += 1
                if len(gen.batch_sizes) > 4096:  # a long-running server keeps the recent steps only
                    del gen.batch_sizes[:2048], gen.batch_sequences[:2048]
                if self._on_step is not None:  # published before the callers hear: what they read next is current
                    self._on_step(gen)
                for r in got:
                    self._deliver(r)
            except Exception as e:  # a bug here must not leave callers waiting forever
                for r in list(gen.active) + list(gen.waiting):
                    self._fail(r, e)
        with self._cv:
            left = self._incoming + gen.waiting + gen.active
            self._incoming.clear()
        for r in left:
            self._fail(r, RuntimeError("the server is shutting down"))
        with self._lock:
            gen.close()

    def alive(self) -> bool:
        """Whether the scheduler's thread still runs (after :meth:`close`: a step outlasted the wait)."""
        return self._thread.is_alive()
