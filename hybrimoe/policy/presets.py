"""Policy presets: which scheduler, cache and prefetcher a named policy is made of (:data:`SYSTEM_PRESETS`), and
:func:`build_preset`, the one place that turns a preset into policy objects, for the engine and the simulator alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from hybrimoe import _core

#: Each preset: its components (``scheduler``, ``cache``, ``prefetch``, ``fill``), whether its cache is ``static``
#: (filled once, nothing loaded at run time: the placements users run today), whether its prefetcher sees the
#: true routing (``true_routing``) or its cache the future (``clairvoyant``: simulator only), whether it needs a profile
#: of expert frequencies (``needs_profile``: the simulator's profiling prompts, the engine's ``moe_profile``),
#: ``about`` (what it does) and ``source`` (the system or document whose behaviour it reproduces). A clairvoyant
#: preset may name other clairvoyant presets in ``also``: the simulator runs each and reports the fastest plan
#: (hybrimoe.sim.simulator.Setup.run), since a planner that knows the routing can time every plan before choosing.
#: ``streaming``: demand loads of a (layer, ubatch) whose router activated at least this fraction of the layer's
#: experts enter the cache on probation (:meth:`hybrimoe._core.ExpertCache.set_streaming_demand`; LIP insertion,
#: Qureshi et al., ISCA 2007): in a large prefill ubatch every resident is needed again at its layer's next visit,
#: so a demand load should reuse the slot of the previous one instead of evicting a resident. A decode token
#: activates top_k of the experts (at most a quarter in the shapes of hybrimoe.model.facts), so it never streams.
STREAMING_FRACTION = 0.5
SYSTEM_PRESETS = {
    "hybrimoe": dict(scheduler="hybrimoe", cache="mrs", prefetch="impact", fill=True, true_routing=False,
                     static=False, clairvoyant=False, needs_profile=False, admission="tinylfu",
                     streaming=STREAMING_FRACTION,
                     about="HybriMoE split + MRS cache (TinyLFU admission; demand loads of a ubatch that "
                           "activates half a layer's experts or more enter at the lowest eviction rank, LIP) + "
                           "impact-driven prefetch",
                     source="Zhong et al., HybriMoE, arXiv:2504.05897, §IV.B-D (docs/design.md §2-§4)"),
    "hybrimoe-lru": dict(scheduler="hybrimoe", cache="lru", prefetch="impact", fill=True, true_routing=False,
                         static=False, clairvoyant=False, needs_profile=False, admission="tinylfu",
                     streaming=STREAMING_FRACTION,
                         about="HybriMoE split + LRU cache (TinyLFU admission; demand loads of a ubatch that "
                               "activates half a layer's experts or more enter at the lowest eviction rank, LIP) + "
                               "impact-driven prefetch",
                         source="HybriMoE §IV.D's LRU comparison (MRS replaced by LRU)"),
    "hybrimoe-reuse": dict(scheduler="hybrimoe", cache="reuse", prefetch="impact", fill=True, true_routing=False,
                           static=False, clairvoyant=False, needs_profile=False, admission="priority",
                           streaming=STREAMING_FRACTION, opt_in=True,
                           about="HybriMoE split + a cache that predicts reuse (an online logistic regression of "
                                 "'used within the next 4 visits of its layer' over MRS scores at three rates, use "
                                 "now, recency and which experts follow the ones just used; in ubatches of at most 4 "
                                 "tokens a prefetch or fill enters when its predicted reuse is at least its "
                                 "victim's, TinyLFU admission and LIP streaming in larger ones) + impact-driven "
                                 "prefetch",
                           source="docs/design.md §4 (reuse prediction): online logistic regression by SGD "
                                  "(Bottou 2010) over HybriMoE §IV.D's MRS scores"),
    "ktransformers": dict(scheduler="ktransformers", cache="static-leading-layers", prefetch="none", fill=False,
                          true_routing=False, static=True, clairvoyant=False, needs_profile=False,
                          about="the experts of the leading MoE layers resident (as many whole layers as fit), "
                                "every other expert on the CPU, nothing loaded at run time",
                          source="the HybriMoE authors' kTransformers optimize rules (Qwen2-25%.yaml and siblings "
                                 "in their repository) keep whole leading layers' experts on the GPU; the rule "
                                 "files are not in this repository: the layer choice follows a description of "
                                 "them, not the files"),
    "hot-set": dict(scheduler="ktransformers", cache="static-frequency", prefetch="none", fill=False,
                    true_routing=False, static=True, clairvoyant=False, needs_profile=True,
                    about="a static set of the most frequently routed experts of a profile resident, every other "
                          "expert on the CPU, nothing loaded at run time",
                    source="docs/design.md §5: the 'kTransformers-style' baseline, a static hot set chosen by "
                           "profiled frequency (the comparison point of HybriMoE, arXiv:2504.05897, §V)"),
    "upstream-ncmoe": dict(scheduler="upstream-ncmoe", cache="static-layers", prefetch="none", fill=False,
                           true_routing=False, static=True, clairvoyant=False, needs_profile=False,
                           about="llama.cpp --n-cpu-moe: the last MoE layers' experts resident (as many whole "
                                 "layers as fit), the rest on the CPU",
                           source="upstream llama.cpp --n-cpu-moe N (common/arg.cpp of the pinned tree: the "
                                  "experts of the first N layers stay on the CPU)"),
    "gpu-on-demand": dict(scheduler="gpu-on-demand", cache="lru", prefetch="none", fill=False, true_routing=False,
                          static=False, clairvoyant=False, needs_profile=False,
                          about="every expert on GPU, LRU cache, load on demand",
                          source="GPU-only on-demand loading as in AdapMoE and MoE-Infinity (arXiv:2401.14361); "
                                 "docs/design.md §5"),
    "belady": dict(scheduler="hybrimoe", cache="belady", prefetch="impact", fill=True, true_routing=False,
                   static=False, clairvoyant=True, needs_profile=False,
                   about="bound: hybrimoe with a clairvoyant (Belady, bypass) cache",
                   source="Belady's MIN with bypass (docs/design.md §5 bounds)"),
    "oracle": dict(scheduler="exhaustive", cache="belady", prefetch="impact", fill=True, true_routing=True,
                   static=False, clairvoyant=True, needs_profile=False, also=("belady",),
                   about="bound: clairvoyant cache + exhaustive split + oracle prefetch, or belady's plan where "
                         "that is faster (a planner that knows the routing can simulate both and keep the better)",
                   source="docs/design.md §5 bounds"),
}
#: the presets the engine runs: those that need no knowledge of the future routing
ENGINE_PRESETS = tuple(n for n, s in SYSTEM_PRESETS.items() if not s["clairvoyant"])
#: engine presets a comparison runs only when named (``opt_in``: not yet shown at least as good as ``hybrimoe`` in
#: every row of the never-worse table)
OPT_IN_PRESETS = tuple(n for n in ENGINE_PRESETS if SYSTEM_PRESETS[n].get("opt_in", False))
#: the presets that need a profile of expert frequencies (the engine's ``moe_profile``)
PROFILE_PRESETS = tuple(n for n, s in SYSTEM_PRESETS.items() if s["needs_profile"])
#: the static placements (``static``): what hybrimoe must never be slower than (the never-worse table)
STATIC_PRESETS = tuple(n for n, s in SYSTEM_PRESETS.items() if s["static"])
DEFAULT_PRESET = "hybrimoe"


def system_preset(name: str) -> dict:
    """The component names of a system preset; ValueError naming an unknown preset."""
    if name not in SYSTEM_PRESETS:
        raise ValueError(f"unknown policy preset '{name}' (known: {', '.join(SYSTEM_PRESETS)})")
    return dict(SYSTEM_PRESETS[name])


@dataclass
class PolicySet:
    """The policy objects of one run (hybrimoe._core): cache, scheduler and prefetcher, whether CPU-computed misses
    are offered to the cache as fills, whether the prefetcher is shown the true routing (``true_routing``), and a
    name."""

    cache: object
    scheduler: object
    prefetcher: object
    fill_on_miss: bool
    name: str
    true_routing: bool = False


def leading_layers_that_fit(expert_bytes: Sequence[float], n_experts: int, budget_bytes: float) -> int:
    """How many whole leading MoE layers (0, 1, ...) fit in ``budget_bytes``: layer l takes ``n_experts *
    expert_bytes[l]`` bytes (``expert_bytes``: bytes of one expert per MoE layer), counted from layer 0 until the
    next layer no longer fits. The ``ktransformers`` preset keeps these layers' experts resident."""
    n, used = 0, 0.0
    for b in expert_bytes:
        need = float(b) * int(n_experts)
        if n_experts <= 0 or used + need > budget_bytes * (1 + 1e-12):
            break
        used += need
        n += 1
    return n


