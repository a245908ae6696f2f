"""The trace-driven simulator of whole policy presets (``hybrimoe simulate`` is its command): :class:`Setup` holds one
configuration, :meth:`Setup.run` simulates a preset on it with the policy core's ``simulate`` (the same policy
objects the engine runs).

Flow: load a routing trace and a hardware file; derive the planner's CostModel from the preset and the model's
facts; profile expert frequencies on the first ``--profile-fraction`` (default 20%) of the prompts (the ``hot-set``
preset's static hot set and the adaptive caches' initial fill come from it; ``ktransformers`` and ``upstream-ncmoe``
keep whole leading / last layers and ignore it); simulate the remaining prompts with each system preset
(:data:`hybrimoe.policy.presets.SYSTEM_PRESETS`); the command prints a table and optionally writes JSON records
and plots.

Assumptions that every report must state (they are also written into each JSON record under ``assumptions``):

- time is charged by a seeded "truth" model (noise, extra start-up, host-memory contention;
  :func:`hybrimoe.policy.hardware.truth_model_for`), not by the planner's own predictions;
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
- model facts (non-expert costs, expert parameters; :func:`hybrimoe.policy.hardware.cost_model_from_hardware`) come from
  ``-m MODEL.gguf``, else ``--model-facts NAME`` (:data:`hybrimoe.model.facts.MODEL_FACTS`), else the facts the trace
  carries, else the built-in entry of its model name; expert bytes per layer are the GGUF's with ``-m`` (a note is
  printed when the trace's differ), else the trace's;
- decisions follow the engine's rules (src/policy/decision.h, shared code): a planned load the cache refuses runs
  on the CPU, fills stop when the planner's copy-queue estimate reaches the predicted makespan, and the scheduler
  sees the copy queue and in-flight copies as the planner estimates them, not as the truth model charges them;
  the cache's initial fill is resident from the start.

:func:`hybrimoe.runtime.decision_replay.replay_engine_log` replays a real engine's decision log instead of a trace and
reproduces its decisions. This package never imports the runtime (llama.cpp).
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import numpy as np

from hybrimoe import _core
from hybrimoe.envs import PREFETCH_LAYERS
from hybrimoe.model.facts import MODEL_FACTS, ModelFacts
from hybrimoe.policy.budget import parse_budget
from hybrimoe.policy.cost_model import COST_FIELDS
from hybrimoe.policy.hardware import (
    Hardware,
    cost_model_from_hardware,
    load_disk,
    load_hardware,
    set_disk,
    truth_model_for,
)
from hybrimoe.policy.presets import (
    RAM_PRESETS,
    STREAMING_FRACTION,
    SYSTEM_PRESETS,
    build_preset,
    build_ram_tier,
    gpu_mrs_alpha,
    ram_preset,
    system_preset,
)
from hybrimoe.policy.profile import expert_counts, hot_keys_from_counts
from hybrimoe.sim import speculative
from hybrimoe.sim.streams import streams_trace
from hybrimoe.traces.format import PHASE_DECODE, PHASE_PREFILL, RoutingTrace

#: the disk a RAM tier is simulated with when none is named (hybrimoe/policy/disk_files/)
DEFAULT_DISK = "pcie4-nvme"
#: several GPUs only: upstream's layer split with ``--n-cpu-moe N`` (``-ngl 99 -ts ... --n-cpu-moe N``): the first N
#: MoE layers' experts on the CPU, every later layer's on its own GPU, N the smallest whose experts fit each GPU's
#: budget. (``upstream-ncmoe`` and ``ktransformers`` on several GPUs keep each GPU's last, or leading, layers that fit
#: its budget: the ``-ot`` rules users write per GPU.)
TS_NCMOE = "upstream-ts-ncmoe"


def layer_devices(n_dense: int, n_moe: int, n_devices: int, tensor_split: Optional[Sequence[float]] = None) -> list:
    """Per MoE layer, the device llama.cpp's layer split puts it on with every layer offloaded (``-ngl 99``): the
    output layer counts as one more layer, the proportions (``-ts``; default equal) are made cumulative and
    normalised, and model layer ``il`` goes to the first device whose cumulative share is above ``il / (n_layer +
    1)`` (llama_model::load_tensors, src/llama-model.cpp). ``n_dense``: leading dense layers (MoE layer m is model
    layer n_dense + m).

    Raises:
        ValueError: no device, or a split of another length, negative or all zero.
    """
    if n_devices < 1:
        raise ValueError(f"at least one device, got {n_devices}")
    ts = [1.0] * n_devices if tensor_split is None else [float(x) for x in tensor_split]
    if len(ts) != n_devices or any(x < 0 for x in ts) or sum(ts) <= 0:
        raise ValueError(f"tensor split {ts} must give {n_devices} proportions >= 0, not all 0")
    cum = np.cumsum(ts) / sum(ts)
    n_layer = n_dense + n_moe
    out = []
    for m in range(n_moe):
        il = n_dense + m
        out.append(int(min(n_devices - 1, np.searchsorted(cum, il / (n_layer + 1), side="right"))))
    return out


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


def stage_core_trace(trace: RoutingTrace, stage: str):
    """The C++ trace (``_core.Trace``) of a stage's tokens, as :class:`Setup` builds it
    (:func:`stage_tokens`, then :meth:`RoutingTrace.to_core`): for a caller that runs many Setups of one trace and
    stage (a table of hardware presets and cache sizes), which then share one copy (a DeepSeek-V3-shaped trace of
    2,700 tokens with router scores is about 160 MB; building it takes about 0.1 s).

    Raises:
        ValueError: as :func:`stage_tokens` and :meth:`RoutingTrace.to_core`.
    """
    return stage_tokens(trace, stage).to_core()


def _check_core_trace(core, trace: RoutingTrace, stage: str) -> None:
    """ValueError unless ``core`` has the sizes of ``trace`` (already cut to ``stage``'s tokens)."""
    want = dict(n_tokens=trace.n_tokens, n_layers=trace.n_layers, top_k=trace.top_k, n_experts=trace.num_experts,
                n_prompts=trace.n_prompts, has_scores=trace.router_scores is not None)
    got = {k: getattr(core, k) for k in want}
    if got != want:
        diff = ", ".join(f"{k} {got[k]} (trace: {want[k]})" for k in want if got[k] != want[k])
        raise ValueError(f"core_trace is not the {stage} tokens of this trace: {diff}; build it with "
                         "stage_core_trace(trace, stage)")


#: the run settings of a Setup (its ``cfg``) each run's SimConfig takes
_RUN_FIELDS = ("stage", "ubatch", "prompt_tokens", "prefetch_depth", "recall", "predictor_seed", "max_tokens")


class Setup:
    """Everything shared by the runs of one invocation (trace, costs, profile, prompt split).

    ``facts``: the model facts to use (``facts_source`` says where they came from, for the records); None takes
    the trace's (:meth:`RoutingTrace.resolve_facts`). ``n_dropped``: incomplete tokens dropped before (recorded).
    The trace is cut to the stage's tokens (:func:`stage_tokens`). ``core_trace``: that cut as the C++ trace
    (:func:`stage_core_trace` of the same trace and stage), when the caller has it already; built here otherwise.

    ``devices``: GPUs (default the hardware's ``gpu_count``, else 1), each with its own expert cache and the MoE
    layers llama.cpp's layer split gives it (:func:`layer_devices`, ``tensor_split`` as ``-ts``); a budget is then
    each GPU's: ``"25%"`` of the experts of its layers, a size each (the same VRAM per device). The hardware's
    ``gpus_per_link`` above 1 makes every GPU copy over one shared link.

    ``streams``: decode streams in one batch (continuous batching; :mod:`hybrimoe.sim.streams`): each step decodes
    one token of each of ``streams`` requests in one ubatch; the records' ``tpot_s`` is then each stream's time per
    token (the mean step) and ``tokens_per_s`` the aggregate. Only with ``stage="decode"``.

    ``draft``: speculative decoding (:mod:`hybrimoe.sim.speculative`): each step verifies the last accepted token and
    ``draft`` drafted ones in one ubatch, of which ``acceptance`` (a probability per draft, or a recorded run's
    accepted drafts per step) are kept; ``draft_cost_s``: the drafter's seconds per drafted token, added to each
    step. The records' ``tokens`` are then the tokens emitted, ``tokens_per_s`` and ``tpot_s`` per emitted token,
    ``verified_tokens`` the rows verified. Only with ``stage="decode"`` and one stream.

    ``ram_cache``: the host RAM for routed experts (``"25%"`` of their bytes, ``"12GiB"``, bytes; as
    ``--moe-ram-cache``), for a model larger than RAM: runs then simulate the RAM tier (:meth:`run`'s ``ram``), with
    ``disk``'s figures (a disk file name or path, :func:`hybrimoe.policy.hardware.load_disk`; default
    :data:`DEFAULT_DISK`) in the planner's and the truth's cost models, unless a given ``cost_model`` has its own
    (the planner's then, the truth's from ``disk``). None: every expert is in RAM (no disk).

    Raises:
        ValueError: a bad stage, fraction or limit; no model facts (the message names ``-m``, ``--model-facts`` and a
            trace with facts); no tokens of the stage; no prompts left after profiling; a ``core_trace`` whose sizes
            (tokens, layers, top-k, experts, prompts, scores or not) are not the stage's; a bad RAM budget or an
            unknown disk.
    """

    def __init__(self, trace: RoutingTrace, hw: Hardware, budget_spec, stage: str, *, cost_model=None,
                 max_tokens: int = 20000, max_prompts: int = 0, ubatch: int = 512,
                 prefetch_depth: int = PREFETCH_LAYERS,
                 recall: Sequence[float] = _core.DEFAULT_PREDICTOR_RECALL, profile_fraction: float = 0.2, seed: int = 1,
                 facts: Optional[ModelFacts] = None, facts_source: str = "", n_dropped: int = 0,
                 core_trace=None, ram_cache=None, disk: Optional[str] = None, devices: Optional[int] = None,
                 tensor_split: Optional[Sequence[float]] = None, streams: int = 1, draft: int = 0,
                 acceptance=0.7, draft_cost_s: float = 0.0):
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
        self.streams = int(streams)
        if self.streams > 1:
            if stage != "decode":
                raise ValueError(f"streams are concurrent decode streams: stage 'decode', not {stage!r}")
            if core_trace is not None:
                raise ValueError("streams regroup the trace's tokens: give no core_trace")
            # each step one ubatch of the streams' tokens (the simulator's prefill mechanics, ubatch = streams)
            trace = streams_trace(trace, self.streams)
            stage, ubatch = "prefill", self.streams
        self.draft, self.acceptance, self.draft_cost_s, self.emitted = int(draft), acceptance, float(draft_cost_s), None
        if self.draft:
            if stage != "decode" or self.streams > 1:
                raise ValueError(f"draft {draft}: speculative decoding verifies one stream's drafts: stage 'decode' "
                                 f"and one stream, not {stage!r} with {self.streams}")
            if core_trace is not None:
                raise ValueError("draft-and-verify steps regroup the trace's tokens: give no core_trace")
            if not (math.isfinite(self.draft_cost_s) and 0.0 <= self.draft_cost_s <= 100.0):
                raise ValueError(f"draft_cost_s must be in [0, 100] seconds per drafted token, got {draft_cost_s!r}")
            # each step one ubatch of the last accepted token and the drafts (prefill mechanics, ubatch = draft + 1);
            # the profile and the first evaluated step follow the decode tokens' own prompts (below)
            plain = stage_tokens(trace, "decode")
            trace, self.emitted, self.step_prompt = speculative.speculative_trace(plain, self.draft, acceptance,
                                                                                  seed=seed)
            stage, ubatch = "prefill", self.draft + 1
        self.phased = trace.phases is not None
        trace = stage_tokens(trace, stage)
        self.facts_source = facts_source or "given"
        self.n_dropped = int(n_dropped)
        self.trace, self.hw, self.facts, self.stage = trace, hw, facts, stage
        if core_trace is None:
            core_trace = trace.to_core()
        else:
            _check_core_trace(core_trace, trace, stage)
        self.core_trace = core_trace
        self.planner = cost_model if cost_model is not None else cost_model_from_hardware(hw, facts)
        self.truth_cost = cost_model_from_hardware(hw, facts)
        # the truth charges host-memory contention per overlapped second (TruthModel.contention), not the planner's
        # fixed share of each copy
        self.truth_cost.cpu_copy_overlap = 1.0
        self.truth = truth_model_for(hw, seed)
        self.expert_bytes = [float(b) for b in trace.expert_bytes]
        self.total_bytes = float(np.sum(trace.expert_bytes) * trace.num_experts)
        self.budget_spec = budget_spec
        self.n_devices = int(devices if devices is not None else hw.facts.get("gpu_count", 1))
        self.layer_device = layer_devices(int(getattr(trace, "n_dense_layers", 0) or 0), trace.n_layers,
                                          self.n_devices, tensor_split)
        self.shared_link = self.n_devices > 1 and hw.facts.get("gpus_per_link", 1) > 1
        if self.n_devices > 1:
            # each device's budget over its own layers' experts (a size: each device's)
            self.device_budgets = []
            for d in range(self.n_devices):
                mine = float(sum(b for b, x in zip(trace.expert_bytes, self.layer_device) if x == d) *
                             trace.num_experts)
                self.device_budgets.append(parse_budget(budget_spec, mine, float(np.min(trace.expert_bytes)))
                                           if mine > 0 else 0.0)
            self.budget = float(sum(self.device_budgets))
        else:
            self.device_budgets = None
            self.budget = parse_budget(budget_spec, self.total_bytes, float(np.min(trace.expert_bytes)))
        self.ram_spec, self.ram_budget, self.disk = ram_cache, None, None
        if ram_cache is not None:
            self.ram_budget = parse_budget(ram_cache, self.total_bytes, float(np.min(trace.expert_bytes)))
            self.disk = load_disk(disk or DEFAULT_DISK)
            set_disk(self.truth_cost, self.disk)
            if not self.planner.has_disk:
                set_disk(self.planner, self.disk)
        n = trace.n_prompts
        self.first = int(math.floor(profile_fraction * n))
        if self.draft:
            # the profiling prompts are the decode trace's, as plain decode's: the steps from the first step of the
            # first prompt after them are evaluated (a step's first row gives its prompt), and the profile counts
            # the decode tokens of the profiling prompts, each once (not the verified rows: a token may be verified
            # by several steps, and a rejected draft's row is another token's)
            p_first = int(math.floor(profile_fraction * plain.n_prompts))
            self.first = int(np.searchsorted(self.step_prompt, p_first, side="left"))
            self.profile_prompts = (p_first, plain.n_prompts)
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
        # Profile: activations per (layer, expert) over the profiling prompts (with drafting, their decode tokens).
        if self.draft:
            prof = plain.expert_ids[:int(plain.prompt_offsets[p_first])]
        else:
            prof = trace.expert_ids[:int(trace.prompt_offsets[self.first])]
        self.profile = expert_counts(prof, trace.num_experts)
        self.hot_keys = hot_keys_from_counts(self.profile)
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
            if L * E <= np.iinfo(np.int16).max:
                flat = flat.astype(np.int16)  # the same keys; np.unique's stable sort of int16 is a radix sort
            _, at = np.unique(flat, return_index=True)
            used = flat[np.sort(at)].tolist()
            seen = set(used)
            self._first_use = used + [k for k in self.hot_keys if k not in seen]
        return self._first_use

    def clairvoyant_planner(self) -> "_core.CostModel":
        """The cost model a clairvoyant preset plans with: the truth's own costs, with its host-memory contention
        as the planner's copy term (``cpu_copy_overlap = 1 - contention``): a bound knows what time is charged."""
        cm = _core.CostModel()
        for f in COST_FIELDS:
            setattr(cm, f, getattr(self.truth_cost, f))
        cm.cpu_copy_overlap = max(0.0, 1.0 - float(self.truth.contention))
        return cm

    def build(self, name: str, ram: Optional[str] = None):
        """(cache, scheduler, prefetcher, config) of a system preset (:func:`hybrimoe.policy.presets.build_preset`, with
        the profile's hot set; a clairvoyant preset's cache starts with :meth:`first_use_keys`); ValueError on an
        unknown name. With several devices the first three are lists, one entry per device (each cache holds only
        its device's layers). ``ram``: the RAM preset below the GPU cache, whose ``gpu_mrs_alpha``
        (:func:`hybrimoe.policy.presets.gpu_mrs_alpha`) an MRS cache then takes."""
        hot = self.first_use_keys() if _clairvoyant(name) else self.hot_keys
        alpha = gpu_mrs_alpha(ram)
        if name == TS_NCMOE:
            return self._build_ts_ncmoe()
        if self.n_devices > 1:
            parts = []
            for d in range(self.n_devices):
                eb = [b if x == d else 0.0 for b, x in zip(self.expert_bytes, self.layer_device)]
                parts.append(build_preset(name, eb, self.trace.num_experts, self.device_budgets[d], hot_keys=hot,
                                          profile=self.profile.ravel(), mrs_alpha=alpha))
            ps = parts[0]
        else:
            ps = build_preset(name, self.expert_bytes, self.trace.num_experts, self.budget, hot_keys=hot,
                              profile=self.profile.ravel(), mrs_alpha=alpha)
        cfg = _core.SimConfig()
        for f in _RUN_FIELDS:
            setattr(cfg, f, getattr(self.cfg, f))
        cfg.fill_on_miss = ps.fill_on_miss
        if ps.true_routing:
            cfg.recall = [1.0] * max(1, cfg.prefetch_depth)
        if self.n_devices > 1:
            return ([p.cache for p in parts], [p.scheduler for p in parts], [p.prefetcher for p in parts], cfg)
        return ps.cache, ps.scheduler, ps.prefetcher, cfg

    def _build_ts_ncmoe(self):
        if self.n_devices < 2:
            raise ValueError(f"{TS_NCMOE} is a placement over several GPUs; this setup has one (upstream-ncmoe)")
        L, E = self.trace.n_layers, self.trace.num_experts
        fits = lambda n: all(  # noqa: E731
            sum(self.expert_bytes[m] for m in range(n, L) if self.layer_device[m] == d) * E
            <= self.device_budgets[d] * (1 + 1e-12) for d in range(self.n_devices))
        n_cpu = next(n for n in range(L + 1) if fits(n))
        caches, scheds, pres = [], [], []
        for d in range(self.n_devices):
            eb = [b if x == d else 0.0 for b, x in zip(self.expert_bytes, self.layer_device)]
            keys = [m * E + e for m in range(n_cpu, L) if self.layer_device[m] == d for e in range(E)]
            cache = _core.ExpertCache(eb, E, self.device_budgets[d], _core.StaticPolicy(keys, []))
            cache.fill(keys)
            caches.append(cache)
            scheds.append(_core.make_scheduler("upstream-ncmoe", n_cpu))
            pres.append(_core.make_prefetcher("none"))
        cfg = _core.SimConfig()
        for f in _RUN_FIELDS:
            setattr(cfg, f, getattr(self.cfg, f))
        cfg.fill_on_miss = False
        return caches, scheds, pres, cfg

    def simulate(self, cache, sched, pre, planner, cfg, ram_cache=None):
        """One run of the policy core's simulator on these parts (lists, one per device, with several devices)."""
        if self.n_devices > 1:
            devs = [(c, s, p, planner, self.truth_cost) for c, s, p in zip(cache, sched, pre)]
            return _core.simulate_devices(self.core_trace, devs, self.layer_device, self.shared_link, self.truth,
                                          cfg, self.first, self.end, ram_cache)
        return _core.simulate(self.core_trace, cache, sched, pre, planner, self.truth_cost, self.truth, cfg,
                              self.first, self.end, ram_cache)

    def assumptions(self, name: str) -> dict:
        spec = system_preset(name)
        return {
            "predictor_recall": [1.0] * len(self.recall) if spec["true_routing"] else self.recall,
            "router_scores": "trace" if self.trace.has_scores else "none: MRS scores activated experts 1/top_k",
            "truth_model": "seeded log-normal noise, extra CPU start-up, host-memory contention "
                           "(policy.truth_model_for)",
            "profile": (f"first {self.profile_prompts[0]} of {self.profile_prompts[1]} prompts (their decode tokens); "
                        f"evaluated steps {self.first}..{self.end} of {self.trace.n_prompts}" if self.draft else
                        f"first {self.first} of {self.trace.n_prompts} prompts; evaluated prompts "
                        f"{self.first}..{self.end}"),
            "stage_model": self.stage_model(),
            "partial_trace": "yes: the recording was interrupted; its last prompt is simulated as far as it got"
            if self.trace.partial else "no",
            "incomplete_tokens": f"{self.n_dropped} dropped (--drop-incomplete)" if self.n_dropped else "none",
            "model_facts": f"{self.facts.name}: {self.facts_source}",
        }

    def stage_model(self) -> str:
        """How this run's stage uses the trace's tokens (the records' ``assumptions.stage_model``)."""
        if self.draft:
            return speculative.describe(self.draft, self.acceptance, self.draft_cost_s)
        if self.streams > 1:
            return (f"decode in {self.streams} concurrent streams: each step one ubatch of one decode token of every "
                    "active stream; a stream whose prompt ended takes the next prompt (hybrimoe.sim.streams)")
        if self.stage == "decode":
            return ("decode: the decode-phase tokens, one per step, prompt after prompt (prefill-phase tokens left "
                    "out)" if self.phased else "decode: every token of each prompt, one per step (the trace has "
                    "no phases)")
        return (f"prefill: the prefill-phase tokens of each prompt in ubatches of {self.cfg.ubatch} (decode-phase "
                "tokens left out)" if self.phased else f"prefill: every token of each prompt in ubatches of "
                f"{self.cfg.ubatch} (the trace has no phases)")

    def build_ram(self, ram: str):
        """(RAM cache, RamTierConfig) of a RAM-tier preset (:func:`hybrimoe.policy.presets.build_ram_tier`) over
        this setup's RAM budget, starting with the profile's hot set (a clairvoyant one with
        :meth:`first_use_keys`). The disk file's measured facts (:data:`hybrimoe.policy.hardware.DISK_OPTIONAL_FACTS`)
        set the faulting presets' read-around, fault size and decode fault throughput, the queued presets' CPU
        cost per byte read, and each preset's read throughput (``buffered_read_Bps`` for the presets that read
        through the page cache, ``tier_read_Bps`` for hybrimoe's own); the
        model facts' weights outside the routed experts share a faulting preset's page cache.
        ValueError without a RAM budget or on an unknown preset."""
        if self.ram_budget is None:
            raise ValueError("this setup has no RAM tier: give ram_cache (simulate --moe-ram-cache)")
        comp = ram_preset(ram)
        clair = comp["cache"] == "belady"
        facts = self.disk.facts
        faulting = comp["reads"] == "faulting"
        cache, cfg = build_ram_tier(ram, self.expert_bytes, self.trace.num_experts, self.ram_budget,
                                    hot_keys=self.first_use_keys() if clair else self.hot_keys,
                                    profile=self.profile.ravel(), recall=self.recall)
        if faulting:
            # a fault reads its neighbours' pages too (RamTierConfig.read_around), and the weights outside the
            # routed experts share the page cache (RamTierConfig.other_bytes)
            cfg.read_around = facts.get("mmap_read_around", 1.0)
            cfg.fault_bytes = facts.get("mmap_fault_bytes", cfg.fault_bytes)
            cfg.fault_bandwidth_Bps = facts.get("mmap_fault_Bps", 0.0)
            cfg.other_bytes = float(self.facts.moe_layer_other_bytes())
        else:
            cfg.read_cpu_s_per_byte = facts.get("read_cpu_s_per_byte", 0.0)
        # the reads' own throughput: through the page cache (4 KiB pages), or hybrimoe's direct reads into huge pages
        # with its I/O workers in flight (left out of a disk file: the disk's bandwidth)
        cfg.read_bandwidth_Bps = facts.get("buffered_read_Bps" if comp.get("page_cache") else "tier_read_Bps", 0.0)
        cfg.validate()
        return cache, cfg

    def _start_exclusive(self, cache, ram_cache, ram: str) -> None:
        """Exclusive tiers start exclusive: the RAM tier's initial fill (the hot set, :meth:`build_ram`) gives up
        what the GPU cache starts with, and the next hottest experts take the room."""
        L, E = self.trace.n_layers, self.trace.num_experts
        caches = cache if isinstance(cache, list) else [cache]
        on_gpu = [k for k in range(L * E) if any(c.resident(k // E, k % E) for c in caches)]
        for k in on_gpu:
            if ram_cache.resident(k // E, k % E):
                ram_cache.evict(k // E, k % E)
        hot = self.first_use_keys() if ram_preset(ram)["cache"] == "belady" else self.hot_keys
        if hot is not None:
            ram_cache.fill([int(k) for k in hot if not any(c.resident(int(k) // E, int(k) % E) for c in caches)])

    def run(self, name: str, cache=None, sched=None, pre=None, cfg=None, *, enough_s: Optional[float] = None,
            ram: Optional[str] = None) -> dict:
        """Simulates one system preset (or the given components) and returns its JSON record.

        A clairvoyant preset with ``also`` (:data:`hybrimoe.policy.presets.SYSTEM_PRESETS`: ``oracle``) is also run with
        each listed preset's components, and the fastest run is its record (``plan`` names the one kept): with
        perfect routing knowledge the impact prefetcher copies for every true activation it gains on, without
        weighing what the copy evicts or delays on the link, and on some small traces that plan is slower than
        belady's (its predictor's misses copy less), so the bound keeps the better plan. Where a step can activate
        :data:`hybrimoe.policy.presets.STREAMING_FRACTION` of a layer's experts (prefill), its own plan is also run with
        streamed demand loads (``plan`` is then ``oracle+streaming``).

        ``enough_s``: the alternatives stop at the first plan that takes at most this many seconds (a check that the
        bound is at most ``enough_s`` needs no more: the fastest of every plan would be no slower); the record then
        names the plans not run under ``plans_not_run``, and its ``total_s`` is an upper value of the bound.

        ``ram``: a RAM-tier preset (:data:`hybrimoe.policy.presets.RAM_PRESETS`) for a setup with a RAM budget
        (default ``hybrimoe``, ``oracle`` for a clairvoyant ``name``); the record names it (``ram_policy``) and gives
        the RAM tier's figures (``ram_hit_rate``, ``bytes_disk``, ...). Without a RAM budget it must be None."""
        if ram is None and self.ram_budget is not None:
            ram = "oracle" if _clairvoyant(name) else "hybrimoe"
        if ram is not None and self.ram_budget is None:
            raise ValueError(f"RAM preset {ram!r} given, but this setup has no RAM tier (give ram_cache)")
        cache_given = cache
        if cache is None:
            cache, sched, pre, cfg = self.build(name, ram)
            alternatives = system_preset(name).get("also", ()) if name in SYSTEM_PRESETS else ()
        else:
            alternatives = ()
        planner = self.clairvoyant_planner() if _clairvoyant(name) else self.planner
        ram_cache = None
        if ram is not None:
            ram_cache, cfg.ram = self.build_ram(ram)
            if cfg.ram.exclusive:
                self._start_exclusive(cache, ram_cache, ram)
        res = self.simulate(cache, sched, pre, planner, cfg, ram_cache)
        rec, plan = record(name, res, self, ram), name
        # a RAM-tier bound with alternatives keeps its fastest plan, as the GPU tier's oracle does (below)
        for alt in ram_preset(ram).get("also", ()) if ram is not None else ():
            if enough_s is not None and rec["total_s"] <= enough_s:
                rec.setdefault("plans_not_run", []).append(f"ram:{alt}")
                continue
            other = self.run(name, *self.build(name, alt), ram=alt) if cache_given is None else None
            if other is not None and other["total_s"] < rec["total_s"]:
                rec = dict(other, ram_policy=ram, ram_plan=alt)
        for alt in alternatives:
            if not _clairvoyant(alt):
                raise ValueError(f"preset {name!r}: 'also' names {alt!r}, which is not clairvoyant")
        if alternatives:
            # its own plan also with streamed demand loads (ExpertCache.set_streaming_demand), where a step can
            # activate enough experts to stream: Belady's order is usually the better one, but not always
            streams = self.stage == "prefill" or self.trace.top_k >= STREAMING_FRACTION * self.trace.num_experts
            plans = [(a, 0.0) for a in alternatives] + ([(name, STREAMING_FRACTION)] if streams else [])
            for i, (alt, streaming) in enumerate(plans):
                if enough_s is not None and rec["total_s"] <= enough_s:
                    rec["plans_not_run"] = [a + ("+streaming" if st else "") for a, st in plans[i:]]
                    break
                parts = self.build(alt, ram)
                for c in (parts[0] if isinstance(parts[0], list) else [parts[0]]):
                    c.set_streaming_demand(streaming)
                other = self.run(alt, *parts, ram=ram)
                if other["total_s"] < rec["total_s"]:
                    rec, plan = dict(other, policy=name), alt + ("+streaming" if streaming else "")
            rec["plan"] = plan
        return rec


def total_times(trace: RoutingTrace, hw_name: str, budget_spec, stage: str, names: Sequence[str], *,
                max_tokens: int = 20000, seed: int = 1, contention_scale: float = 1.0, core_trace=None,
                bound_tolerance: Optional[float] = None, ram_cache=None, disk: Optional[str] = None,
                gpu_preset: str = "hybrimoe", devices: Optional[int] = None, streams: int = 1) -> dict:
    """Simulated total time of each preset in ``names`` on one configuration: ``{name: seconds}`` (TPOT x tokens in
    decode, TTFT summed over prompts in prefill: :meth:`Setup.run`'s ``total_s``).

    ``hw_name``: a hardware preset (:func:`hybrimoe.policy.hardware.load_hardware`); ``contention_scale`` multiplies the
    truth model's host-memory contention (> 0), to judge the planner under a truth it does not know; ``core_trace``:
    :func:`stage_core_trace` of ``trace`` and ``stage``, when the caller keeps one for many calls. A module-level
    function of picklable arguments, so that a process pool can run a table of configurations.

    ``bound_tolerance`` (>= 0): for a table that checks a bound, not one that reports it. A preset with alternative
    plans (``oracle``, :meth:`Setup.run`) then stops at its first plan that takes at most ``1 + bound_tolerance``
    times the least time of the presets before it in ``names``: its time is then an upper value of the bound, one
    that already shows the bound holds; where no plan gets there every plan is run and its time is the bound.

    ``devices``: GPUs, as :class:`Setup`'s (default the hardware's); ``streams``: concurrent decode streams, as
    :class:`Setup`'s (``core_trace`` must then be None).

    ``ram_cache`` (a RAM budget, as :class:`Setup`'s, with ``disk``): ``names`` are then RAM-tier presets
    (:data:`hybrimoe.policy.presets.RAM_PRESETS`), each run under the GPU tier's ``gpu_preset``, so that only the RAM
    tier differs between them.

    Raises:
        ValueError: as :class:`Setup`, a contention scale <= 0, or a negative bound tolerance.
    """
    if not contention_scale > 0:
        raise ValueError(f"contention scale must be > 0, got {contention_scale}")
    if bound_tolerance is not None and not bound_tolerance >= 0:
        raise ValueError(f"bound tolerance must be >= 0, got {bound_tolerance}")
    s = Setup(trace, load_hardware(hw_name), budget_spec, stage, max_tokens=max_tokens, seed=seed,
              core_trace=core_trace, ram_cache=ram_cache, disk=disk, devices=devices, streams=streams)
    s.truth.contention = contention_scale * s.truth.contention
    times: dict = {}
    for n in names:
        enough = None
        if bound_tolerance is not None and times:
            enough = (1.0 + bound_tolerance) * min(times.values())
        rec = s.run(gpu_preset, enough_s=enough, ram=n) if ram_cache is not None else s.run(n, enough_s=enough)
        times[n] = rec["total_s"]
    return times


def _clairvoyant(name: str) -> bool:
    """Whether ``name`` is a system preset whose cache knows the future (``belady``, ``oracle``)."""
    return name in SYSTEM_PRESETS and bool(system_preset(name)["clairvoyant"])


def record(name: str, res, setup: Setup, ram: Optional[str] = None) -> dict:
    """The JSON record of one run (``ram``: its RAM-tier preset, or None without a RAM tier)."""
    st = res.cache
    tot = max(res.total_s, 1e-30)
    rec = {
        "policy": name,
        "stage": res.stage,
        "hardware": setup.hw.name,
        "devices": setup.n_devices,
        "layer_device": list(setup.layer_device),
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
        "assumptions": setup.assumptions(name) if name in SYSTEM_PRESETS else {},
    }
    if setup.draft:
        # each step verifies draft + 1 rows and emits its accepted drafts and one token of the target's; the drafter's
        # time per drafted token is added to every step
        n = int(res.prompts)
        emitted = int(setup.emitted[setup.first:setup.first + n].sum())
        # the drafts drafted: the verified rows but each step's first (the last accepted token)
        total = res.total_s + (res.tokens - n) * setup.draft_cost_s
        rec.update(stage="decode", draft=setup.draft, draft_cost_s=setup.draft_cost_s, steps=n,
                   acceptance=(float(setup.acceptance) if isinstance(setup.acceptance, numbers.Real)
                               else "recorded"),
                   tokens=emitted, verified_tokens=res.tokens, tokens_per_step=emitted / max(n, 1), total_s=total,
                   tokens_per_s=emitted / total if total > 0 else 0.0, tpot_s=total / max(emitted, 1))
    elif setup.streams > 1:
        # each step decodes one token of every stream: its mean time is each stream's time per token
        rec.update(stage="decode", streams=setup.streams, tpot_s=res.ttft_s)
    elif res.stage == "decode":
        rec["tpot_s"] = res.tpot_s
    else:
        rec["ttft_s"] = res.ttft_s
    if ram is not None:
        rs = res.ram_cache
        tokens = max(int(rec["tokens"]), 1)  # with drafting, the tokens emitted
        rec.update({
            "ram_policy": ram,
            "moe_ram_cache": str(setup.ram_spec),
            "ram_budget_bytes": setup.ram_budget,
            "disk": setup.disk.name,
            "ram_hit_rate": rs.hit_rate,
            "ram_late_rate": rs.late / rs.accesses if rs.accesses else 0.0,
            "bytes_disk": res.bytes_disk,
            "bytes_disk_prefetch": res.bytes_disk_prefetch,
            "bytes_disk_per_token": res.bytes_disk / tokens,
            "disk_reads": res.disk_reads,
            "page_faults": res.page_faults,
            "page_faults_per_token": res.page_faults / tokens,
            "ram_prefetch_issued": res.ram_prefetch_issued,
            "demotions": res.demotions,
            "bytes_demoted": res.bytes_demoted,
            "disk_busy_frac": res.disk_busy_s / tot,
        })
        if name in SYSTEM_PRESETS:
            rec["assumptions"]["ram_tier"] = (
                f"{ram}: {RAM_PRESETS[ram]['about']}; disk {setup.disk.name} (one read per expert, no noise on "
                "disk times)")
    return rec


def cache_hit_rates(setup: Setup, names: Sequence[str] = ("mrs", "lru", "lfu", "reuse", "belady"),
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


def format_table(records: Sequence[dict]) -> str:
    """A markdown table of the records (llama-bench style)."""
    stage = records[0]["stage"] if records else "decode"
    tcol = "tpot_ms" if stage == "decode" else "ttft_ms"
    head = f"| policy | hit rate | {tcol} | tokens/s | GB h2d | CPU busy | GPU busy | link busy | decide us |"
    ram = any("ram_policy" in r for r in records)
    if ram:
        head += " RAM policy | RAM hit rate | MB disk/token | faults/token | disk busy |"
    lines = [head, "|" + "---|" * (14 if ram else 9)]
    for r in records:
        t = (r.get("tpot_s") if stage == "decode" else r.get("ttft_s")) * 1e3
        line = (f"| {r['policy']} | {r['hit_rate']:.3f} | {t:.3f} | {r['tokens_per_s']:.1f} | "
                f"{r['bytes_h2d'] / 1e9:.2f} | {r['cpu_busy_frac']:.2f} | {r['gpu_busy_frac']:.2f} | "
                f"{r['link_busy_frac']:.2f} | {r['decision_us_mean']:.2f} |")
        if ram:
            line += (f" {r.get('ram_policy', '-')} | {r.get('ram_hit_rate', 1.0):.3f} | "
                     f"{r.get('bytes_disk_per_token', 0.0) / 1e6:.2f} | {r.get('page_faults_per_token', 0.0):.1f} | "
                     f"{r.get('disk_busy_frac', 0.0):.2f} |")
        lines.append(line)
    return "\n".join(lines)




def ram_traffic(facts: ModelFacts, ram_cache, *, disk: Optional[str] = None, hw_name: str = "rtx4090-desktop",
                moe_cache="0", n_tokens: int = 1200, seed: int = 0,
                policies: Sequence[str] = ("hybrimoe", "mmap")) -> list[dict]:
    """How much a model reads from disk per token at a RAM budget (``hybrimoe info --moe-ram-cache``): the
    simulator's records (:func:`record`) of each RAM-tier preset in ``policies``, decode then prefill, on a synthetic
    trace of the model's shape (:func:`hybrimoe.traces.synthetic.synthetic_trace`, its default locality: an
    assumption, named in each record's ``assumptions["routing"]``) of ``n_tokens`` tokens, with a GPU cache of
    ``moe_cache`` on ``hw_name``. ``bytes_disk_per_token`` (bytes), ``ram_hit_rate`` and ``page_faults_per_token``
    are the figures; real routing gives other numbers (``hybrimoe trace`` then ``simulate --moe-ram-cache``).

    Raises:
        ValueError: as :class:`Setup` (a bad RAM or GPU budget, an unknown disk or hardware), or bad facts.
    """
    from hybrimoe.traces.synthetic import synthetic_trace

    tr = synthetic_trace(facts, int(n_tokens), seed=seed)
    out = []
    for stage in ("decode", "prefill"):
        s = Setup(tr, load_hardware(hw_name), moe_cache, stage, facts=facts, facts_source="the model's GGUF",
                  ram_cache=ram_cache, disk=disk)
        for name in policies:
            rec = s.run("hybrimoe", ram=name)
            rec.setdefault("assumptions", {})["routing"] = (
                f"synthetic routing of the model's shape ({n_tokens} tokens, hybrimoe.traces.synthetic's default "
                "locality), not the model's own")
            out.append(rec)
    return out
