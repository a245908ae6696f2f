"""Routing replay from a trace (``--replay-trace``): a synthetic model then sees real activation patterns.

The table feeds ``hybrimoe.Llama(moe_replay=...)`` (llama_set_moe_routing, vendor patch 0002), which works for
upstream's placements and the hybrid engine alike: the token at position p gets trace row ``p % n_rows`` in
every MoE layer. The generated text is then meaningless; speed, cache and copy figures are the point.
"""
from __future__ import annotations

import os
from typing import Union

import numpy as np

from .trace import RoutingTrace, load_trace


def replay_table(trace: Union[RoutingTrace, str, os.PathLike], model_path: Union[str, os.PathLike]) -> np.ndarray:
    """The ``moe_replay`` table of a trace for a model: int32 ``[n_rows, n_layer, k]`` (model layers; rows of
    dense layers are 0 and unused), one row per trace token.

    Raises:
        FileNotFoundError / ValueError: unreadable trace (see ``load_trace``); a trace whose MoE layer count,
            expert count or top-k differ from the model's (the message gives both).
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
    table = np.zeros((tr.n_tokens, facts.n_layer, tr.top_k), dtype=np.int32)
    table[:, facts.moe_layers, :] = tr.expert_ids.astype(np.int32)
    return table
