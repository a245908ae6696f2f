"""``hybrimoe simulate``: trace-driven comparison of whole policy presets.

Flow: load a routing trace and a hardware preset; derive the planner's CostModel from the preset and the model's
facts; profile expert frequencies on the first ``--profile-fraction`` (default 20%) of the prompts (the ``hot-set``
preset's static hot set and the adaptive caches' initial fill come from it; ``ktransformers`` and ``upstream-ncmoe``
keep whole leading / last layers and ignore it); simulate the remaining prompts with each system preset
(:data:`hybrimoe.policy.SYSTEM_PRESETS`); print a table and optionally write JSON records and plots.

Assumptions that every report must state (they are also written into each JSON record under ``assumptions``):

- time is charged by a seeded "truth" model (noise, extra start-up, host-memory contention;
  :func:`hybrimoe.policy.truth_model_for`), not by the planner's own predictions;
- routing predictions for prefetching come from the trace through an imperfect predictor with recall per distance
  ``--recall`` (default ``_core.DEFAULT_PREDICTOR_RECALL``, 1, 2, 3 layers ahead); ``oracle`` uses recall 1 (a bound);
- a trace without router scores makes MRS score each activated expert 1/top_k per token;
- tokens and stages: decode runs one token per step, prompt after prompt, prefill each prompt in ubatches of
  ``--ubatch`` tokens. A trace with phases (a recorded one) gives each stage its own tokens: prefill the prefill-phase
  tokens of each prompt, decode the decode-phase tokens (so a decode run leaves out the prompts' prefill, and the
  cache enters a prompt's decode as the previous prompt's decode left it); a trace without phases gives both stages
  every token of each prompt. The profile (below) and ``--max-tokens`` count the stage's tokens only;
- a partial trace (an interrupted recording) is simulated as recorded: its last prompt is as long as it got;
  incomplete tokens (an id outside 0..E-1, such as -1 for a layer the recorder did not reach, a repeated id, a score
  that is not finite) are an error, or with ``--drop-incomplete`` left out (the count is printed and recorded);
- model facts (non-expert costs, expert parameters; :func:`hybrimoe.policy.cost_model_from_hardware`) come from
  ``-m MODEL.gguf``, else ``--model-facts NAME`` (:data:`hybrimoe.trace.MODEL_FACTS`), else the facts the trace
  carries, else the built-in entry of its model name; expert bytes per layer are the GGUF's with ``-m`` (a note is
  printed when the trace's differ), else the trace's;
- decisions follow the engine's rules (src/policy/decision.h, shared code): a planned load the cache refuses runs
  on the CPU, fills stop when the planner's copy-queue estimate reaches the predicted makespan, and the scheduler
  sees the copy queue and in-flight copies as the planner estimates them, not as the truth model charges them;
  the cache's initial fill is resident from the start.

:func:`replay_engine_log` replays a real engine's decision log instead of a trace and reproduces its decisions.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from hybrimoe import _core
from hybrimoe import policy as pol
from hybrimoe.defaults import PREFETCH_LAYERS, progress_on
from hybrimoe.facts import MODEL_FACTS, ModelFacts, facts_from_gguf
from hybrimoe.trace import PHASE_DECODE, PHASE_PREFILL, RoutingTrace, default_trace_path, load_trace

#: cache sizes (fractions of all routed-expert bytes) of the hit-rate plot
PLOT_CACHE_FRACTIONS = (0.1, 0.25, 0.5, 0.75)
DEFAULT_POLICIES = ("hybrimoe", "hybrimoe-lru", "ktransformers", "hot-set", "upstream-ncmoe", "gpu-on-demand",
                    "belady", "oracle")


def presets_help() -> str:
    """One line per system preset (name: what it does; source), for ``--policies``' help."""
    return "; ".join(f"{n}: {s['about']}" for n, s in pol.SYSTEM_PRESETS.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``simulate`` options to ``parser``."""
    parser.add_argument("--trace", default=None, help="routing trace .npz (default: $HYBRIMOE_TRACE or "
                                                      "../shared/traces/dsv2lite_dev.npz)")
    parser.add_argument("-m", "--model", default=None, metavar="MODEL.gguf",
                        help="the traced model's GGUF file: model facts (expert bytes per layer, non-expert sizes) "
                             "from its tensors; its MoE layers, experts and top-k must match the trace's")
    parser.add_argument("--model-facts", default=None, metavar="NAME",
                        help=f"built-in model facts ({', '.join(sorted(MODEL_FACTS))}) instead of a GGUF or the "
                             "facts a trace carries")
    parser.add_argument("--drop-incomplete", action="store_true",
                        help="leave out tokens with an id outside 0..E-1 (e.g. -1: a layer the recorder did not "
                             "reach), a repeated id or a score that is not finite, and print how many")
    parser.add_argument("--hardware", default="paper-a6000",
                        help=f"hardware preset name ({', '.join(pol.preset_names())}) or a preset .json path")
    parser.add_argument("--cost-model", default=None, help="a calibrated cost-model JSON (overrides the preset's "
                                                           "derived planner costs)")
    parser.add_argument("--moe-cache", default="25%", help="GPU expert-cache budget: '25%%' of all routed-expert "
                                                           "bytes, bytes, or e.g. '3GiB'")
    parser.add_argument("--stage", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help="comma-separated system presets (default: %(default)s). " +
                             presets_help().replace("%", "%%") +
                             ". Presets and sources: hybrimoe.policy.SYSTEM_PRESETS")
    parser.add_argument("--json", default=None, help="write the records to this JSON file")
    parser.add_argument("--plot", default=None, help="write PNG plots to this directory")
    parser.add_argument("--force", action="store_true", help="replace an existing --json file and existing plots")
    parser.add_argument("--max-tokens", type=int, default=20000,
                        help="stop each run after about this many tokens (0 = all; prefill stops at a prompt end)")
    parser.add_argument("--max-prompts", type=int, default=0, help="use at most this many evaluation prompts")
    parser.add_argument("--ubatch", type=int, default=512, help="prefill ubatch size, tokens")
    parser.add_argument("--prefetch-depth", type=int, default=PREFETCH_LAYERS,
                        help="D, MoE layers predicted ahead (default %(default)s)")
    parser.add_argument("--recall", default=",".join(map(str, _core.DEFAULT_PREDICTOR_RECALL)),
                        help="predictor recall per distance 1..D")
    parser.add_argument("--profile-fraction", type=float, default=0.2,
                        help="leading fraction of prompts used only to profile expert frequencies")
    parser.add_argument("--seed", type=int, default=1, help="seed of the truth model and the predictor")
    parser.add_argument("--hit-rates", action="store_true",
                        help="also replay the cache policies alone (mrs, lru, lfu, belady) and print hit rates")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _positive_recall(text: str, depth: int) -> list[float]:
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ValueError(f"--recall must be comma-separated numbers, got {text!r}") from e
    if any(not (0.0 <= v <= 1.0) for v in vals):
        raise ValueError(f"--recall values must be within 0..1, got {text!r}")
    if len(vals) < depth:
        raise ValueError(f"--recall needs {depth} values (one per distance up to --prefetch-depth), got {len(vals)}")
    return vals


def stage_tokens(trace: RoutingTrace, stage: str) -> RoutingTrace:
    """The tokens a stage simulates: with phases, the prefill- or decode-phase tokens (prompt offsets moved;
    :meth:`RoutingTrace.select_tokens`), without, the trace itself.

    Raises:
        ValueError: the trace has phases but none of this stage (it names the other stage).
    """
    if trace.phases is None:
        return trace
    want = PHASE_PREFILL if stage == "prefill" else PHASE_DECODE
    keep = np.asarray(trace.phases) == want
    if not keep.any():
        other = "decode" if stage == "prefill" else "prefill"
        raise ValueError(f"{trace.path or 'the trace'} has no {stage}-phase tokens (all {trace.n_tokens} are "
                         f"{other}): simulate --stage {other}")
    return trace.select_tokens(keep)


class Setup:
    """Everything shared by the runs of one invocation (trace, costs, profile, prompt split).

    ``facts``: the model facts to use (``facts_source`` says where they came from, for the records); None takes
    the trace's (:meth:`RoutingTrace.resolve_facts`). ``n_dropped``: incomplete tokens dropped before (recorded).
    The trace is cut to the stage's tokens (:func:`stage_tokens`).

    Raises:
        ValueError: a bad stage, fraction or limit; no model facts (the message names ``-m``, ``--model-facts`` and a
            trace with facts); no tokens of the stage; no prompts left after profiling.
    """

    def __init__(self, trace: RoutingTrace, hw: pol.Hardware, budget_spec, stage: str, *, cost_model=None,
                 max_tokens: int = 20000, max_prompts: int = 0, ubatch: int = 512, prefetch_depth: int = PREFETCH_LAYERS,
                 recall: Sequence[float] = _core.DEFAULT_PREDICTOR_RECALL, profile_fraction: float = 0.2, seed: int = 1,
                 facts: Optional[ModelFacts] = None, facts_source: str = "", n_dropped: int = 0):
        if stage not in ("decode", "prefill"):
            raise ValueError(f"stage must be 'decode' or 'prefill', got {stage!r}")
        if not (0.0 <= profile_fraction < 1.0):
            raise ValueError(f"profile fraction must be in [0, 1), got {profile_fraction}")
        if max_tokens < 0 or max_prompts < 0:
            raise ValueError("max_tokens and max_prompts must be >= 0")
        if facts is None:
            facts = trace.resolve_facts()
            facts_source = ("carried by the trace" if trace.facts is not None else
                            f"built-in model facts '{trace.model}'")
        if facts is None:
            raise ValueError(f"no model facts for {trace.path or 'the trace'} (model {trace.model!r}): give the "
                             f"model's GGUF with -m MODEL.gguf, built-in facts with --model-facts NAME (known: "
                             f"{', '.join(sorted(MODEL_FACTS))}), or a trace that carries its facts (hybrimoe "
                             "trace records them)")
        self.phased = trace.phases is not None
        trace = stage_tokens(trace, stage)
        self.facts_source = facts_source or "given"
        self.n_dropped = int(n_dropped)
        self.trace, self.hw, self.facts, self.stage = trace, hw, facts, stage
        self.core_trace = trace.to_core()
        self.planner = cost_model if cost_model is not None else pol.cost_model_from_hardware(hw, facts)
        self.truth_cost = pol.cost_model_from_hardware(hw, facts)
        # the truth charges host-memory contention per overlapped second (TruthModel.contention), not the planner's
        # fixed share of each copy
        self.truth_cost.cpu_copy_overlap = 1.0
        self.truth = pol.truth_model_for(hw, seed)
        self.expert_bytes = [float(b) for b in trace.expert_bytes]
        self.total_bytes = float(np.sum(trace.expert_bytes) * trace.num_experts)
        self.budget_spec = budget_spec
        self.budget = pol.parse_budget(budget_spec, self.total_bytes, float(np.min(trace.expert_bytes)))
        n = trace.n_prompts
        self.first = int(math.floor(profile_fraction * n))
        if self.first >= n:
            raise ValueError("no prompts left after profiling")
        self.end = n if max_prompts == 0 else min(n, self.first + max_prompts)
        self.cfg = _core.SimConfig()
        self.cfg.stage = stage
        self.cfg.ubatch = ubatch
        self.cfg.prefetch_depth = prefetch_depth
        self.cfg.recall = list(recall)
        self.cfg.predictor_seed = seed + 6
        self.cfg.max_tokens = max_tokens
        self.cfg.validate()
        self.recall = list(recall)
        # Profile: activations per (layer, expert) over the profiling prompts.
        end_tok = int(trace.prompt_offsets[self.first])
        ids = trace.expert_ids[:end_tok].astype(np.int64)
        L, E = trace.n_layers, trace.num_experts
        flat = (ids + (np.arange(L) * E)[None, :, None]).ravel()
        self.profile = np.bincount(flat, minlength=L * E).astype(np.float64).reshape(L, E)
        self.hot_keys = pol.hot_keys_from_counts(self.profile)
        self._first_use: Optional[list] = None

    def first_use_keys(self) -> list[int]:
        """Keys (``layer * n_experts + expert``) in the order the evaluated tokens first use them, then the
        profile's hot keys not used: the initial fill a clairvoyant cache chooses (Belady's rule applied to the
        empty cache: the experts needed soonest)."""
        if self._first_use is None:
            L, E = self.trace.n_layers, self.trace.num_experts
            steps = _core.make_steps(self.core_trace, self.first, self.end, self.cfg)
            b, e = (int(steps[0][0]), int(steps[-1][1])) if steps else (0, 0)
            ids = self.trace.expert_ids[b:e].astype(np.int64) + (np.arange(L) * E)[None, :, None]
            flat = ids.reshape(ids.shape[0], -1).ravel()   # token-major, layer order within a token
            _, at = np.unique(flat, return_index=True)
            used = flat[np.sort(at)].tolist()
            seen = set(used)
            self._first_use = used + [k for k in self.hot_keys if k not in seen]
        return self._first_use

    def clairvoyant_planner(self) -> "_core.CostModel":
        """The cost model a clairvoyant preset plans with: the truth's own costs, with its host-memory contention
        as the planner's copy term (``cpu_copy_overlap = 1 - contention``): a bound knows what time is charged."""
        cm = _core.CostModel()
        for f in pol.COST_FIELDS:
            setattr(cm, f, getattr(self.truth_cost, f))
        cm.cpu_copy_overlap = max(0.0, 1.0 - float(self.truth.contention))
        return cm

    def build(self, name: str):
        """(cache, scheduler, prefetcher, config) of a system preset (:func:`hybrimoe.policy.build_preset`, with
        the profile's hot set; a clairvoyant preset's cache starts with :meth:`first_use_keys`); ValueError on an
        unknown name."""
        ps = pol.build_preset(name, self.expert_bytes, self.trace.num_experts, self.budget,
                              hot_keys=self.first_use_keys() if _clairvoyant(name) else self.hot_keys,
                              profile=self.profile.ravel())
        cfg = _core.SimConfig()
        for f in ("stage", "ubatch", "prefetch_depth", "recall", "predictor_seed", "max_tokens"):
            setattr(cfg, f, getattr(self.cfg, f))
        cfg.fill_on_miss = ps.fill_on_miss
        if ps.oracle:
            cfg.recall = [1.0] * max(1, cfg.prefetch_depth)
        return ps.cache, ps.scheduler, ps.prefetcher, cfg

    def assumptions(self, name: str) -> dict:
        spec = pol.system_preset(name)
        return {
            "predictor_recall": [1.0] * len(self.recall) if spec["oracle"] else self.recall,
            "router_scores": "trace" if self.trace.has_scores else "none: MRS scores activated experts 1/top_k",
            "truth_model": "seeded log-normal noise, extra CPU start-up, host-memory contention (policy.truth_model_for)",
            "profile": f"first {self.first} of {self.trace.n_prompts} prompts; evaluated prompts {self.first}..{self.end}",
            "stage_model": self.stage_model(),
            "partial_trace": "yes: the recording was interrupted; its last prompt is simulated as far as it got"
            if self.trace.partial else "no",
            "incomplete_tokens": f"{self.n_dropped} dropped (--drop-incomplete)" if self.n_dropped else "none",
            "model_facts": f"{self.facts.name}: {self.facts_source}",
        }

    def stage_model(self) -> str:
        """How this run's stage uses the trace's tokens (the records' ``assumptions.stage_model``)."""
        if self.stage == "decode":
            return ("decode: the decode-phase tokens, one per step, prompt after prompt (prefill-phase tokens left "
                    "out)" if self.phased else "decode: every token of each prompt, one per step (the trace has "
                    "no phases)")
        return (f"prefill: the prefill-phase tokens of each prompt in ubatches of {self.cfg.ubatch} (decode-phase "
                "tokens left out)" if self.phased else f"prefill: every token of each prompt in ubatches of "
                f"{self.cfg.ubatch} (the trace has no phases)")

    def run(self, name: str, cache=None, sched=None, pre=None, cfg=None) -> dict:
        """Simulates one system preset (or the given components) and returns its JSON record.

        A clairvoyant preset with ``also`` (:data:`hybrimoe.policy.SYSTEM_PRESETS`: ``oracle``) is also run with
        each listed preset's components, and the fastest run is its record (``plan`` names the one kept): with
        perfect routing knowledge the impact prefetcher copies for every true activation it gains on, without
        weighing what the copy evicts or delays on the link, and on some small traces that plan is slower than
        belady's (its predictor's misses copy less), so the bound keeps the better plan. Where a step can activate
        :data:`hybrimoe.policy.STREAMING_FRACTION` of a layer's experts (prefill), its own plan is also run with
        streamed demand loads (``plan`` is then ``oracle+streaming``)."""
        if cache is None:
            cache, sched, pre, cfg = self.build(name)
            alternatives = pol.system_preset(name).get("also", ()) if name in pol.SYSTEM_PRESETS else ()
        else:
            alternatives = ()
        planner = self.clairvoyant_planner() if _clairvoyant(name) else self.planner
        res = _core.simulate(self.core_trace, cache, sched, pre, planner, self.truth_cost, self.truth, cfg,
                             self.first, self.end)
        rec, plan = record(name, res, self), name
        for alt in alternatives:
            if not _clairvoyant(alt):
                raise ValueError(f"preset {name!r}: 'also' names {alt!r}, which is not clairvoyant")
        if alternatives:
            # its own plan also with streamed demand loads (ExpertCache.set_streaming_demand), where a step can
            # activate enough experts to stream: Belady's order is usually the better one, but not always
            streams = self.stage == "prefill" or self.trace.top_k >= pol.STREAMING_FRACTION * self.trace.num_experts
            plans = [(a, 0.0) for a in alternatives] + ([(name, pol.STREAMING_FRACTION)] if streams else [])
            for alt, streaming in plans:
                parts = self.build(alt)
                parts[0].set_streaming_demand(streaming)
                other = self.run(alt, *parts)
                if other["total_s"] < rec["total_s"]:
                    rec, plan = dict(other, policy=name), alt + ("+streaming" if streaming else "")
            rec["plan"] = plan
        return rec


