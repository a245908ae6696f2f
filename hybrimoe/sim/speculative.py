"""Speculative decoding: draft-and-verify steps, as the engine sees them.

A drafter (a small draft model, or the model's own multi-token-prediction head) proposes ``draft`` tokens after the
last accepted one; the target model verifies all of them in one ubatch of ``draft + 1`` rows (the last accepted token
and the drafts), keeps the drafts up to the first one it disagrees with, and adds one token of its own (the correction,
or the bonus token when every draft was accepted). Each step therefore emits between 1 and ``draft + 1`` tokens while
the MoE layers plan the union of ``draft + 1`` tokens' experts once: an expert copied to the GPU serves every row that
routes to it (Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", ICML 2023, §2-3, for the
verification rule; the expected tokens per step with a per-token acceptance rate a is (1 - a^(k+1)) / (1 - a), their
eq. 1).

:func:`speculative_trace` turns a trace's decode tokens into such steps: a trace whose "prompts" are the verification
batches (each up to ``draft + 1`` consecutive tokens of one prompt) and, per step, how many tokens it emits. Each draft
is accepted independently with probability ``acceptance`` (the i.i.d. model of the paper above), drawn from a seeded
generator, or the accepted counts come from a recorded run (a sequence of per-step counts, repeated as needed). The
routing of a draft the target rejects is not known (it is another token than the one the trace holds): its row, and
those of the drafts after it, take the routing of a token drawn at random from the prompt's tokens before it (seeded),
a stand-in with the prompt's routing statistics but no later token's (stated in the records' assumptions). A
step never crosses a prompt's end: the last step of a prompt drafts only the tokens the prompt has left.
"""
from __future__ import annotations

import numbers
from dataclasses import replace
from typing import Optional, Sequence, Union

import numpy as np

from hybrimoe.sim.streams import decode_tokens
from hybrimoe.traces.format import RoutingTrace

#: the most drafted tokens per step taken (a verification ubatch of up to 65 rows)
MAX_DRAFT = 64
#: the assumption the records state about rejected drafts' routing
REJECTED_DRAFTS = ("a rejected draft, and each draft after it, is routed as a token drawn at random from the "
                   "prompt's tokens before it (the real draft token is another one than the trace's, whose routing no "
                   "trace holds)")


def _checked_draft(draft) -> int:
    """``draft`` as an int in ``[1, MAX_DRAFT]``; ValueError otherwise."""
    if isinstance(draft, bool) or not isinstance(draft, (int, np.integer)) or not 1 <= draft <= MAX_DRAFT:
        raise ValueError(f"draft must be an integer in [1, {MAX_DRAFT}] (drafted tokens per step), got {draft!r}")
    return int(draft)


def _accepted_counts(acceptance: Union[float, Sequence[int]], draft: int, seed: int):
    """A callable ``draw(i, m)`` giving step i's accepted drafts of the ``m`` it drafts (m <= draft: the prompt's end
    may leave fewer)."""
    if isinstance(acceptance, numbers.Real) and not isinstance(acceptance, bool):
        a = float(acceptance)
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance must be a probability in [0, 1], got {acceptance!r}")
        rng = np.random.default_rng(seed)

        def draw(_i: int, m: int) -> int:
            # the drafts are accepted in order until the first rejection (i.i.d. per draft)
            ok = rng.random(m) < a
            return int(m if ok.all() else np.argmin(ok))
        return draw
    counts = np.asarray(acceptance)
    if counts.ndim != 1 or counts.size == 0 or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError("acceptance must be a probability or a non-empty sequence of accepted-draft counts per step "
                         f"(integers), got {acceptance!r}")
    if counts.min() < 0 or counts.max() > draft:
        raise ValueError(f"recorded accepted-draft counts must be in [0, draft={draft}], got {int(counts.min())}.."
                         f"{int(counts.max())}")
    return lambda i, m: min(int(counts[i % counts.size]), m)


