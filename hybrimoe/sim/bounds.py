"""The optimal time of a small instance, by exhaustive search: the yardstick the ``oracle`` bound is checked against.

The simulator's clairvoyant presets (``belady``, ``oracle``) are policies that know the future; nothing says they
are optimal. This module solves small instances exactly under a model that contains every decision the simulator
can make (it is a relaxation of the simulator's rules), so on such an instance no policy can be faster than
:func:`optimal_time`, and ``oracle``'s distance from it says how tight that bound is.

The model (the simulator's truth without noise, contention or extra start-up: ``src/policy/simulator.h``):

- positions ``p`` are (step, MoE layer) in execution order; steps as :func:`hybrimoe._core.make_steps` lists them
  (decode: one token; prefill: one ubatch of a prompt). Position ``p`` starts when ``p - 1`` ends, runs its
  non-expert part (``layer(n)``), then its activated experts ``A_p``, each over its own token count: the ones in
  ``G_p`` on the GPU (``act(n)`` once, then ``gpu(load)`` each, an expert starting once its copy has arrived, in
  order of arrival), the others on the CPU (``cpu_startup_s`` once, then ``cpu(load)`` each); it ends when both do.
- the GPU holds at most ``n_slots`` experts (all experts the same size). Before each position the search picks the
  resident set ``S_p`` (``G_p`` must lie in it); each newly resident expert is copied over the link, one copy
  after another in a chosen order, each starting when the link and the slot it takes are free (a slot is free once
  the layer that used the expert in it has ended: the decision rules pin a layer's experts until its release,
  ``LayerDecider::release``). The set before the first position is free of charge (the simulator's initial fill).

Every simulator run maps onto such a schedule that is no slower: its demand loads, prefetches and fills are copies
issued at the transition before the position they first serve, with the simulator's link order among the orders
searched, and none starts earlier than the simulator lets it; its GPU runs its share in plan order, here in order
of arrival. So the search's optimum is a lower bound on every policy's simulated time under that truth.

The search is depth-first branch and bound over (resident set, copy order, GPU share) per position, with a lower
bound of the time left (each remaining position at its best split with every expert resident for free). Its cost is
exponential: instances of up to ~10 positions, 8 experts in view and 3 slots run in seconds.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from hybrimoe import _core


@dataclass
class Position:
    """One (step, MoE layer): ``n`` tokens, activated experts ``experts`` with ``loads`` tokens each."""

    layer: int
    n: int
    experts: tuple
    loads: tuple


def positions(trace: "_core.Trace", expert_ids, first_prompt: int, end_prompt: int,
              cfg: "_core.SimConfig") -> list[Position]:
    """The positions of a simulator run (:func:`hybrimoe._core.make_steps`' steps x MoE layers), in order.

    ``trace``: the :class:`hybrimoe._core.Trace` of ``expert_ids`` (int ``[n_tokens, n_layers, top_k]``)."""
    ids = np.asarray(expert_ids)
    out = []
    for b, e, _prompt in _core.make_steps(trace, first_prompt, end_prompt, cfg):
        for layer in range(trace.n_layers):
            u, c = np.unique(ids[b:e, layer, :].ravel(), return_counts=True)
            out.append(Position(layer, int(e - b), tuple(int(x) for x in u), tuple(int(x) for x in c)))
    return out


def _share_time(cost, n: int, loads_gpu, loads_cpu) -> float:
    g = cost.act(n) + sum(cost.gpu(x) for x in loads_gpu) if loads_gpu else 0.0
    c = cost.cpu_startup_s + sum(cost.cpu(x) for x in loads_cpu) if loads_cpu else 0.0
    return max(g, c)


def _free_split_time(cost, pos: Position) -> float:
    """The position's MoE time at its best split with every expert resident and no copy (a lower bound)."""
    best = math.inf
    k = len(pos.experts)
    for mask in range(1 << k):
        g = [pos.loads[i] for i in range(k) if mask >> i & 1]
        c = [pos.loads[i] for i in range(k) if not mask >> i & 1]
        best = min(best, _share_time(cost, pos.n, g, c))
    return best


@dataclass
class ExactResult:
    """The search's answer: ``time_s`` (seconds of simulated time for all positions) and how it got there."""

    time_s: float
    nodes: int
    proven: bool           #: False when ``max_nodes`` stopped the search (``time_s`` is then only the best found)
    #: per position of the best schedule found: (resident keys, keys on the GPU, end time s); empty when no
    #: schedule beat ``upper_bound_s``
    schedule: list = None


class _Search:
    """The depth-first branch and bound of :func:`optimal_time` over one instance (see the module's model)."""

    def __init__(self, pos: list, E: int, cost, n_slots: int, h2d: float, upper_bound_s: float, max_nodes: int,
                 prune: bool):
        self.pos, self.cost, self.n_slots, self.h2d = pos, cost, n_slots, h2d
        self.prune, self.max_nodes = prune, max_nodes
        self.P = len(pos)
        self.keys = [tuple(p.layer * E + e for e in p.experts) for p in pos]
        # positions at which each key is used, and the least time left after each position
        self.uses: dict = {}
        for i, ks in enumerate(self.keys):
            for k in ks:
                self.uses.setdefault(k, []).append(i)
        self.rest = [0.0] * (self.P + 1)
        for i in range(self.P - 1, -1, -1):
            self.rest[i] = self.rest[i + 1] + cost.layer(pos[i].n) + _free_split_time(cost, pos[i])
        self.last_use = {k: u[-1] for k, u in self.uses.items()}
        self.best = upper_bound_s
        self.best_path: list = []
        self.path: list = []
        self.nodes = 0
        self.frontier: dict = {}
        self.fixed = False  # the initial fill was given (not chosen by the search)
        self.stopped = False

    def live(self, k: int, p: int) -> bool:
        return self.last_use.get(k, -1) >= p

    def dominated(self, p: int, t: float, link: float, slots: tuple) -> bool:
        """Whether a state reached before at this position with the same residents is no later on any clock (now,
        link, every slot's arrival and release): it leads to every schedule this one can, no later. Records this
        state otherwise."""
        live = [s for s in slots if s[0] >= 0 and self.live(s[0], p)]
        sig = tuple(sorted(s[0] for s in live))
        vec = (t, link) + tuple(x for s in sorted(live) for x in s[1:]) + \
            tuple(sorted(s[2] for s in slots if s[0] < 0 or not self.live(s[0], p)))
        seen = self.frontier.setdefault((p, sig), []) if self.prune else []
        for v in seen:
            if all(a <= b for a, b in zip(v, vec)):
                return True
        seen[:] = [v for v in seen if not all(a <= b for a, b in zip(vec, v))]
        seen.append(vec)
        return False

    def visit(self, p: int, t: float, link: float, slots: tuple) -> None:
        """Every schedule from position ``p`` at time ``t`` with the link free at ``link``; ``slots``: a tuple of
        ``(key or -1, ready_s, free_s)``, one per slot."""
        if p == self.P:
            if t < self.best:
                self.best = t
                self.best_path[:] = list(self.path)
            return
        if self.prune and t + self.rest[p] >= self.best * (1.0 - 1e-12):
            return
        if self.dominated(p, t, link, slots):
            return
        self.nodes += 1
        if self.nodes > self.max_nodes:
            self.stopped = True
            return
        resident = {s[0]: s for s in slots if s[0] >= 0 and self.live(s[0], p)}
        cand = sorted(set(resident) | {k for k in self.uses if self.live(k, p)})
        initial_fill = p == 0 and not self.fixed
        for size in range(min(self.n_slots, len(cand)), -1, -1):
            for chosen in itertools.combinations(cand, size):
                new = [k for k in chosen if k not in resident]
                # slots the new experts may take: the ones not kept, freed earliest first
                kept = set(chosen)
                spare = sorted((s for s in slots if s[0] not in kept or s[0] < 0), key=lambda s: s[2])
                orders = itertools.permutations(new) if len(new) > 1 and not initial_fill else (tuple(new),)
                for order in orders:
                    lf = link
                    placed = {k: resident[k] for k in chosen if k in resident}
                    for k, s in zip(order, spare):
                        if initial_fill:  # the initial fill: resident from the start
                            placed[k] = (k, 0.0, 0.0)
                            continue
                        start = max(lf, s[2])
                        lf = start + self.h2d
                        placed[k] = (k, lf, lf)
                    self.splits(p, t, lf, placed, tuple(spare[len(order):]))

    def splits(self, p: int, t: float, link: float, placed: dict, others: tuple) -> None:
        """Every GPU share of position ``p`` among its resident experts ``placed`` (key -> slot), and on from each."""
        pp, keys, cost = self.pos[p], self.keys[p], self.cost
        t_moe = t + cost.layer(pp.n)
        act = [i for i, k in enumerate(keys) if k in placed]
        for r in range(len(act), -1, -1):
            for on_gpu in itertools.combinations(act, r):
                gset = set(on_gpu)
                slots_next = dict(placed)
                end = t_moe
                if on_gpu:
                    tg = t_moe + cost.act(pp.n)
                    for i in sorted(on_gpu, key=lambda i: placed[keys[i]][1]):
                        tg = max(tg, placed[keys[i]][1]) + cost.gpu(pp.loads[i])
                    end = max(end, tg)
                cpu = [pp.loads[i] for i in range(len(keys)) if i not in gset]
                if cpu:
                    end = max(end, t_moe + cost.cpu_startup_s + sum(cost.cpu(x) for x in cpu))
                # the layer's experts stay pinned until it ends (LayerDecider::release); the next decision, where a
                # copy may take their slots, comes after the next layer's non-expert part
                free = end + (cost.layer(self.pos[p + 1].n) if p + 1 < self.P else 0.0)
                for k in keys:
                    if k in slots_next:
                        slots_next[k] = (k, slots_next[k][1], free)
                state = tuple(sorted(slots_next.values())) + others
                self.path.append((tuple(sorted(placed)), tuple(keys[i] for i in on_gpu), end))
                self.visit(p + 1, end, link, state)
                self.path.pop()


def optimal_time(trace: "_core.Trace", expert_ids, cost: "_core.CostModel", n_slots: int, cfg: "_core.SimConfig",
                 first_prompt: int = 0, end_prompt: Optional[int] = None, upper_bound_s: float = math.inf,
                 initial: Optional[Sequence[int]] = None, max_nodes: int = 5_000_000,
                 prune: bool = True) -> ExactResult:
    """The least time, in seconds, in which any policy can run ``trace``'s prompts ``[first_prompt, end_prompt)``
    with ``n_slots`` GPU expert slots, under the noise-free truth ``cost`` (see the module's model).

    ``trace``: a :class:`hybrimoe._core.Trace`; ``expert_ids``: the array it was built from (int
    ``[n_tokens, n_layers, top_k]``).
    ``cfg``: the run's :class:`hybrimoe._core.SimConfig` (stage, ubatch, max_tokens: the steps). The trace must
    have the same expert bytes in every MoE layer and no dense layers. ``upper_bound_s``: a known achievable time
    (e.g. a simulated policy's) to prune with; the search returns it unchanged when nothing is faster.
    ``initial``: the keys (``layer * n_experts + expert``) resident at the start, the first ``n_slots`` of them
    (a policy's initial fill); None lets the search choose them (a bound on every policy, whatever its fill).
    ``prune=False`` turns off the bound and the dominance test (plain enumeration, to check them against).

    Raises:
        ValueError: expert bytes differ across layers, dense layers, a negative slot count, or a bad prompt range.
    """
    if n_slots < 0:
        raise ValueError(f"n_slots must be >= 0, got {n_slots}")
    eb = list(trace.expert_bytes)
    if max(eb) != min(eb):
        raise ValueError("optimal_time needs the same expert bytes in every MoE layer")
    if trace.n_dense_layers:
        raise ValueError("optimal_time models MoE layers only (the trace has dense layers)")
    end_prompt = trace.n_prompts if end_prompt is None else end_prompt
    if not (0 <= first_prompt < end_prompt <= trace.n_prompts):
        raise ValueError(f"bad prompt range {first_prompt}..{end_prompt} of {trace.n_prompts}")
    pos = positions(trace, expert_ids, first_prompt, end_prompt, cfg)
    search = _Search(pos, trace.n_experts, cost, n_slots, cost.h2d(eb[0]), upper_bound_s, max_nodes, prune)
    if initial is None:
        search.visit(0, 0.0, 0.0, tuple((-1, 0.0, 0.0) for _ in range(n_slots)))
    else:
        keys0 = [int(k) for k in initial][:n_slots]
        search.fixed = True
        search.visit(0, 0.0, 0.0, tuple((k, 0.0, 0.0) for k in keys0)
                     + tuple((-1, 0.0, 0.0) for _ in range(n_slots - len(keys0))))
    return ExactResult(search.best, search.nodes, not search.stopped, search.best_path)