def _trace_arg(args):
    """The command's trace: ``--trace``, else :func:`hybrimoe.trace.default_trace_path`. FileNotFoundError naming
    ``--trace`` and ``$HYBRIMOE_TRACE`` when no trace was given and the default is not there (it is looked up from
    the current directory, so an installed package run elsewhere does not find the checkout's)."""
    if args.trace:
        return args.trace
    path = default_trace_path()
    if not path.exists():
        raise FileNotFoundError(f"no routing trace given, and the default {path} is not there: pass --trace "
                                "FILE.npz or set HYBRIMOE_TRACE (the default is shared/traces/dsv2lite_dev.npz "
                                "looked up from the current directory and its parents)")
    return path


def total_times(trace: RoutingTrace, hw_name: str, budget_spec, stage: str, names: Sequence[str], *,
                max_tokens: int = 20000, seed: int = 1, contention_scale: float = 1.0) -> dict:
    """Simulated total time of each preset in ``names`` on one configuration: ``{name: seconds}`` (TPOT x tokens in
    decode, TTFT summed over prompts in prefill: :meth:`Setup.run`'s ``total_s``).

    ``hw_name``: a hardware preset (:func:`hybrimoe.policy.load_hardware`); ``contention_scale`` multiplies the truth
    model's host-memory contention (> 0), to judge the planner under a truth it does not know. A module-level
    function of picklable arguments, so that a process pool can run a table of configurations.

    Raises:
        ValueError: as :class:`Setup`, or a contention scale <= 0.
    """
    if not contention_scale > 0:
        raise ValueError(f"contention scale must be > 0, got {contention_scale}")
    s = Setup(trace, pol.load_hardware(hw_name), budget_spec, stage, max_tokens=max_tokens, seed=seed)
    s.truth.contention = contention_scale * s.truth.contention
    return {n: s.run(n)["total_s"] for n in names}


