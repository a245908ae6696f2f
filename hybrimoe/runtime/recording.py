"""Recording a model's own routing into a trace (:mod:`hybrimoe.traces.format`), what ``hybrimoe trace`` runs.

The model runs as ``hybrimoe run`` would run it (any placement: ``-ngl``, ``-ot``, ``--n-cpu-moe``, ``--rpc``,
``--moe-cache``), prompt after prompt. For every token and MoE layer it records the routed expert ids and the
router's scores over all experts as llama.cpp computed them (llama.cpp's eval callback reads the nodes
``ffn_moe_topk`` and ``ffn_moe_probs`` of llm_graph_context::build_moe_ffn: scores after the gating function,
before any selection bias; :class:`hybrimoe._engine.RoutingRecorder`), the phase of the token (the prompt's tokens
are prefill, each generated token's step is decode), the prompt offsets, and the model facts read from the GGUF.

Prompts: ``-p TEXT`` (repeatable), ``-f FILE`` (repeatable): a ``.jsonl`` file holds one JSON value per line, a
string (the prompt) or an object with ``"prompt"`` (a string) or ``"messages"`` (a chat, ``[{"role", "content"}]``);
any other file holds one prompt per non-empty line. ``--chat`` applies the model's chat template
(``tokenizer.chat_template``) to plain prompts as one user message; ``"messages"`` always use it.

Every prompt starts from an empty context. Its tokens are evaluated with every token's output computed
(llama.cpp otherwise drops the tokens without an output before the last layer's FFN, which would leave that layer
unrecorded); then ``-n`` tokens are generated one step at a time (stopping at an end-of-generation token or the
context's end) with the sampling flags (greedy with ``--temp 0``).

The file is written atomically (a temporary file beside it, then renamed); an existing ``-o`` file is kept
unless ``--force``. Ctrl-C stops the recording: the tokens recorded so far are written, flagged ``partial``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from hybrimoe._lib import llama_cpp_module
from hybrimoe.model.facts import facts_from_gguf, selection_bias_from_gguf
from hybrimoe.runtime.engine_facts import engine_facts
from hybrimoe.traces.format import PHASE_DECODE, PHASE_PREFILL, RoutingTrace

#: a prompt: text, or a chat (a list of {"role", "content"} messages)
Prompt = Union[str, list]


def read_prompts(texts: Sequence[str], files: Sequence[str]) -> list:
    """The prompts of ``-p`` texts and ``-f`` files, in that order (see the module docstring for the formats).

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file is not UTF-8 text, a ``.jsonl`` line is not valid JSON or not a string / an object with
            ``prompt`` or ``messages``, a prompt is empty, or there is no prompt at all.
    """
    out: list = []
    for t in texts:
        if not t:
            raise ValueError("-p: the prompt is empty")
        out.append(t)
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise FileNotFoundError(f"-f {p}: no such file")
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise ValueError(f"-f {p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if p.suffix.lower() == ".jsonl":
            for no, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    v = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"-f {p}:{no}: not valid JSON ({e.msg})") from None
                out.append(_jsonl_prompt(v, f"-f {p}:{no}"))
        else:
            out.extend(line for line in lines if line.strip())
    if not out:
        raise ValueError("no prompt: give -p TEXT or -f FILE (a file with at least one non-empty line)")
    return out


def _jsonl_prompt(v, where: str) -> Prompt:
    if isinstance(v, str) and v:
        return v
    if isinstance(v, dict):
        if isinstance(v.get("prompt"), str) and v["prompt"]:
            return v["prompt"]
        msgs = v.get("messages")
        if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                   and isinstance(m.get("content"), str) for m in msgs):
            return msgs
    raise ValueError(f"{where}: expected a non-empty string, {{\"prompt\": TEXT}} or {{\"messages\": [{{\"role\", "
                     "\"content\"}, ...]}")


def prompt_tokens(llm, prompt: Prompt, chat: bool) -> list[int]:
    """Token ids of one prompt: plain text tokenized with a BOS (as ``hybrimoe run``), or, for a chat (or any
    prompt with ``chat``), the model's chat template applied (llama-cpp-python's ``Jinja2ChatFormatter``).

    Raises:
        ValueError: a chat prompt for a model without ``tokenizer.chat_template``; the prompt has no tokens.
    """
    if isinstance(prompt, list) or chat:
        llama_chat_format = llama_cpp_module().llama_chat_format  # llama_cpp loaded on hybrimoe's libllama
        template = llm.metadata.get("tokenizer.chat_template")
        if not template:
            if isinstance(prompt, list):
                raise ValueError("a chat prompt ({\"messages\": ...}) needs the model's chat template, and the "
                                 "model has none (tokenizer.chat_template): give it as plain text")
            raise ValueError("the model has no chat template (tokenizer.chat_template): drop --chat and give "
                             "plain prompts")
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        vocab_text = llm.detokenize
        bos = vocab_text([llm.token_bos()]).decode("utf-8", errors="replace") if llm.token_bos() >= 0 else ""
        eos = vocab_text([llm.token_eos()]).decode("utf-8", errors="replace") if llm.token_eos() >= 0 else ""
        fmt = llama_chat_format.Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        res = fmt(messages=msgs)
        toks = llm.tokenize(res.prompt.encode(), add_bos=not res.added_special, special=True)
    else:
        toks = llm.tokenize(prompt.encode(), add_bos=True, special=False)
    if not toks:
        raise ValueError("the prompt has no tokens")
    return toks


@dataclass
class _Rows:
    """Recorded rows so far: per evaluated chunk, ids [n, L, k] int16, scores [n, L, E] float16, phase."""

    ids: list = field(default_factory=list)
    scores: list = field(default_factory=list)
    phases: list = field(default_factory=list)
    offsets: list = field(default_factory=lambda: [0])
    n: int = 0

    def add(self, ids: np.ndarray, scores: np.ndarray, phase: int) -> None:
        self.ids.append(ids)
        self.scores.append(scores)
        self.phases.append(np.full(len(ids), phase, dtype=np.int8))
        self.n += len(ids)

    def end_prompt(self) -> None:
        if self.n > self.offsets[-1]:
            self.offsets.append(self.n)


class Recorder:
    """Drives a :class:`hybrimoe.Llama` made with ``record_routing=True`` over prompts and collects its routing.

    Args:
        llm: the Llama (any placement).
        on_token: called with the number of tokens just recorded (progress), or None.
        on_prompt: called once a prompt is done (recorded, failed or interrupted), or None.

    Raises:
        ValueError: the Llama was not made with ``record_routing=True``, or its model has no MoE layer.
    """

    def __init__(self, llm, on_token=None, on_prompt=None):
        if llm.moe_recorder is None:
            raise ValueError("the Llama records nothing: make it with record_routing=True")
        self.llm = llm
        self.facts = engine_facts(llm.model_path)
        if not self.facts.moe_layers:
            raise ValueError(f"{llm.model_path}: the model has no MoE layer")
        self.rows = _Rows()
        self.on_token = on_token
        self.on_prompt = on_prompt
        self.interrupted = False
        self.stopped_at: Optional[str] = None

    def _collect(self, n: int, phase: int) -> None:
        """Takes the recorder's rows of the last evaluation of ``n`` tokens; every MoE layer must have them all."""
        got = self.llm.moe_recorder.take()
        err = self.llm.moe_recorder.error
        L, k, E = len(self.facts.moe_layers), self.facts.top_k, self.facts.n_expert
        ids = np.empty((n, L, k), dtype=np.int16)
        scores = np.empty((n, L, E), dtype=np.float16)
        for j, il in enumerate(self.facts.moe_layers):
            if il not in got:
                raise RuntimeError(f"MoE layer {il} recorded nothing for {n} token(s)"
                                   + (f" ({err})" if err else " (no ffn_moe_topk / ffn_moe_probs node: an "
                                                              "architecture whose router llama.cpp builds "
                                                              "otherwise)"))
            li, ls = got[il]
            if li.shape != (n, k) or ls.shape != (n, E):
                raise RuntimeError(f"MoE layer {il} recorded ids {li.shape} and scores {ls.shape} for {n} token(s); "
                                   f"expected ({n}, {k}) and ({n}, {E})" + (f" ({err})" if err else ""))
            ids[:, j, :] = li
            scores[:, j, :] = ls
        self.rows.add(ids, scores, phase)
        if self.on_token is not None:
            self.on_token(n)

    def record(self, prompts: Sequence[Prompt], n_predict: int, *, chat: bool = False, temp: float = 0.0,
               top_k: int = 40, top_p: float = 0.95) -> None:
        """Records every prompt (prefill) and ``n_predict`` generated tokens after each (decode).

        Every prompt is tokenized and checked first. Ctrl-C (KeyboardInterrupt) stops it, keeping every evaluation
        that completed (``interrupted`` is then True); any other error propagates after the rows so far are kept.

        Raises:
            ValueError: before any decode: a prompt does not fit the context (the message names it), or see
                :func:`prompt_tokens`.
            RuntimeError: a layer's routing was not recorded, or a decode failed.
        """
        lc = llama_cpp_module().llama_cpp
        llm = self.llm
        vocab = lc.llama_model_get_vocab(llm.model)
        rec = llm.moe_recorder
        n_ctx = llm.n_ctx()
        # every prompt tokenized and checked before the first decode: a bad one fails the run before it starts
        all_toks = []
        for i, prompt in enumerate(prompts):
            try:
                toks = prompt_tokens(llm, prompt, chat)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            if len(toks) >= n_ctx:
                raise ValueError(f"prompt {i} has {len(toks)} tokens, the context holds {n_ctx} (-c)")
            all_toks.append(toks)
        try:
            for toks in all_toks:
                llm.reset()
                rec.take()  # nothing left from an interrupted or failed evaluation
                rec.enabled = True
                try:
                    llm.eval(toks, logits_all=True)
                    self._collect(len(toks), PHASE_PREFILL)
                    for _ in range(min(n_predict, n_ctx - len(toks))):
                        tok = llm.sample(temp=temp, top_k=top_k, top_p=top_p)
                        if lc.llama_vocab_is_eog(vocab, tok):
                            break
                        llm.eval([tok])
                        self._collect(1, PHASE_DECODE)
                finally:
                    rec.enabled = False
                    self.rows.end_prompt()
                    if self.on_prompt is not None:
                        self.on_prompt()
        except KeyboardInterrupt:
            self.interrupted = True
            rec.take()

    def trace(self, model_path=None):
        """The :class:`hybrimoe.traces.format.RoutingTrace` of everything recorded (``partial`` when interrupted), with
        the
        model facts, expert bytes per layer, gating function and selection bias read from the GGUF.

        Raises:
            ValueError: nothing was recorded.
        """
        if self.rows.n == 0:
            raise ValueError("nothing was recorded")
        path = model_path or self.llm.model_path
        facts = facts_from_gguf(path)
        return RoutingTrace(
            expert_ids=np.concatenate(self.rows.ids), prompt_offsets=np.asarray(self.rows.offsets, dtype=np.int64),
            num_experts=self.facts.n_expert, top_k=self.facts.top_k,
            expert_bytes=np.asarray(facts.layer_expert_bytes, dtype=np.float64),
            n_dense_layers=facts.n_dense_layers, moe_layer_ids=np.asarray(self.facts.moe_layers, dtype=np.int64),
            router_scores=np.concatenate(self.rows.scores).astype(np.float32), model=facts.name,
            phases=np.concatenate(self.rows.phases), gating=facts.gating,
            selection_bias=selection_bias_from_gguf(path), partial=self.interrupted, facts=facts)
