"""Statistics of routing traces: popularity skew, temporal locality and cross-layer correlation, measured the
same way for recorded and synthetic traces (the knobs of :mod:`hybrimoe.traces.synthetic` are their means).

Statistics (:func:`routing_stats`), per MoE layer and as the means over layers that the knobs are:

- ``skew``: popularity skew, the share of a layer's activations taken by its hottest 25% of experts
  (``ceil(E / 4)`` of them; 0.25 when routing is uniform, up to 1).
- ``overlap``: temporal locality, the mean ``|S_t & S_(t-1)| / k`` of a token's expert set with the previous
  token's in the same layer and prompt, as a lift over chance: ``(o - o0) / (1 - o0)`` where ``o0 = k sum_e f_e^2``
  is what tokens drawn independently from the layer's expert frequencies ``f`` (shares, summing to 1) would give.
  0: no temporal locality beyond popularity; 1: every token repeats the previous token's set.
- ``persistence``: the same lift at lag :data:`PERSIST_LAG` (token t against token t - 16 of the same prompt): how
  slowly locality fades (real routing keeps about a third of its lag-1 lift there; an AR(1) process would not).
- ``cross_layer``: correlation across adjacent layers, how predictable layer l+1's set is from layer l's through the
  best fixed expert mapping: each expert a of layer l is mapped to the expert b of layer l+1 whose co-activations
  with it on the first half of the tokens most exceed independence (``C[a, b] - n_a n_b / T``: the mapping that
  maximises the lift below); on the second half, the share of layer l's routed experts whose mapped expert is
  routed in layer l+1, as a lift over what the same mapping gives for independent layers
  (``k sum_a f_l[a] f_l+1[map a]``). Fitting on one half and scoring on the other keeps noise from passing for
  correlation; with few tokens per expert pair (short traces, many experts, weak correlation) the fitted mapping
  misses some pairs and the value comes out low.

The raw values (``overlap_raw``, ``cross_layer_raw``), their chance levels, the top-10% share, the hottest expert's
share over the uniform one and the temporal lift at longer lags are reported too.
"""
from __future__ import annotations

import math

import numpy as np

from hybrimoe.traces.format import RoutingTrace

#: the temporal lags :func:`routing_stats` reports lifts for (``overlap_by_lag``)
STAT_LAGS = (1, 2, 4, 8, 16, 32)
#: the lag of the ``persistence`` knob (tokens)
PERSIST_LAG = 16


def _freq(ids: np.ndarray, E: int) -> np.ndarray:
    """float64 ``[E]``: each expert's share of the activations of one layer's ids ``[T, k]`` (sums to 1)."""
    return np.bincount(ids.ravel().astype(np.int64), minlength=E) / ids.size


def top_share(f: np.ndarray, frac: float) -> float:
    """The share of the activations taken by the hottest ``frac`` of the experts (frequencies ``f``, summing to 1)."""
    n = max(1, int(math.ceil(frac * f.size)))
    return float(np.sort(f)[::-1][:n].sum())