def _clairvoyant(name: str) -> bool:
    """Whether ``name`` is a system preset whose cache knows the future (``belady``, ``oracle``)."""
    return name in pol.SYSTEM_PRESETS and bool(pol.system_preset(name)["clairvoyant"])


def record(name: str, res, setup: Setup) -> dict:
    """The JSON record of one run."""
    st = res.cache
    tot = max(res.total_s, 1e-30)
    rec = {
        "policy": name,
        "stage": res.stage,
        "hardware": setup.hw.name,
        "moe_cache": str(setup.budget_spec),
        "budget_bytes": setup.budget,
        "hit_rate": st.hit_rate,
        "demand_hit_rate": st.demand_hit_rate,
        "prefetch_hit_rate": st.prefetch_hits / st.accesses if st.accesses else 0.0,
        "late_rate": st.late / st.accesses if st.accesses else 0.0,
        "tokens": res.tokens,
        "prompts": res.prompts,
        "tokens_per_s": res.tokens_per_s,
        "total_s": res.total_s,
        "bytes_h2d": res.bytes_h2d,
        "bytes_demand": res.bytes_demand,
        "bytes_prefetch": res.bytes_prefetch,
        "bytes_fill": res.bytes_fill,
        "prefetch_issued": res.prefetch_issued,
        "prefetch_used": res.prefetch_used,
        "cpu_busy_frac": res.cpu_busy_s / tot,
        "gpu_busy_frac": res.gpu_busy_s / tot,
        "link_busy_frac": res.link_busy_s / tot,
        "predicted_moe_s": res.predicted_moe_s,
        "charged_moe_s": res.charged_moe_s,
        "decision_us_mean": res.decision_us_mean,
        "prefetch_us_mean": res.prefetch_us_mean,
        "layer_moe_s": list(res.layer_moe_s),
        "assumptions": setup.assumptions(name) if name in pol.SYSTEM_PRESETS else {},
    }
    if res.stage == "decode":
        rec["tpot_s"] = res.tpot_s
    else:
        rec["ttft_s"] = res.ttft_s
    return rec


