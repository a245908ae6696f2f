"""Profiles of expert frequencies: how often each (MoE layer, expert) was routed, counted once here for the
simulator's profiling prompts and the engine's ``moe_profile`` alike, and the hot-first order caches are filled in."""
from __future__ import annotations

import numpy as np


def expert_counts(expert_ids, n_experts: int) -> np.ndarray:
    """Activations per (MoE layer, expert): float64 ``[moe_layers, n_experts]`` from routed ids ``[tokens,
    moe_layers, top_k]`` (every id in ``0..n_experts-1``; a token routes to each listed expert once).

    Raises:
        ValueError: ``expert_ids`` is not three-dimensional, or holds an id outside ``0..n_experts-1``.
    """
    ids = np.asarray(expert_ids)
    if ids.ndim != 3:
        raise ValueError(f"expert ids must have shape [tokens, moe_layers, top_k], got {ids.shape}")
    E, L = int(n_experts), ids.shape[1]
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= E):
        raise ValueError(f"expert ids outside 0..{E - 1}")
    flat = (ids + (np.arange(L) * E)[None, :, None]).ravel()
    return np.bincount(flat, minlength=L * E).astype(np.float64).reshape(L, E)


def hot_keys_from_counts(counts) -> list[int]:
    """Keys ``layer * n_experts + expert``, hottest first, of a profile: ``counts`` ``[moe_layers, experts]`` (or
    flat), activations per (MoE layer, expert). Ties (equal counts, zeros included) go to the lower key. This is
    the order both the simulator (its profiling prompts) and the engine (``moe_profile``) fill caches in."""
    c = np.asarray(counts, dtype=np.float64).ravel()
    return [int(k) for k in np.lexsort((np.arange(c.size), -c))]