def intersections(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int ``[T]``: ``|a_t & b_t|`` of id rows ``[T, k]`` that are sets."""
    return (a[:, :, None] == b[:, None, :]).sum(axis=(1, 2))


def lift(raw: float, chance: float) -> float:
    """``raw`` as a lift over ``chance``: ``(raw - chance) / (1 - chance)``, 0 when chance is 1."""
    return (raw - chance) / (1.0 - chance) if chance < 1 else 0.0


def _cross(a: np.ndarray, b: np.ndarray, E: int) -> tuple[float, float, float]:
    """(raw, chance, lift) of adjacent layers' ids ``a``, ``b`` ``[T, k]``: the mapping (each expert of ``a``'s
    layer to the expert of ``b``'s layer active with it most often beyond what independence would give; ties and
    experts never seen to the lower id) is fitted on the first half of the tokens and scored on the second (module
    docstring)."""
    T, k = a.shape
    h = T // 2
    pairs = (a[:h, :, None].astype(np.int64) * E + b[:h, None, :]).ravel()
    co = np.bincount(pairs, minlength=E * E).reshape(E, E).astype(np.float64)
    expected = np.outer(np.bincount(a[:h].ravel().astype(np.int64), minlength=E),
                        np.bincount(b[:h].ravel().astype(np.int64), minlength=E)) / max(1, h)
    mapping = np.argmax(co - expected, axis=1)
    at, bt = a[h:], b[h:]
    raw = float((mapping[at][:, :, None] == bt[:, None, :]).any(axis=2).mean())
    chance = float(k * np.sum(_freq(at, E) * _freq(bt, E)[mapping]))
    return raw, chance, lift(raw, chance)


def routing_stats(trace: RoutingTrace, lags=STAT_LAGS) -> dict:
    """The routing statistics of a trace (module docstring for their definitions).

    Returns a dict: ``skew``, ``overlap``, ``persistence`` (the temporal lift at lag :data:`PERSIST_LAG`; NaN when
    no prompt is that long), ``cross_layer`` (floats: means over MoE layers, the units of :class:`Knobs`);
    ``overlap_raw``, ``cross_layer_raw`` (means of the raw values); ``per_layer``: lists of ``top25_share``,
    ``top10_share``, ``max_over_uniform`` (hottest expert's share x E), ``overlap``, ``overlap_raw``,
    ``overlap_chance`` (one per MoE layer) and ``cross_layer``, ``cross_layer_raw``, ``cross_layer_chance`` (one per
    adjacent pair, ``moe_layers - 1``); ``overlap_by_lag``: {lag: mean lift over layers} for ``lags`` (and
    :data:`PERSIST_LAG`) that some prompt is long enough for; ``n_tokens``, ``n_pairs`` (consecutive token pairs
    within prompts).

    Temporal pairs never cross a prompt boundary. Statistics of short traces are noisy, and the skew is biased up by
    sampling noise (a trace of T tokens has about ``T k / E`` activations per expert).

    Raises:
        ValueError: fewer than 4 tokens, or no two consecutive tokens within a prompt.
    """
    ids = np.asarray(trace.expert_ids)
    T, L, k = ids.shape
    E = int(trace.num_experts)
    if T < 4:
        raise ValueError(f"routing_stats needs at least 4 tokens, the trace has {T}")
    off = np.asarray(trace.prompt_offsets)
    pos = np.arange(T) - np.repeat(off[:-1], np.diff(off))                      # position within its prompt
    lag_rows = {}
    for lag in sorted(set(int(x) for x in lags) | {1, PERSIST_LAG}):
        rows = np.flatnonzero(pos >= lag)                                       # tokens t with t - lag in the prompt
        if rows.size:
            lag_rows[lag] = rows
    if 1 not in lag_rows:
        raise ValueError("routing_stats needs two consecutive tokens within a prompt; every prompt has one token")
    per = {key: [] for key in ("top25_share", "top10_share", "max_over_uniform", "overlap", "overlap_raw",
                               "overlap_chance", "cross_layer", "cross_layer_raw", "cross_layer_chance")}
    by_lag = {lag: [] for lag in lag_rows}
    for layer in range(L):
        x = ids[:, layer]
        f = _freq(x, E)
        per["top25_share"].append(top_share(f, 0.25))
        per["top10_share"].append(top_share(f, 0.10))
        per["max_over_uniform"].append(float(f.max() * E))
        chance = float(k * np.sum(f * f))
        for lag, rows in lag_rows.items():
            o = float(intersections(x[rows], x[rows - lag]).mean()) / k
            by_lag[lag].append(lift(o, chance))
            if lag == 1:
                per["overlap"].append(lift(o, chance))
                per["overlap_raw"].append(o)
                per["overlap_chance"].append(chance)
        if layer > 0:
            raw, ch, cross_lift = _cross(ids[:, layer - 1], x, E)
            per["cross_layer"].append(cross_lift)
            per["cross_layer_raw"].append(raw)
            per["cross_layer_chance"].append(ch)
    def mean(v):
        return float(np.mean(v)) if len(v) else float("nan")

    lag_means = {lag: mean(v) for lag, v in by_lag.items()}
    return {
        "skew": mean(per["top25_share"]), "overlap": mean(per["overlap"]),
        "persistence": lag_means.get(PERSIST_LAG, float("nan")), "cross_layer": mean(per["cross_layer"]),
        "overlap_raw": mean(per["overlap_raw"]), "cross_layer_raw": mean(per["cross_layer_raw"]),
        "per_layer": per, "overlap_by_lag": lag_means, "n_tokens": int(T), "n_pairs": int(lag_rows[1].size),
    }