def cache_hit_rates(setup: Setup, names: Sequence[str] = ("mrs", "lru", "lfu", "belady"),
                    budget: Optional[float] = None) -> dict:
    """Cache-only replay hit rates (every miss offered for admission; same initial fill) per cache policy."""
    out = {}
    for n in names:
        cache = _core.ExpertCache(setup.expert_bytes, setup.trace.num_experts,
                                  setup.budget if budget is None else budget, _core.make_cache_policy(n))
        if cache.budget_bytes > 0:
            cache.fill(setup.hot_keys)
        st = _core.replay_cache(setup.core_trace, cache, setup.first, setup.end, setup.cfg)
        out[n] = {"hit_rate": st.hit_rate, "demand_hit_rate": st.demand_hit_rate, "accesses": st.accesses}
    return out


def replay_engine_log(llm, log: Sequence[dict], policies=None) -> list[dict]:
    """Replays an engine's decision records through the simulator's copy of its rules.

    ``llm``: the :class:`hybrimoe.Llama` whose engine logged ``log`` (``llm.moe_log()`` before its first decode,
    then ``llm.moe_take_log()``). ``policies``: fresh policy objects built as the engine's were
    (:func:`hybrimoe.engine.build_policies`); by default they are rebuilt from the Llama's ``moe_policy``,
    ``moe_cache``, ``moe_prefetch_layers`` and ``moe_profile``, which needs a preset name or a dict of names
    (policy *objects* keep state: pass fresh ones). The cost model is the engine's. Returns the simulator's records
    (the keys of ``moe_take_log()``); :func:`hybrimoe._core.first_difference` compares them with ``log``.

    Raises:
        ValueError: the Llama has no MoE engine, the log does not start at the engine's first ubatch (the replay
            needs the cache as it was then), or the policies cannot be rebuilt; a malformed record.
    """
    from hybrimoe import engine as eng

    setup = getattr(llm, "moe_setup", None)
    if setup is None or getattr(llm, "moe_engine", None) is None:
        raise ValueError("replay_engine_log needs a Llama with the MoE engine on (moe_cache=...)")
    log = list(log)
    if log and (not isinstance(log[0], dict) or "ubatch" not in log[0]):
        raise ValueError("decision record 0 is not a record of moe_take_log() (no 'ubatch')")
    if log and log[0]["ubatch"] != 0:
        raise ValueError(f"the log starts at ubatch {log[0]['ubatch']}: turn logging on before the first decode (the "
                         "replay starts from the engine's initial cache)")
    if policies is None:
        spec = setup.policy_spec
        if not (isinstance(spec, str) or (isinstance(spec, dict) and
                                          all(isinstance(v, (str, bool)) for v in spec.values()))):
            raise ValueError("moe_policy was given as policy objects, which keep state: pass fresh ones as "
                             "policies=hybrimoe.engine.build_policies(...)")
        policies = eng.build_policies(spec, setup.facts, setup.n_slots, setup.prefetch_layers, setup.profile)
    return _core.replay_decisions(log, policies.cache, policies.scheduler, policies.prefetcher, setup.cost,
                                  has_slots=setup.n_slots > 0, prefetch_layers=int(setup.prefetch_layers),
                                  fill_on_miss=policies.fill_on_miss)


