"""Concurrent decode streams in one batch (continuous batching, as llama-server's ``-np N`` decodes its slots): the
routing of N requests decoding at once, as the engine sees it.

Each step decodes one token of every active stream in one ubatch, so the engine plans the union of their experts
once, and an expert copied to the GPU serves every stream that routes to it. :func:`streams_trace` turns a trace's
prompts into such steps: N streams take the prompts in order; a stream whose prompt ended takes the next one at the
next step (a request joins when a slot frees); the last steps have fewer streams. The simulator then runs each step
as one ubatch (its ``prefill`` mechanics with an ubatch of N): the mean step time is the time per output token of
each stream (TPOT), and tokens over the total time is the aggregate decode rate.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from hybrimoe.traces.format import PHASE_DECODE, RoutingTrace


def decode_tokens(trace: RoutingTrace, what: str) -> RoutingTrace:
    """The decode-phase tokens of ``trace`` when it has phases, else the trace itself.

    Raises:
        ValueError: phases without a decode token (the message says what they were wanted ``to``: ``what``).
    """
    if trace.phases is None:
        return trace
    keep = np.asarray(trace.phases) == PHASE_DECODE
    if not keep.any():
        raise ValueError(f"{trace.path or 'the trace'} has no decode-phase tokens to {what}")
    return trace.select_tokens(keep)


def streams_trace(trace: RoutingTrace, n_streams: int) -> RoutingTrace:
    """The decode tokens of ``trace`` (its decode-phase tokens when it has phases, else all) regrouped into steps of
    ``n_streams`` concurrent streams: a trace whose "prompts" are the steps, tokens of one step consecutive (one per
    active stream, in stream order), phases left out. With one stream it is the decode tokens in order, one token a
    step.

    Raises:
        ValueError: ``n_streams`` < 1, or no decode tokens.
    """
    if isinstance(n_streams, bool) or not isinstance(n_streams, int) or n_streams < 1:
        raise ValueError(f"streams must be an integer >= 1, got {n_streams!r}")
    trace = decode_tokens(trace, "decode in streams")
    offs = np.asarray(trace.prompt_offsets, dtype=np.int64)
    queue = [(int(a), int(b)) for a, b in zip(offs[:-1], offs[1:]) if b > a]
    if not queue:
        raise ValueError(f"{trace.path or 'the trace'} has no tokens")
    queue.reverse()  # pop() takes the next prompt
    slots: list = [None] * n_streams  # per stream: [next token, end] of its prompt
    order: list = []
    steps = [0]
    while True:
        for s in range(n_streams):
            if slots[s] is None and queue:
                a, b = queue.pop()
                slots[s] = [a, b]
        active = [s for s in range(n_streams) if slots[s] is not None]
        if not active:
            break
        for s in active:
            order.append(slots[s][0])
            slots[s][0] += 1
            if slots[s][0] >= slots[s][1]:
                slots[s] = None  # the request ended: its slot takes the next prompt at the next step
        steps.append(len(order))
    idx = np.asarray(order, dtype=np.int64)
    return replace(trace, expert_ids=trace.expert_ids[idx], prompt_offsets=np.asarray(steps, dtype=np.int64),
                   router_scores=None if trace.router_scores is None else trace.router_scores[idx], phases=None)
