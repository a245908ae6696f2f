"""Routing replay from a trace (``--replay-trace``): a synthetic model then sees real activation patterns.

The table feeds ``hybrimoe.Llama(moe_replay=...)`` (llama_set_moe_routing, vendor patch 0002), which works for
upstream's placements and the hybrid engine alike: the token at position p gets trace row ``p % n_rows`` in
every MoE layer. The generated text is then meaningless; speed, cache and copy figures are the point.
"""
from __future__ import annotations

import os
from typing import Optional, Union

import numpy as np

from .trace import RoutingTrace, load_trace


def replay_table(trace: Union[RoutingTrace, str, os.PathLike], model_path: Union[str, os.PathLike], *,
                 prompt: Optional[int] = None, layout: Optional[tuple] = None) -> np.ndarray:
    """The ``moe_replay`` table of a trace for a model: int32 ``[n_rows, n_layer, k]`` (model layers; rows of
    dense layers are 0 and unused), one row per trace token.

    The replay gives the token at position p row ``p % n_rows``, so a table of the whole trace replays a
    single-prompt trace exactly (the prompt's token i is at position i). For a multi-prompt trace, ``prompt=i``
    keeps only prompt i's rows, so that a run of that prompt from an empty context gets its own routing back.
    ``layout=(n_prefill, n_decode)``: for a trace with phases (a recorded one), rows 0..n_prefill-1 come from its
    prefill tokens and the next n_decode rows from its decode tokens (each cycled from its start), so that a
    benchmark's prompt (pp) replays prefill routing and its generated tokens (tg) decode routing; a trace without
    phases, or without tokens of a phase, keeps its rows in order.

    Raises:
        FileNotFoundError / ValueError: unreadable trace (see ``load_trace``); a trace whose MoE layer count,
            expert count or top-k differ from the model's (the message gives both); ``prompt`` out of range; a
            negative ``layout``.
    """
    from .engine import engine_facts

    tr = trace if isinstance(trace, RoutingTrace) else load_trace(trace)
    facts = engine_facts(model_path)
    where = tr.path or "the trace"
    n_moe = len(facts.moe_layers)
    if tr.n_layers != n_moe:
        raise ValueError(f"{where} has {tr.n_layers} MoE layers, the model {os.fspath(model_path)} has {n_moe}: "
                         "make a model with as many MoE layers (hybrimoe make-tiny-model --layers)")
    if tr.num_experts != facts.n_expert:
        raise ValueError(f"{where} routes over {tr.num_experts} experts, the model has {facts.n_expert}")
    if tr.top_k != facts.top_k:
        raise ValueError(f"{where} has top-k {tr.top_k}, the model {facts.top_k}")
    rows = np.arange(tr.n_tokens)
    if prompt is not None:
        if not 0 <= prompt < tr.n_prompts:
            raise ValueError(f"{where} has {tr.n_prompts} prompt(s); prompt {prompt} is out of range")
        rows = rows[int(tr.prompt_offsets[prompt]):int(tr.prompt_offsets[prompt + 1])]
    phases = getattr(tr, "phases", None)
    if layout is not None:
        n_pre, n_dec = (int(v) for v in layout)
        if n_pre < 0 or n_dec < 0:
            raise ValueError(f"layout must be two counts >= 0, got {layout}")
        if phases is not None:
            from .trace import PHASE_DECODE, PHASE_PREFILL

            pre = rows[phases[rows] == PHASE_PREFILL]
            dec = rows[phases[rows] == PHASE_DECODE]
            if len(pre) and len(dec):
                rows = np.concatenate([np.resize(pre, n_pre), np.resize(dec, n_dec)])
    if len(rows) == 0:
        raise ValueError(f"{where}: no rows to replay")
    table = np.zeros((len(rows), facts.n_layer, tr.top_k), dtype=np.int32)
    table[:, facts.moe_layers, :] = tr.expert_ids[rows].astype(np.int32)
    return table