def format_table(records: Sequence[dict]) -> str:
    """A markdown table of the records (llama-bench style)."""
    stage = records[0]["stage"] if records else "decode"
    tcol = "tpot_ms" if stage == "decode" else "ttft_ms"
    head = f"| policy | hit rate | {tcol} | tokens/s | GB h2d | CPU busy | GPU busy | link busy | decide us |"
    lines = [head, "|" + "---|" * 9]
    for r in records:
        t = (r.get("tpot_s") if stage == "decode" else r.get("ttft_s")) * 1e3
        lines.append(f"| {r['policy']} | {r['hit_rate']:.3f} | {t:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['bytes_h2d'] / 1e9:.2f} | {r['cpu_busy_frac']:.2f} | {r['gpu_busy_frac']:.2f} | "
                     f"{r['link_busy_frac']:.2f} | {r['decision_us_mean']:.2f} |")
    return "\n".join(lines)


def _check_outputs(json_path, plot_dir, force: bool = False, inputs=()) -> None:
    """Fail before a long run, not after it, when an output cannot be written.

    Args:
        json_path, plot_dir: the ``--json`` file and the ``--plot`` directory (None: not asked for).
        force: replace existing outputs. inputs: ``(option, path)`` pairs of the command's input files.

    Raises:
        ValueError: the JSON file or a plot file is an input, exists without ``force`` or cannot be written
            (:func:`hybrimoe.outputs.check_output`); the plot path is an existing file or cannot be created.
    """
    import os
    from pathlib import Path

    from hybrimoe import plots
    from hybrimoe.outputs import check_output

    if json_path:
        check_output(json_path, "--json", force=force, inputs=inputs)
    if plot_dir:
        d = Path(plot_dir)
        if d.exists() and not d.is_dir():
            raise ValueError(f"--plot {d}: exists and is not a directory")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--plot {d}: cannot create the directory: {e.strerror}") from None
        if not os.access(d, os.W_OK):
            raise ValueError(f"--plot {d}: cannot write there")
        for name in plots.PLOT_FILES:
            check_output(d / name, "--plot", force=force, inputs=list(inputs) + [("--json", json_path)])


