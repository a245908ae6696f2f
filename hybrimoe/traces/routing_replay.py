"""Routing replay tables (``--replay-trace``, ``Llama(moe_replay=...)``): every MoE layer's expert ids forced from a
trace, so that a synthetic model sees real activation patterns.

The table feeds ``hybrimoe.Llama(moe_replay=...)`` (llama_set_moe_routing, vendor patch 0002), which works for
upstream's placements and the hybrid engine alike: the token at position p gets trace row ``p % n_rows`` in
every MoE layer. The generated text is then meaningless; speed, cache and copy figures are the point.
"""
from __future__ import annotations

import os
from typing import Optional, Union

import numpy as np

from hybrimoe.model.reader import describe
from hybrimoe.traces.format import PHASE_DECODE, PHASE_PREFILL, RoutingTrace, load_trace


def model_routing_shape(model_path: Union[str, os.PathLike]) -> tuple[int, int, int, list]:
    """``(n_layer, n_expert, top_k, moe_layers)`` of a GGUF MoE model, as a routing replay table must match them
    (:func:`hybrimoe.model.reader.describe`: its blocks, experts per MoE layer, ``expert_used_count`` and the blocks
    with routed experts).

    Raises:
        FileNotFoundError, ValueError: as :func:`hybrimoe.model.reader.describe`; not a MoE model.
    """
    d = describe(model_path)
    if not d["has_experts"]:
        raise ValueError(f"{model_path}: not a Mixture-of-Experts model (no ffn_*_exps tensors): nothing to replay")
    return int(d["n_layer"]), int(d["n_expert"]), int(d["n_expert_used"]), list(d["moe_layers"])


def check_routing_replay_table(ids, n_layer: int, n_expert: int, top_k: int, moe_layers=None,
                       name: str = "moe_replay") -> np.ndarray:
    """Checks a routing-replay table against the model it will route and returns it as int32.

    Args:
        ids: ``[n_rows, n_layer, k]`` expert ids (any integer dtype).
        n_layer, n_expert, top_k: the model's layers, routed experts per MoE layer and experts per token
            (``expert_used_count``).
        moe_layers: the model layers that are MoE layers (None: every layer); only their rows are checked for ids
            (the rows of dense layers are unused).
        name: what the table is called in the messages (``moe_replay``, a trace's path).

    Raises:
        ValueError: naming ``name``: a non-integer dtype; a shape other than ``[n_rows >= 1, n_layer, top_k]`` (both
            shapes given); an id outside ``[0, n_expert)``; an id repeated within a row.
    """
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name} must hold integer expert ids, got dtype {ids.dtype}")
    want = f"[n_rows, {n_layer}, {top_k}] (the model's layers and top-k, expert_used_count)"
    if ids.ndim != 3 or ids.shape[0] < 1:
        raise ValueError(f"{name} must have shape {want}, got {ids.shape}")
    if ids.shape[1] != n_layer:
        raise ValueError(f"{name} has shape {ids.shape}: {ids.shape[1]} layers, the model has {n_layer}; it needs "
                         f"{want}")
    if ids.shape[2] != top_k:
        raise ValueError(f"{name} has shape {ids.shape}: {ids.shape[2]} experts per token, the model routes "
                         f"top-{top_k}; it needs {want}")
    moe = ids if moe_layers is None else ids[:, list(moe_layers), :]
    if moe.size and n_expert and (moe.min() < 0 or moe.max() >= n_expert):
        raise ValueError(f"{name} holds expert ids outside [0, {n_expert})")
    s = np.sort(moe, axis=2)
    dup = np.argwhere((s[:, :, 1:] == s[:, :, :-1]).any(axis=2))
    if len(dup):
        row, layer = (int(v) for v in dup[0])
        il = layer if moe_layers is None else int(list(moe_layers)[layer])
        raise ValueError(f"{name} repeats an expert id within a row (row {row}, layer {il}: "
                         f"{moe[row, layer].tolist()}); each token routes to {top_k} different experts")
    return ids.astype(np.int32)


def routing_replay_table(trace: Union[RoutingTrace, str, os.PathLike], model_path: Union[str, os.PathLike], *,
                 prompt: Optional[int] = None, layout: Optional[tuple] = None, scores: bool = False):
    """The ``moe_replay`` table of a trace for a model: int32 ``[n_rows, n_layer, k]`` (model layers; rows of
    dense layers are 0 and unused), one row per trace token.

    The replay gives the token at position p row ``p % n_rows``, so a table of the whole trace replays a
    single-prompt trace exactly (the prompt's token i is at position i). For a multi-prompt trace, ``prompt=i``
    keeps only prompt i's rows, so that a run of that prompt from an empty context gets its own routing back.
    ``layout=(n_prefill, n_decode)``: for a trace with phases (a recorded one), rows 0..n_prefill-1 come from its
    prefill tokens and the next n_decode rows from its decode tokens (each cycled from its start), so that a
    benchmark's prompt (pp) replays prefill routing and its generated tokens (tg) decode routing; a trace without
    phases, or without tokens of a phase, keeps its rows in order.

    ``scores=True`` returns ``(table, scores)``: the same rows' router scores, float32 ``[n_rows, n_layer, E]``
    (``moe_replay_scores``: the engine's cache policies rank by them), or None when the trace has none.

    Raises:
        FileNotFoundError / ValueError: unreadable trace (see :func:`hybrimoe.traces.format.load_trace`); a trace whose
        MoE layer count,
            expert count or top-k differ from the model's (the message gives both); ``prompt`` out of range; a
            negative ``layout``.
    """
    tr = trace if isinstance(trace, RoutingTrace) else load_trace(trace)
    n_layer, n_expert, top_k, moe_layers = model_routing_shape(model_path)
    where = tr.path or "the trace"
    n_moe = len(moe_layers)
    if tr.n_layers != n_moe:
        raise ValueError(f"{where} has {tr.n_layers} MoE layers, the model {os.fspath(model_path)} has {n_moe}: "
                         "make a model with as many MoE layers (hybrimoe make-tiny-model --layers)")
    if tr.num_experts != n_expert:
        raise ValueError(f"{where} routes over {tr.num_experts} experts, the model has {n_expert}")
    if tr.top_k != top_k:
        raise ValueError(f"{where} has top-k {tr.top_k}, the model {top_k}")
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
            pre = rows[phases[rows] == PHASE_PREFILL]
            dec = rows[phases[rows] == PHASE_DECODE]
            if len(pre) and len(dec):
                rows = np.concatenate([np.resize(pre, n_pre), np.resize(dec, n_dec)])
    if len(rows) == 0:
        raise ValueError(f"{where}: no rows to replay")
    table = np.zeros((len(rows), n_layer, tr.top_k), dtype=np.int32)
    table[:, moe_layers, :] = tr.expert_ids[rows].astype(np.int32)
    table = check_routing_replay_table(table, n_layer, n_expert, top_k, moe_layers, where)
    if not scores:
        return table
    if not tr.has_scores:
        return table, None
    sc = np.zeros((len(rows), n_layer, n_expert), dtype=np.float32)
    sc[:, moe_layers, :] = tr.router_scores[rows].astype(np.float32)
    return table, sc