def build_preset(spec: Union[str, dict], expert_bytes: Sequence[float], n_experts: int, budget_bytes: float, *,
                 prefetch: bool = True, hot_keys: Optional[Sequence[int]] = None,
                 profile: Optional[Sequence[float]] = None, name: Optional[str] = None,
                 mrs_alpha: Optional[float] = None) -> PolicySet:
    """Builds the policies of a system preset (:data:`SYSTEM_PRESETS`) or of a dict of components: the one place
    that gives a preset its meaning, for the engine (:func:`hybrimoe.runtime.setup.build_policies`) and the simulator
    (:class:`hybrimoe.sim.simulator.Setup`) alike.

    ``spec``: a preset name or a dict with keys ``scheduler``, ``cache``, ``prefetch`` (names as in
    ``hybrimoe._core.make_*``, or policy objects), ``fill`` (bool), ``admission`` (``"none"``, the default for
    dicts, ``"tinylfu"``: :meth:`hybrimoe._core.ExpertCache.set_frequency_admission`, which the ``hybrimoe``
    presets use, or ``"priority"``: that in prefill and
    :meth:`hybrimoe._core.ExpertCache.set_priority_admission` in decode, which ``hybrimoe-reuse`` uses) and
    ``streaming`` (0, the default for dicts, or a fraction of a layer's experts: :data:`STREAMING_FRACTION`,
    :meth:`hybrimoe._core.ExpertCache.set_streaming_demand`). ``expert_bytes``: bytes of one expert per MoE layer
    (the engine passes its slot size for every layer); ``budget_bytes``: the GPU cache budget, bytes.
    ``prefetch=False`` replaces the prefetcher with none (prefetch depth 0). ``hot_keys``: keys ``layer *
    n_experts + expert`` hottest first (:func:`hot_keys_from_counts`), from a profile (the simulator's profiling
    prompts, the engine's ``moe_profile``); ``profile``: the counts per key (flat ``[moe_layers * experts]``), the
    static hot set's priorities. ``mrs_alpha``: an ``mrs`` cache named by the preset weighs the newest scores so
    (default: MRSPolicy's, the paper's 0.5); the GPU cache above an exclusive RAM tier takes the RAM preset's
    ``gpu_mrs_alpha`` (:func:`gpu_mrs_alpha`).

    Caches: ``static-leading-layers`` (``ktransformers``) holds the experts of the leading MoE layers, as many
    whole layers as fit (:func:`leading_layers_that_fit`); ``static-layers`` (``upstream-ncmoe``) the last ones,
    like upstream's ``--n-cpu-moe``; ``static-frequency`` (``hot-set``) the hottest ``hot_keys`` that fit and
    needs them. These three start filled and never change (the profile is not used by the layer caches).
    Adaptive caches (MRS, LRU, LFU, ...) start filled with ``hot_keys`` when given, else empty.

    Raises:
        ValueError: unknown preset, component or dict key; a ``static-frequency`` cache without ``hot_keys``.
    """
    if isinstance(spec, str):
        comp = system_preset(spec)
        name = name or spec
    elif isinstance(spec, dict):
        unknown = set(spec) - {"scheduler", "cache", "prefetch", "fill", "admission", "streaming"}
        if unknown:
            raise ValueError(f"policy dict has unknown keys {sorted(unknown)} (scheduler, cache, prefetch, fill, "
                             "admission, streaming)")
        if spec.get("admission", "none") not in ("none", "tinylfu", "priority"):
            raise ValueError(f"policy dict: unknown admission {spec['admission']!r} (none, tinylfu, priority)")
        if not isinstance(spec.get("fill", True), bool):
            raise ValueError(f"policy dict: fill must be True or False, got {spec['fill']!r}")
        st = spec.get("streaming", 0.0)
        if isinstance(st, bool) or not isinstance(st, (int, float)) or not 0.0 <= st <= 1.0:
            raise ValueError(f"policy dict: streaming must be a fraction of the experts within 0..1, got {st!r}")
        comp = dict(SYSTEM_PRESETS[DEFAULT_PRESET])
        comp.update(spec)
        # not inherited: they belong to the preset's cache
        comp["admission"] = spec.get("admission", "none")
        comp["streaming"] = float(st)
        name = name or "custom"
    else:
        raise ValueError(f"a policy preset must be a name or a dict, not {type(spec).__name__}")
    L, E = len(expert_bytes), int(n_experts)
    eb = [float(b) for b in expert_bytes]
    # the layers this cache may hold (expert bytes 0: another device's layers, or dense) and one slot's bytes
    held = [layer for layer in range(L) if eb[layer] > 0]
    unit = max(eb) if eb else 0.0
    fill = bool(comp.get("fill", True))
    n_cpu_layers = 0
    c = comp["cache"]
    if isinstance(c, _core.CachePolicy):
        cache = _core.ExpertCache(eb, E, budget_bytes, c)
    elif c == "static-layers":
        # the last layers it holds that fit (upstream's --n-cpu-moe keeps the first layers' experts on the CPU); the
        # scheduler runs every layer before them on the CPU (one device's layers are contiguous under llama.cpp's
        # layer split)
        n_gpu_layers = min(len(held), int(budget_bytes // (unit * E))) if E and budget_bytes > 0 and unit > 0 else 0
        gpu_layers = held[len(held) - n_gpu_layers:]
        n_cpu_layers = gpu_layers[0] if gpu_layers else L
        keys = [layer * E + e for layer in gpu_layers for e in range(E)]
        cache = _core.ExpertCache(eb, E, budget_bytes, _core.StaticPolicy(keys, []))
        cache.fill(keys)
    elif c == "static-leading-layers":
        n_gpu_layers = leading_layers_that_fit(eb, E, budget_bytes) if budget_bytes > 0 else 0
        keys = [layer * E + e for layer in range(n_gpu_layers) if eb[layer] > 0 for e in range(E)]
        cache = _core.ExpertCache(eb, E, budget_bytes, _core.StaticPolicy(keys, []))
        cache.fill(keys)
    elif c == "static-frequency":
        if hot_keys is None:
            raise ValueError(f"'{name}': the static-frequency cache (a profiled hot set) needs a profile of expert "
                             "frequencies (hot_keys: the engine's moe_profile, --moe-profile TRACE.npz), and none was "
                             "given")
        n_fit = int(budget_bytes // unit) if budget_bytes > 0 and unit > 0 else 0
        keys = [int(k) for k in hot_keys if eb[int(k) // E] > 0][:n_fit]
        prio = [float(profile[k]) for k in keys] if profile is not None else []
        cache = _core.ExpertCache(eb, E, budget_bytes, _core.StaticPolicy(keys, prio))
        cache.fill(keys)
    else:
        policy = (_core.MRSPolicy(alpha=float(mrs_alpha)) if c == "mrs" and mrs_alpha is not None else
                  _core.make_cache_policy(str(c)))
        cache = _core.ExpertCache(eb, E, budget_bytes, policy)
        if hot_keys is not None and budget_bytes > 0:
            cache.fill([int(k) for k in hot_keys if eb[int(k) // E] > 0])
    if comp.get("admission", "none") == "tinylfu":
        cache.set_frequency_admission(True)
    elif comp.get("admission", "none") == "priority":
        cache.set_frequency_admission(True)
        cache.set_priority_admission(True)
    if comp.get("streaming", 0.0):
        cache.set_streaming_demand(float(comp["streaming"]))
    sched = comp["scheduler"]
    if not isinstance(sched, _core.SchedulePolicy):
        sched = _core.make_scheduler(str(sched), n_cpu_layers)
    pre = comp["prefetch"]
    if not isinstance(pre, _core.PrefetchPolicy):
        pre = _core.make_prefetcher(str(pre) if prefetch else "none")
    return PolicySet(cache=cache, scheduler=sched, prefetcher=pre, fill_on_miss=fill, name=name,
                     true_routing=bool(comp.get("true_routing", False)))


#: MRS's weight of the newest scores (alpha in S <- alpha * s + (1 - alpha) * S, HybriMoE §IV.D) in the RAM tier's
#: hybrimoe presets. The GPU cache keeps the paper's 0.5; the RAM tier, several times larger, holds an expert over a
#: longer reuse distance, and a score that forgets in two tokens ranks it by noise there. Chosen on the three-tier
#: never-worse table (bench/bench_never_worse.py --ram-caches; docs/benchmarks.md): 0.5 left the RAM tier below a
#: static hot set on the GPU over it on stationary (low-locality) routing; 0.1 gained on every trace but the
#: high-locality Mixtral shape (1-2%); 0.03 lost on the high-locality shapes.
RAM_MRS_ALPHA = 0.1
#: MRS's alpha in the GPU cache above an exclusive RAM tier (RAM preset ``hybrimoe-exclusive``'s ``gpu_mrs_alpha``).
#: There the GPU and RAM caches hold one hierarchy's experts, and an expert the GPU cache lets go for a recent one may
#: come back from the disk: on stationary routing the paper's 0.5, which forgets in two tokens, kept a GPU set
#: worse than a profiled static hot set (the disk busy 89% of the run, 2% more bytes read: Mixtral-shaped routing,
#: RAM 25%). Chosen on the three-tier never-worse table (bench/bench_never_worse.py --ram-caches; docs/benchmarks.md):
#: 0.3, 0.2 and 0.1 changed those rows by under 0.7%, 0.03 left one at 0.988x, 0.01 every row at 0.993x or more.
GPU_OVER_EXCLUSIVE_RAM_MRS_ALPHA = 0.01
#: MRS's alpha in an exclusive RAM tier (``hybrimoe-exclusive``'s ``mrs_alpha``). Below a GPU cache that keeps the
#: most frequently routed experts, the RAM tier ranks the next ones, whose frequencies differ less: at 0.1 (a memory
#: of about 10 tokens) it ranked them by noise on stationary routing, and the two tiers together held a set worse
#: than a profiled static hot set on the GPU over the inclusive tier (0.993x on Mixtral-shaped low-locality routing,
#: RAM 25%). Chosen on the three-tier never-worse table (decode, 63 rows): 0.03 lost 1% on high-locality
#: Qwen-shaped routing (0.990x), 0.05 left every row at 1.006x or more; starting the scores from the profile as well
#: gained nothing more.
EXCLUSIVE_RAM_MRS_ALPHA = 0.05
#: The RAM tier's presets, for a model larger than host RAM: which experts stay in RAM (``cache``: a cache policy
#: name, or ``static-frequency`` for a profiled hot set) and how the others arrive from the model file (``reads``:
#: ``queued`` pread reads that the work needing an expert waits for, or ``faulting`` mmap page faults on the thread
#: that touches the expert; ``keep``: read experts are offered to the RAM cache; ``lookahead``: MoE layers whose
#: predicted experts are read ahead; ``ready_first``: the CPU share runs the experts already in RAM first;
#: ``exclusive``: the GPU and RAM tiers hold different experts (demotion of the GPU's evictions);
#: ``streaming``: as the GPU presets', for reads; ``true_routing``: the look-ahead sees the true routing, a bound;
#: ``also``: a bound's alternative plans, the fastest kept; ``page_cache``: its reads go through the page cache
#: (a mapping's faults, preads that warm it), not direct; ``mrs_alpha``: an MRS cache's weight of the newest
#: scores, :data:`RAM_MRS_ALPHA`; ``gpu_mrs_alpha``: the alpha of a GPU cache above this tier
#: (:data:`GPU_OVER_EXCLUSIVE_RAM_MRS_ALPHA`); ``admission``: ``"tinylfu"``, frequency admission of reads ahead and
#: demotions, as the GPU presets'). :class:`hybrimoe._core.RamTierConfig` holds the same fields for the simulator.
#: ``baseline``: a system users run today, which hybrimoe must not be slower than.
RAM_PRESETS = {
    "hybrimoe": dict(cache="mrs", reads="queued", keep=True, lookahead=3, ready_first=True, true_routing=False,
                     baseline=False, streaming=STREAMING_FRACTION, mrs_alpha=RAM_MRS_ALPHA, admission="tinylfu",
                     about="MRS RAM cache (reads for a ubatch that activates half a layer's experts or more enter "
                           "at the lowest eviction rank, LIP); the router look-ahead reads the next 3 MoE layers' "
                           "predicted experts while this layer computes; the CPU runs the experts already in RAM "
                           "first",
                     source="HybriMoE's cache (§IV.D) and impact-driven prefetch (§IV.C) applied to the tier below "
                            "the GPU (docs/design.md §17)"),
    "hybrimoe-exclusive": dict(cache="mrs", reads="queued", keep=True, lookahead=3, ready_first=True,
                               true_routing=False, baseline=False, streaming=STREAMING_FRACTION, exclusive=True,
                               mrs_alpha=EXCLUSIVE_RAM_MRS_ALPHA, admission="tinylfu",
                               gpu_mrs_alpha=GPU_OVER_EXCLUSIVE_RAM_MRS_ALPHA,
                               about="hybrimoe's RAM tier with exclusive tiers: an expert loaded to the GPU gives up "
                                     "its RAM slot, and one the GPU cache evicts is copied back into RAM (device to "
                                     "host) when it ranks at least as high as the RAM tier's victim (the engine's "
                                     "moe_ram_exclusive)",
                               source="exclusive caching in multi-level hierarchies (demotion: Wong and Wilkes, "
                                      "USENIX ATC 2002), applied to the GPU and RAM tiers (docs/design.md §17)"),
    "hybrimoe-reuse": dict(cache="reuse", reads="queued", keep=True, lookahead=3, ready_first=True, true_routing=False,
                           baseline=False, streaming=STREAMING_FRACTION, admission="tinylfu",
                           about="hybrimoe's RAM tier with the reuse-predicting cache (the engine's "
                                 "moe_ram_policy='reuse')",
                           source="docs/design.md §4 (reuse prediction), one tier down"),
    "mmap": dict(cache="lru", reads="faulting", keep=True, lookahead=0, ready_first=False, true_routing=False,
                 baseline=True, page_cache=True,
                 about="upstream llama.cpp's mmap: the kernel's page cache of the same RAM (LRU), a routed expert "
                       "not in it faults in 128 KiB at a time on the thread that touches it",
                 source="upstream llama.cpp src/llama-mmap.cpp (the file mapped, read by page faults); Linux's "
                        "default read_ahead_kb 128"),
    "hot-set": dict(cache="static-frequency", reads="faulting", keep=False, lookahead=0, ready_first=False,
                    true_routing=False, baseline=True, page_cache=True,
                    about="the profile's most frequently routed experts pinned in RAM (mlock), every other expert "
                          "faulted in from the file at each use",
                    source="a static hot set, as the GPU tier's hot-set preset (docs/design.md §5), one tier down"),
    "prefetch-at-use": dict(cache="lru", reads="queued", keep=True, lookahead=0, ready_first=False,
                            true_routing=False, baseline=True, page_cache=True,
                            about="a page cache of the same RAM (LRU); once a layer's router ran, I/O workers read "
                                  "its selected experts that are not in RAM, in parallel, and compute waits for "
                                  "each",
                            source="ik_llama.cpp --prefetch-experts (pread workers warm the page cache with the "
                                   "experts the router selected, at the layer that uses them)"),
    "oracle": dict(cache="belady", reads="queued", keep=True, lookahead=3, ready_first=True, true_routing=True,
                   baseline=False, also=("lookahead-oracle",),
                   about="bound: a clairvoyant (Belady) RAM cache and a look-ahead that knows the routing, or "
                         "lookahead-oracle's plan where that is faster",
                   source="docs/design.md §5 bounds, one tier down"),
    "lookahead-oracle": dict(cache="mrs", reads="queued", keep=True, lookahead=3, ready_first=True,
                             true_routing=True, baseline=False, streaming=STREAMING_FRACTION,
                             mrs_alpha=RAM_MRS_ALPHA, admission="tinylfu",
                             about="bound: hybrimoe's RAM tier with a look-ahead that knows the routing (where "
                                   "reads ahead fill the RAM, Belady's bypass can keep out what they would bring)",
                             source="docs/design.md §5 bounds, one tier down"),
}
#: the RAM presets of systems users run today (the never-worse table's baselines for the RAM tier)
RAM_BASELINES = tuple(n for n, s in RAM_PRESETS.items() if s["baseline"])


def ram_preset(name: str) -> dict:
    """The components of a RAM-tier preset (:data:`RAM_PRESETS`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in RAM_PRESETS:
        raise ValueError(f"unknown RAM-tier preset {name!r} (known: {', '.join(RAM_PRESETS)})")
    return RAM_PRESETS[name]


def gpu_mrs_alpha(ram: Optional[str]) -> Optional[float]:
    """The MRS alpha of a GPU cache above the RAM preset ``ram`` (its ``gpu_mrs_alpha``), or None (the GPU preset's
    own) without a RAM tier (``ram`` None) or where the preset names none. ValueError for an unknown preset."""
    return None if ram is None else ram_preset(ram).get("gpu_mrs_alpha")


def ram_cache_policy_of(name: str) -> "_core.CachePolicy":
    """A fresh cache policy object of the RAM preset ``name`` (:data:`RAM_PRESETS`): MRS with the preset's
    ``mrs_alpha`` (:data:`RAM_MRS_ALPHA`) where it names one, else ``hybrimoe._core.make_cache_policy`` of its
    ``cache``. ValueError for an unknown preset or a static hot set (built from a profile, not named)."""
    comp = ram_preset(name)
    if comp["cache"] == "static-frequency":
        raise ValueError(f"RAM preset {name!r}: a static hot set is built from a profile (build_ram_tier)")
    if comp["cache"] == "mrs" and "mrs_alpha" in comp:
        return _core.MRSPolicy(alpha=float(comp["mrs_alpha"]))
    return _core.make_cache_policy(comp["cache"])


def build_ram_tier(name: str, expert_bytes: Sequence[float], n_experts: int, budget_bytes: float, *,
                   hot_keys: Optional[Sequence[int]] = None, profile: Optional[Sequence[float]] = None,
                   lookahead: Optional[int] = None, recall: Optional[Sequence[float]] = None,
                   policy: Optional["_core.CachePolicy"] = None):
    """The RAM tier of a preset (:data:`RAM_PRESETS`): ``(cache, config)``, an :class:`hybrimoe._core.ExpertCache`
    of ``budget_bytes`` (bytes of host RAM for routed experts) over ``expert_bytes`` (bytes of one expert per MoE
    layer) and its :class:`hybrimoe._core.RamTierConfig`. The cache starts filled with ``hot_keys`` (keys ``layer *
    n_experts + expert``, hottest first) as the GPU tier's adaptive caches do; ``static-frequency`` needs them.
    ``lookahead`` overrides the preset's depth (0: none); ``recall``: the look-ahead predictor's recall per
    distance (a preset with ``true_routing`` uses 1). ``policy``: a cache policy object in place of the preset's
    (the engine's ``moe_ram_policy``); the preset's admission and streaming still apply.

    Raises:
        ValueError: an unknown preset, a static hot set without ``hot_keys`` or with a ``policy``, a bad budget (as
            ExpertCache).
    """
    comp = ram_preset(name)
    eb = [float(b) for b in expert_bytes]
    if policy is not None and comp["cache"] == "static-frequency":
        raise ValueError(f"RAM preset {name!r} is a static hot set: it takes no cache policy")
    if comp["cache"] == "static-frequency":
        if hot_keys is None:
            raise ValueError(f"RAM preset {name!r}: a static hot set needs a profile of expert frequencies "
                             "(hot_keys)")
        keys = [int(k) for k in hot_keys]
        prio = [float(profile[k]) for k in keys] if profile is not None else []
        cache = _core.ExpertCache(eb, int(n_experts), float(budget_bytes), _core.StaticPolicy(keys, prio))
    else:
        cache = _core.ExpertCache(eb, int(n_experts), float(budget_bytes),
                                  policy if policy is not None else ram_cache_policy_of(name))
    if hot_keys is not None and budget_bytes > 0:
        cache.fill([int(k) for k in hot_keys])
    if comp.get("admission", "none") == "tinylfu":
        cache.set_frequency_admission(True)
    elif comp.get("admission", "none") == "priority":
        cache.set_frequency_admission(True)
        cache.set_priority_admission(True)
    if comp.get("streaming", 0.0):
        cache.set_streaming_demand(float(comp["streaming"]))
    cfg = _core.RamTierConfig()
    cfg.reads = comp["reads"]
    cfg.keep = bool(comp["keep"])
    cfg.lookahead = int(comp["lookahead"] if lookahead is None else lookahead)
    cfg.ready_first = bool(comp["ready_first"])
    cfg.exclusive = bool(comp.get("exclusive", False))
    if comp["true_routing"]:
        cfg.recall = [1.0] * max(1, cfg.lookahead)
    elif recall is not None:
        cfg.recall = [float(r) for r in recall]
    cfg.validate()
    return cache, cfg