def load_inputs(args) -> tuple[RoutingTrace, Optional[ModelFacts], str, int, list]:
    """(trace, model facts or None for the trace's own, where the facts came from, incomplete tokens dropped,
    notes to print) from the command's ``--trace``, ``-m``, ``--model-facts`` and ``--drop-incomplete``.

    With ``-m`` the GGUF's (MoE layers, experts, top-k) must be the trace's, and its expert bytes per layer replace
    the trace's (the model named is the one simulated; a note says when they differ).

    Raises:
        FileNotFoundError: a missing trace or GGUF.
        ValueError: both ``-m`` and ``--model-facts``; an unknown facts name; a bad GGUF or trace; a GGUF of another
            shape (both shapes given); an incomplete token without ``--drop-incomplete``; no token left with it.
    """
    gguf_path, name = args.model, args.model_facts
    if gguf_path and name:
        raise ValueError("give -m MODEL.gguf or --model-facts NAME, not both")
    if name is not None and name not in MODEL_FACTS:
        raise ValueError(f"unknown model facts '{name}' (known: {', '.join(sorted(MODEL_FACTS))})")
    facts, source = None, ""
    if gguf_path:
        if gguf_path in MODEL_FACTS and not Path(gguf_path).exists():
            raise ValueError(f"-m/--model takes the model's GGUF file; for built-in facts give --model-facts "
                             f"{gguf_path}")
        facts, source = facts_from_gguf(gguf_path), f"read from {gguf_path} (-m)"
    elif name:
        facts, source = MODEL_FACTS[name], f"built-in model facts '{name}' (--model-facts)"
    trace = load_trace(_trace_arg(args), model=name, facts=facts if gguf_path else None,
                       check_tokens=not args.drop_incomplete)
    notes = []
    if name:
        trace.check_shape(MODEL_FACTS[name], f"the built-in model facts '{name}'")
    if gguf_path:
        trace.check_shape(facts, f"the model {gguf_path}")
        own = facts.per_layer_expert_bytes()
        if not np.allclose(trace.expert_bytes, own, rtol=1e-9, atol=0.0):
            notes.append(f"expert bytes per layer from {gguf_path}, mean {own.mean():.0f}; the trace's differ (mean "
                         f"{np.mean(trace.expert_bytes):.0f}: recorded with another quant?)")
        trace = dataclasses.replace(trace, expert_bytes=own)
    n_dropped = 0
    if args.drop_incomplete:
        trace, n_dropped = trace.drop_incomplete()
        notes.append(f"dropped {n_dropped} incomplete token(s) (ids outside 0..{trace.num_experts - 1}, repeated "
                     f"ids or scores not finite); {trace.n_tokens} left")
        if trace.n_tokens == 0:
            raise ValueError(f"--drop-incomplete left no tokens of the {n_dropped} in {trace.path or 'the trace'}")
    return trace, facts, source, n_dropped, notes