def speculative_trace(trace: RoutingTrace, draft: int, acceptance: Union[float, Sequence[int]], *,
                      seed: int = 0) -> tuple[RoutingTrace, np.ndarray, np.ndarray]:
    """The decode tokens of ``trace`` (its decode-phase tokens when it has phases, else all) regrouped into
    draft-and-verify steps: ``(steps trace, emitted, step_prompt)``. The steps trace's "prompts" are the
    verification ubatches, tokens of one step consecutive (the last accepted token, then the drafts), phases left
    out; ``emitted[i]`` (int64, one per step) is the tokens step i emits: its accepted drafts plus the target's own
    token. The emitted tokens of every step sum to the decode tokens, and each step starts at the token after the
    last one emitted.
    ``step_prompt[i]`` (int64) is step i's prompt in the decode tokens (the steps of a prompt are consecutive).

    ``draft``: drafted tokens per step (>= 1). ``acceptance``: the probability that the target accepts a draft
    (each draft independently, in order until the first rejection; seeded by ``seed``), or a recorded run's accepted
    drafts per step (integers in ``[0, draft]``, repeated as needed).

    Raises:
        ValueError: ``draft`` < 1, an acceptance outside ``[0, 1]`` or a bad recorded count, or no decode tokens.
    """
    draft = _checked_draft(draft)
    trace = decode_tokens(trace, "draft and verify")
    offs = np.asarray(trace.prompt_offsets, dtype=np.int64)
    if offs[-1] <= 0:
        raise ValueError(f"{trace.path or 'the trace'} has no tokens")
    order, steps, emitted = speculative_steps(offs, draft, acceptance, seed=seed)
    out = replace(trace, expert_ids=trace.expert_ids[order], prompt_offsets=steps,
                  router_scores=None if trace.router_scores is None else trace.router_scores[order], phases=None)
    step_prompt = np.searchsorted(offs, order[steps[:-1]], side="right").astype(np.int64) - 1
    return out, emitted, step_prompt


def speculative_steps(prompt_offsets, draft: int, acceptance: Union[float, Sequence[int]], *,
                      seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The draft-and-verify steps over prompts of the given token offsets (``[n_prompts + 1]``): ``(order,
    step_offsets, emitted)``, all int64: the token index of every verified row, step after step (a step's first
    ``emitted`` rows are its prompt's tokens from the step's position on; its other rows, rejected drafts, tokens of
    the same prompt before them drawn at random); where each step's rows start (``[n_steps + 1]``); and the tokens
    each step emits. A step's prompt is that of its first row.
    Arguments and errors as :func:`speculative_trace`'s."""
    draft = _checked_draft(draft)
    offs = np.asarray(prompt_offsets, dtype=np.int64)
    draw = _accepted_counts(acceptance, draft, seed)
    other = np.random.default_rng([seed, 1])  # the stand-ins of rejected drafts
    order: list = []
    steps = [0]
    emitted: list = []
    i = 0
    for a, b in zip(offs[:-1].tolist(), offs[1:].tolist()):
        p = a
        while p < b:
            rows = min(draft + 1, b - p)      # the last accepted token and the drafts the prompt has room for
            got = draw(i, rows - 1) + 1       # accepted drafts, then the target's own token
            i += 1
            order.extend(range(p, p + got))
            # the rejected draft and the drafts after it are other tokens than the prompt's own there: each
            # verified row takes a token drawn from the prompt's tokens so far (its topic, not a later token's
            # routing: the step's context, up to the last accepted draft)
            order.extend(other.integers(a, p + got, size=rows - got).tolist())
            steps.append(len(order))
            emitted.append(got)
            p += got
    return (np.asarray(order, dtype=np.int64), np.asarray(steps, dtype=np.int64),
            np.asarray(emitted, dtype=np.int64))


def expected_tokens_per_step(draft: int, acceptance: float) -> float:
    """Expected tokens a step emits with i.i.d. acceptance ``acceptance`` and ``draft`` drafts: (1 - a^(k+1)) /
    (1 - a), k + 1 at a = 1 (Leviathan et al., ICML 2023, eq. 1)."""
    a = float(acceptance)
    return float(draft + 1) if a >= 1.0 else (1.0 - a ** (draft + 1)) / (1.0 - a)


def describe(draft: int, acceptance: Union[float, Sequence[int]], draft_cost_s: float) -> str:
    """The records' ``stage_model`` for a speculative run."""
    acc = (f"each draft accepted with probability {float(acceptance):g} until the first rejection"
           if isinstance(acceptance, numbers.Real) else f"accepted drafts per step from a recorded run of "
           f"{len(acceptance)} steps")
    cost = (f"; the drafter costs {draft_cost_s * 1e3:g} ms per drafted token, added to each step"
            if draft_cost_s else "; the drafter's own time is not counted (draft cost 0)")
    return (f"speculative decode: each step verifies the last accepted token and {draft} drafted tokens in one "
            f"ubatch; {acc}; {REJECTED_DRAFTS}{cost} (hybrimoe.sim.speculative)")


def optional_counts(spec: Optional[str]) -> Optional[np.ndarray]:
    """A recorded run's accepted-draft counts from a text or ``.npy`` file (whitespace- or comma-separated
    integers), or None for None.

    Raises:
        ValueError: the file is missing, unreadable or holds no integers.
    """
    if spec is None:
        return None
    try:
        if str(spec).endswith(".npy"):
            arr = np.load(spec)
        else:
            with open(spec, encoding="utf-8") as f:
                arr = np.array([int(x) for x in f.read().replace(",", " ").split()], dtype=np.int64)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read accepted-draft counts from {spec}: {e}") from None
    if arr.size == 0 or arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{spec} must hold a non-empty list of integer accepted-draft counts")
    return arr.astype(np.int64)