def run(args) -> int:
    """Runs ``hybrimoe simulate``; returns the exit status (0 ok, 2 bad input)."""
    try:
        names = [p.strip() for p in str(args.policies).split(",") if p.strip()]
        if not names:
            raise ValueError("--policies is empty")
        for n in names:
            pol.system_preset(n)
        recall = _positive_recall(args.recall, args.prefetch_depth)
        trace_in = _trace_arg(args)
        _check_outputs(args.json, args.plot, getattr(args, "force", False),
                       [("--trace", trace_in), ("-m", args.model), ("--cost-model", args.cost_model),
                        ("--hardware", args.hardware if args.hardware and Path(args.hardware).is_file() else None)])
        hw = pol.load_hardware(args.hardware)
        trace, facts, source, n_dropped, notes = load_inputs(args)
        cm = pol.load_cost_model(args.cost_model) if args.cost_model else None

        def make_setup(budget_spec) -> Setup:
            return Setup(trace, hw, budget_spec, args.stage, cost_model=cm, max_tokens=args.max_tokens,
                         max_prompts=args.max_prompts, ubatch=args.ubatch, prefetch_depth=args.prefetch_depth,
                         recall=recall, profile_fraction=args.profile_fraction, seed=args.seed, facts=facts,
                         facts_source=source, n_dropped=n_dropped)

        setup = make_setup(args.moe_cache)
    except (ValueError, FileNotFoundError) as e:
        print(f"hybrimoe simulate: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"hybrimoe simulate: {note}")

    records = []
    iterator = names
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(names, desc=f"simulate {args.stage}", unit="policy", file=sys.stderr,
                       disable=not progress_on())
            iterator = bar
        except ImportError:
            pass
    for n in iterator:
        if bar is not None:
            bar.set_postfix_str(n)
        records.append(setup.run(n))
    print(f"hybrimoe simulate: {trace.path or 'trace'} | {hw.name} | cache {args.moe_cache} "
          f"({setup.budget / 1e9:.2f} GB) | {args.stage} | prompts {setup.first}..{setup.end} | "
          f"{records[0]['tokens'] if records else 0} tokens")
    print(format_table(records))
    a = setup.assumptions(names[0])
    print(f"assumptions: predictor recall {setup.recall} (oracle: 1.0); router scores: {a['router_scores']}; "
          f"truth: {a['truth_model']}; {a['stage_model']}; model facts {a['model_facts']}"
          + (f"; partial trace: {a['partial_trace']}" if setup.trace.partial else ""))
    if args.hit_rates:
        hr = cache_hit_rates(setup)
        print("cache-only replay hit rates: " + ", ".join(f"{k} {v['hit_rate']:.3f}" for k, v in hr.items()))
        for r in records:
            r["cache_replay_hit_rates"] = hr
    if args.json:
        from hybrimoe.outputs import write_text

        write_text(args.json, json.dumps(records, indent=1) + "\n")
    if args.plot:
        from hybrimoe import plots

        rates = {f: cache_hit_rates(setup, budget=f * setup.total_bytes) for f in PLOT_CACHE_FRACTIONS}
        # whole simulations at each plotted cache size, every policy asked for
        speeds = {}
        for f in PLOT_CACHE_FRACTIONS:
            at = make_setup(f"{100 * f:g}%")
            speeds[f] = {n: at.run(n)["tokens_per_s"] for n in names}
        out = plots.write_plots(setup, records, Path(args.plot), rates, speeds)
        print("plots: " + ", ".join(str(p) for p in out))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Stand-alone entry (``python -m hybrimoe.simulate``) until the CLI registers the subcommand."""
    parser = argparse.ArgumentParser(prog="hybrimoe simulate", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
