"""Set-up of the hybrid CPU+GPU MoE engine (``hybrimoe._engine.Engine``) for a model and the user's options.

:class:`EngineSetup` is the one place where ``hybrimoe.Llama(..., moe_cache=..., moe_policy=...,
moe_prefetch_layers=..., moe_cost_model=...)`` (and ``hybrimoe run --moe-cache ...``) become an engine: model facts
from the GGUF (expert sizes per layer and matrix, routers for prefetch prediction), the slot count from the cache
budget (or, for ``"auto"``, from the device memory left after the model loaded), the policies (presets built by
:func:`hybrimoe.policy.presets.build_preset`, or Python objects), the device and the planner's cost model (a hardware
file, a JSON file, a stored calibration, or one measured at first use on the loaded model).
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from hybrimoe import _core, _ggml
from hybrimoe.envs import (
    AUTO_MARGIN_FRACTION,
    AUTO_MARGIN_MIN_BYTES,
    PREFETCH_LAYERS,
    max_buffer_bytes,
    ram_direct_io,
    ram_repack,
    ram_two_pass,
)
from hybrimoe.model.tables import EXPS_REGEX
from hybrimoe.policy.budget import parse_budget
from hybrimoe.policy.hardware import resolve_cost_model
from hybrimoe.policy.presets import (
    DEFAULT_PRESET,
    ENGINE_PRESETS,
    SYSTEM_PRESETS,
    PolicySet,
    build_preset,
    build_ram_tier,
    gpu_mrs_alpha,
    ram_cache_policy_of,
)
from hybrimoe.policy.profile import expert_counts, hot_keys_from_counts
from hybrimoe.runtime.devices import budget_list, device_slots, engine_devices
from hybrimoe.runtime.engine_facts import EngineFacts, engine_facts, engine_module
from hybrimoe.traces.format import load_trace

#: what a cache with slots needs, said once for the set-up's early check and the engine's own
_NO_ACCELERATOR = (f"needs an accelerator ({_ggml.ACCELERATOR_KINDS}, or a ggml RPC server via rpc_servers, --rpc); "
                   "none was found. Without one the engine runs every expert on the CPU: moe_cache=0 (--moe-cache 0), "
                   "or moe_ram_cache alone (--moe-ram-cache) for a model larger than RAM")


def require_accelerator(device: Optional[int], n_slots: Optional[int], what: str = "moe_cache (--moe-cache)") -> None:
    """The one accelerator rule: a cache with slots (``n_slots`` > 0, or None: ``"auto"``) needs a device.

    Raises:
        ValueError: no device for such a cache (``what`` names the option).
    """
    if (n_slots is None or n_slots > 0) and not device:
        raise ValueError(f"{what} {_NO_ACCELERATOR}")


def cache_slots(spec, facts: EngineFacts) -> int:
    """Number of GPU expert slots for a ``moe_cache`` budget (``"auto"`` is sized once the model is loaded:
    :meth:`EngineSetup.with_auto_slots`).

    ``spec``: ``"25%"`` (of the model's routed experts: 100% = a slot for every expert), ``"3GiB"``, ``"512MB"``, or
    bytes (int). 0 is valid (nothing cached). A byte budget is rounded down to whole slots of ``facts.slot_bytes``
    (a slot fits the largest expert of the model, so mixed quant types need a little more than the file's expert
    bytes) and capped at one slot per expert.

    Raises:
        ValueError: unparsable, negative, above 100%, or positive but smaller than one slot.
    """
    sb = facts.slot_bytes
    n_all = len(facts.moe_layers) * facts.n_expert
    try:
        b = parse_budget(spec, float(n_all * sb), sb)
    except ValueError as e:  # a number between 0 and 1 is refused there with the percentage it meant
        raise ValueError(f"moe_cache: {e}") from None
    return min(n_all, int(b // sb + 1e-9))


def resolve_engine_cost_model(spec, facts: EngineFacts) -> "_core.CostModel":
    """The planner's cost model for an engine's model (:func:`hybrimoe.policy.hardware.resolve_cost_model` on
    ``facts.model``); the same errors."""
    return resolve_cost_model(spec, facts.model)


def load_profile(spec, facts: EngineFacts) -> tuple[Optional[np.ndarray], str]:
    """The engine's profile of expert frequencies (``moe_profile``) and a line saying where it came from.

    ``spec``: None (no profile: ``(None, "")``); a routing trace file (``.npz``, as ``hybrimoe trace -o FILE``
    writes, any format version :func:`hybrimoe.traces.format.load_trace` reads): the activations of each (MoE layer,
    expert) over all its tokens, prefill and decode alike, incomplete tokens (ids -1, repeated ids, scores that are
    not finite) left out and counted in the line; or an array-like of counts ``[moe_layers, experts]`` (finite,
    >= 0). Returns float64 counts ``[len(facts.moe_layers), facts.n_expert]``.

    Raises:
        FileNotFoundError: a trace file that does not exist.
        ValueError: an unreadable or invalid trace (named); a trace or array whose MoE layer count or expert count
            is not the model's (both shapes named); no complete token in the trace; negative or non-finite
            counts; an integer (profiling the first N routed tokens online is not implemented) or another type.
    """
    if spec is None:
        return None, ""
    L, E = len(facts.moe_layers), int(facts.n_expert)
    model_shape = f"the model {facts.path} has {L} MoE layers x {E} experts"
    if isinstance(spec, (bool, int, np.integer)):
        raise ValueError(f"moe_profile={spec!r}: profiling the first N routed tokens online is not implemented; give "
                         "a routing trace file (hybrimoe trace -o FILE.npz) or an array of counts [MoE layers, "
                         "experts]")
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        try:
            tr = load_trace(path, facts=facts.model, check_tokens=False)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"moe_profile: {e}") from None
        except ValueError as e:
            raise ValueError(f"moe_profile: {e}") from None
        if (tr.n_layers, tr.num_experts) != (L, E):
            raise ValueError(f"moe_profile {path}: the trace has {tr.n_layers} MoE layers x {tr.num_experts} "
                             f"experts; {model_shape}")
        tr, dropped = tr.drop_incomplete()
        if tr.n_tokens == 0:
            raise ValueError(f"moe_profile {path}: no complete token to count ({dropped} incomplete)")
        counts = expert_counts(tr.expert_ids, E)
        note = f"routing trace {path}: {tr.n_tokens} tokens" + (f" ({dropped} incomplete left out)" if dropped else "")
        return counts, note
    try:
        counts = np.array(spec, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"moe_profile must be a routing trace file or an array of counts [MoE layers, experts], not "
                         f"{type(spec).__name__}") from None
    if counts.shape != (L, E):
        raise ValueError(f"moe_profile: the counts have shape {counts.shape}, expected ({L}, {E}): {model_shape}")
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError("moe_profile: the counts must be finite and >= 0")
    return counts, f"counts [{L}, {E}] given"


def ram_preset_of(ram_tier: bool, exclusive: bool) -> Optional[str]:
    """The RAM preset (:data:`hybrimoe.policy.presets.RAM_PRESETS`) the engine runs: ``hybrimoe-exclusive`` with
    exclusive tiers, ``hybrimoe`` with a RAM tier, None without one."""
    return ("hybrimoe-exclusive" if exclusive else "hybrimoe") if ram_tier else None


def build_policies(policy, facts: EngineFacts, n_slots: int, prefetch_layers: int,
                   profile: Optional[np.ndarray] = None, layers: Optional[Sequence[bool]] = None,
                   ram_preset: Optional[str] = None) -> PolicySet:
    """Policy objects for ``moe_policy``, built by :func:`hybrimoe.policy.presets.build_preset` (the presets' one
    place, shared with the simulator).

    ``policy``: a preset name (:data:`hybrimoe.policy.presets.ENGINE_PRESETS`); a ``SchedulePolicy``, ``CachePolicy`` or
    ``PrefetchPolicy`` object (Python subclass or C++), which replaces that part of the ``hybrimoe`` preset; or a
    dict with keys ``scheduler``, ``cache``, ``prefetch`` (names as in ``hybrimoe._core.make_*`` or objects) and
    ``fill``. Every layer's experts take one GPU slot (``facts.slot_bytes``). ``profile``: counts ``[MoE layers,
    experts]`` (:func:`load_profile`), as the simulator's profiling prompts give it: ``hot-set`` holds the hottest
    experts that fit and needs it; the adaptive caches (``hybrimoe``, ``hybrimoe-lru``, ``gpu-on-demand``) start
    filled with the hottest experts instead of empty; ``ktransformers`` and ``upstream-ncmoe`` (whole layers)
    ignore it. ``layers``: per MoE layer, whether this cache may hold its experts (one device's cache among several:
    the other layers get no slots, and a static set only counts the layers it holds); None: every layer.
    ``ram_preset``: the RAM tier below the cache (:func:`ram_preset_of`), whose ``gpu_mrs_alpha`` a named MRS cache
    takes (:func:`hybrimoe.policy.presets.gpu_mrs_alpha`), as the simulator's three-tier runs do.

    Raises:
        ValueError: unknown preset or component name, a clairvoyant preset or cache (``belady``, ``oracle``:
            simulator only), or ``hot-set`` (a ``static-frequency`` cache) without a profile (the message names
            ``moe_profile``).
    """
    if isinstance(policy, str):
        if policy in SYSTEM_PRESETS and SYSTEM_PRESETS[policy]["clairvoyant"]:
            raise ValueError(f"moe_policy '{policy}' is clairvoyant (it needs the future routing): simulator only")
        if policy not in ENGINE_PRESETS:
            raise ValueError(f"unknown moe_policy '{policy}' (known: {', '.join(ENGINE_PRESETS)}, or a policy "
                             "object)")
        spec, name = policy, policy
    elif isinstance(policy, dict):
        spec, name = dict(policy), "custom"
    elif isinstance(policy, (_core.SchedulePolicy, _core.CachePolicy, _core.PrefetchPolicy)):
        key = ("scheduler" if isinstance(policy, _core.SchedulePolicy) else
               "cache" if isinstance(policy, _core.CachePolicy) else "prefetch")
        spec, name = {key: policy}, f"custom {key}"
    else:
        raise ValueError(f"moe_policy must be a preset name, a policy object or a dict, not {type(policy).__name__}")
    if isinstance(spec, dict) and spec.get("cache") == "belady":
        raise ValueError("the belady cache is clairvoyant: simulator only")
    cache_name = SYSTEM_PRESETS[spec]["cache"] if isinstance(spec, str) else spec.get("cache")
    if cache_name == "static-frequency" and profile is None:
        what = f"moe_policy '{spec}'" if isinstance(spec, str) else "a static-frequency cache"
        raise ValueError(f"{what} needs moe_profile (the CLI's --moe-profile): a routing trace file as hybrimoe "
                         "trace writes (its expert counts per MoE layer and expert choose the hot set) or an array "
                         "of counts [MoE layers, experts]")
    hot = prio = None
    if profile is not None:
        counts = np.asarray(profile, dtype=np.float64)
        if counts.shape != (len(facts.moe_layers), facts.n_expert):
            raise ValueError(f"moe_profile: counts of shape {counts.shape}, expected "
                             f"({len(facts.moe_layers)}, {facts.n_expert})")
        hot, prio = hot_keys_from_counts(counts), counts.ravel()
    sb = facts.slot_bytes
    per_layer = [float(sb) if layers is None or layers[i] else 0.0 for i in range(len(facts.moe_layers))]
    try:
        return build_preset(spec, per_layer, facts.n_expert, float(n_slots * sb),
                            prefetch=prefetch_layers > 0, hot_keys=hot, profile=prio, name=name,
                            mrs_alpha=gpu_mrs_alpha(ram_preset))
    except ValueError as e:
        raise ValueError(f"moe_policy: {e}") from None


#: the cache policy names the RAM tier takes (``hybrimoe._core.make_cache_policy``'s, less clairvoyant ``belady``)
RAM_POLICIES = ("mrs", "lru", "lfu", "reuse")
#: the simulator's RAM presets (``hybrimoe simulate --ram-policies``) taken as the cache policy they run
RAM_POLICY_ALIASES = {"hybrimoe": "mrs", "hybrimoe-reuse": "reuse"}


def ram_cache_policy(spec, preset: Optional[str] = None) -> "_core.CachePolicy":
    """The RAM tier's cache policy for ``moe_ram_policy``: None or ``"mrs"`` (MRS, HybriMoE §IV.D, with the RAM
    preset's longer memory: ``preset``'s ``mrs_alpha``, :func:`ram_preset_of`, default ``hybrimoe``,
    :data:`hybrimoe.policy.presets.RAM_MRS_ALPHA`; ``hybrimoe-exclusive``'s is
    :data:`hybrimoe.policy.presets.EXCLUSIVE_RAM_MRS_ALPHA`), ``"lru"``, ``"lfu"``, ``"reuse"``
    (``hybrimoe._core.make_cache_policy``) or a ``CachePolicy`` object (Python subclasses too). The simulator's
    RAM preset names ``"hybrimoe"`` and ``"hybrimoe-reuse"`` name ``"mrs"`` and ``"reuse"``
    (:data:`RAM_POLICY_ALIASES`).

    Raises:
        ValueError: an unknown name, a clairvoyant policy (``belady`` needs the future), or another type.
    """
    preset = preset or "hybrimoe"
    if spec is None:
        return ram_cache_policy_of(preset)
    if isinstance(spec, _core.CachePolicy):
        return spec
    if isinstance(spec, str):
        name = spec.strip().lower()
        name = RAM_POLICY_ALIASES.get(name, name)
        if name == "belady":
            raise ValueError("moe_ram_policy='belady' is clairvoyant (it needs the future routing): the simulator's "
                             "bound only")
        if name not in RAM_POLICIES:
            raise ValueError(f"unknown moe_ram_policy {spec!r} (known: {', '.join(RAM_POLICIES)}, the simulator's "
                             f"{' and '.join(RAM_POLICY_ALIASES)}, or a CachePolicy object)")
        return ram_cache_policy_of(preset) if name == "mrs" else _core.make_cache_policy(name)
    raise ValueError(f"moe_ram_policy must be a policy name ({', '.join(RAM_POLICIES)}) or a CachePolicy, not "
                     f"{type(spec).__name__}")


def fused_mode(spec) -> int:
    """``moe_cpu_fused`` as the engine's ``fused_cpu``: False 0 (upstream's ops), True 1 (one fused op per layer
    with upstream's kernels and numbers), ``"fast"`` 2 (also the repacked gemm kernels that round differently from
    upstream's gemv: faster prefill of Q4_K experts on x86, numbers within a stated NMSE of upstream's).

    Raises:
        ValueError: any other value.
    """
    if spec is False or spec is None:
        return 0
    if spec is True:
        return 1
    word = spec.strip().lower() if isinstance(spec, str) else None
    if word in ("off", "on", "fast"):  # the CLI's words too
        return {"off": 0, "on": 1, "fast": 2}[word]
    raise ValueError(f"moe_cpu_fused must be True, False, 'fast' (or 'on', 'off'), got {spec!r}")


def cpu_weights_option(no_repack: bool, no_host: bool) -> str:
    """The CPU-weight layout option the routed experts load with, as upstream's flags set it: ``"plain"``
    (``no_repack``: the file's layout), ``"repack-nohost"`` (``no_host``: repacked where ggml-cpu has
    kernels for the type, even with a GPU whose pinned host buffer would otherwise hold them) or ``"repack"``
    (llama.cpp's default: the GPU's pinned host buffer when it has one, else repacked where ggml-cpu can). Part of a
    calibration's store key: the CPU share's cost depends on it."""
    return "plain" if no_repack else "repack-nohost" if no_host else "repack"


def make_engine(facts: EngineFacts, n_slots: int, device_ptr: Optional[int], policies: PolicySet,
                cost: "_core.CostModel", prefetch_layers: int, ram: Optional[dict] = None, fused_cpu: int = 0,
                more_devices: Sequence["DeviceShare"] = (), layer_device: Sequence[int] = ()):
    """Builds the ``hybrimoe._engine.Engine``. The slot pool is split over as many device buffers as the device's
    max buffer size needs (``Engine.slot_buffers``); ``$HYBRIMOE_MAX_BUFFER_BYTES`` (bytes, > 0) caps one buffer
    lower still, to exercise the split on a device without a cap (the RPC stand-in, CUDA).

    ``ram``: the RAM tier (``slots``, ``policy`` (a CachePolicy), ``ranges`` of
    :func:`hybrimoe.runtime.ram_tier.expert_file_ranges`), or None without one. ``fused_cpu``: each layer's CPU
    share as one fused op where it can be (src/runtime/fused_moe.h; :func:`fused_mode`), 0 off. ``more_devices``
    (:class:`DeviceShare`, sized) and ``layer_device``: several accelerators, each MoE layer's GPU share on its own
    device's slots; every device plans with ``cost``.

    Raises:
        ValueError: a slot pool does not fit in its device's free memory (the message names the device), or no
            device for a non-empty cache.
        RuntimeError: the device cannot allocate the pool; the RAM tier cannot open a file (or it changed since the
            load) or allocate its slots.
    """
    _engine = engine_module()
    require_accelerator(device_ptr, n_slots)
    for dev, n in [(device_ptr, n_slots)] + [(d.device, d.n_slots) for d in more_devices]:
        if n <= 0:
            continue
        free, total = _ggml.device_memory(dev)
        need = (n + 1) * facts.slot_bytes
        if need > free:
            where = f"device {_ggml.device_label(dev)}" if more_devices else "the device"
            raise ValueError(f"moe_cache needs {need} bytes ({n} expert slots + 1 of {facts.slot_bytes} bytes), "
                             f"more than the {free} bytes free on {where} (of {total})")
    extra = {}
    # where the experts lie in the files: the RAM tier reads them there, and GPU copies of experts that ggml-cpu
    # keeps repacked take the file's bytes from there
    from hybrimoe.runtime.ram_tier import expert_file_ranges

    any_slots = n_slots > 0 or any(d.n_slots > 0 for d in more_devices)
    rg = ram["ranges"] if ram else expert_file_ranges(facts) if any_slots else None
    if rg is not None:
        extra = dict(files=rg["files"], file_sizes=rg["sizes"], file_mtimes_ns=rg["mtimes_ns"], file_of=rg["file_of"],
                     offset_of=rg["offset_of"])
    if ram:
        sb = facts.ram_slot_bytes
        # the RAM preset the simulator runs (its admission and streaming demand loads too), with the chosen policy
        rc, _ = build_ram_tier(ram_preset_of(True, bool(ram.get("exclusive"))),
                               [float(sb)] * len(facts.moe_layers), facts.n_expert, float(ram["slots"] * sb),
                               policy=ram["policy"])
        extra.update(ram_slots=int(ram["slots"]), ram_io_threads=int(ram.get("io_threads", 4)), ram_cache=rc,
                     ram_direct_io=bool(ram.get("direct_io", ram_direct_io())),
                     ram_repack=bool(ram.get("repack", False)), ram_exclusive=bool(ram.get("exclusive", False)),
                     ram_two_pass=bool(ram.get("two_pass", False)))
    return _engine.Engine(
        n_layer=facts.n_layer, n_expert=facts.n_expert, top_k=facts.top_k, n_embd=facts.n_embd,
        moe_layers=list(facts.moe_layers), expert_bytes=[tuple(b) for b in facts.expert_bytes],
        expert_types=[tuple(t) for t in facts.expert_types], n_slots=n_slots,
        device=int(device_ptr or 0), cost_model=cost,
        prefetch_layers=int(prefetch_layers), fill_on_miss=policies.fill_on_miss, routers=facts.routers,
        router_bias=facts.router_bias, sigmoid_gating=facts.sigmoid_gating, cache=policies.cache,
        scheduler=policies.scheduler, prefetcher=policies.prefetcher, max_buffer_bytes=max_buffer_bytes(),
        bias_bytes=[tuple(b) for b in facts.bias_bytes], scale_bytes=[tuple(b) for b in facts.scale_bytes],
        fused_cpu=int(fused_cpu),
        more_devices=[(int(d.n_slots), int(d.device), max_buffer_bytes(), d.cost or cost) for d in more_devices],
        more_policies=[(d.policies.cache, d.policies.scheduler, d.policies.prefetcher) for d in more_devices],
        layer_device=[int(x) for x in layer_device], **extra)


def gpu_work_bytes(facts: EngineFacts, n_ubatch: int) -> int:
    """Upper bound, in bytes, of the device memory the engine's GPU share allocates besides its slot pool for
    ubatches of up to ``n_ubatch`` tokens: per launch graph (pair counts bucketed to powers of two up to
    ``n_ubatch * top_k``, two launches per layer) its packed inputs (slot id, row, weight and hidden row per pair)
    and its work tensors (each pair's hidden row, gate, up and activation rows of the expert FFN width, down and
    weighted output rows; with expert biases also the biased up, gate and down rows), all F32; summed over the buckets
    (each graph has its own allocation) and over the layers' distinct expert type triples."""
    D = int(facts.n_embd)
    F = int(facts.model.n_ff_exp) if facts.model is not None else D
    per_pair = 4 * (3 + D) + 4 * D + 4 * 3 * F + 4 * 2 * D
    if facts.bias_bytes:
        per_pair += 4 * (2 * F + D)  # ggml_add_id's outputs (build_moe_ffn's "ffn_moe_*_biased")
    if facts.scale_bytes:
        per_pair += 4 * (2 * F + D + 3 * 2)  # the scaled products and each pair's gathered scales
    if facts.clamped:
        per_pair += 4 * 3 * F  # clamp(up), silu(gate), its clamp
    if facts.weight_before_ffn:
        per_pair += 4 * 2 * D  # the input repeated per pair and weighted
    top = 1
    while top < max(1, int(n_ubatch) * int(facts.top_k)):
        top *= 2
    pairs = 0
    b = 1
    while b <= top:
        pairs += 2 * b
        b *= 2
    # graphs are kept per (gate, up, down) type triple too (a Q4_K_M file mixes Q4_K and Q6_K down matrices)
    triples = max(1, len({tuple(t) for t in facts.expert_types}))
    return int(pairs * per_pair * triples)


def auto_slots(facts: EngineFacts, free_bytes: int, n_ubatch: int) -> tuple[int, str]:
    """``moe_cache="auto"``: the most GPU expert slots that fit in ``free_bytes`` (the device's free memory after
    the model's device weights, KV cache and compute buffers) less the engine's own GPU work buffers
    (:func:`gpu_work_bytes`) and a margin (:data:`hybrimoe.envs.AUTO_MARGIN_FRACTION` of the free memory, at
    least :data:`hybrimoe.envs.AUTO_MARGIN_MIN_BYTES`), at most one per expert (the pool adds a null slot).
    Returns ``(slots, why)``, ``why`` a sentence with the figures."""
    sb = facts.slot_bytes
    work = gpu_work_bytes(facts, n_ubatch)
    margin = max(AUTO_MARGIN_MIN_BYTES, int(free_bytes * AUTO_MARGIN_FRACTION))
    n_all = len(facts.moe_layers) * facts.n_expert
    room = int(free_bytes) - work - margin
    n = max(0, min(n_all, room // sb - 1)) if room > 0 else 0
    why = (f"auto: {free_bytes} bytes free on the device after the model, KV cache and compute buffers, less "
           f"{work} for the engine's GPU work buffers (ubatches of {n_ubatch}) and a margin of {margin}: "
           f"{n} of {n_all} experts in slots of {sb} bytes")
    return int(n), why


@dataclass(frozen=True)
class DeviceShare:
    """One more accelerator's part of a set-up over several (:attr:`EngineSetup.more_devices`): its ggml device pointer
    and label, its expert slots (``None`` until sized for ``"auto"``), how they were chosen, its policies (a cache
    that holds only the layers it serves; ``None`` until sized), and its planner's cost model (``None``: the first
    device's) with where it came from."""

    device: int
    label: str
    n_slots: Optional[int]
    slots_note: str
    policies: Optional[PolicySet] = field(default=None, compare=False)
    cost: Optional["_core.CostModel"] = field(default=None, compare=False)
    cost_source: str = "the first device's"


@dataclass(frozen=True)
class EngineSetup:
    """How one :class:`hybrimoe.Llama` runs the MoE engine, decided once (read-only: ``Llama.moe_setup``).

    :meth:`create` builds it from the user's options and the GGUF's facts before the model loads: every
    validation, default and device check happens there. Two things are only known once the model is loaded: the
    slot count of ``moe_cache="auto"`` (:meth:`with_auto_slots`: the device memory left) and, without a cost model
    given or stored, one measured on the loaded model (:func:`hybrimoe.runtime.calibration.with_first_use_cost`); each
    returns a new set-up. Units: bytes, seconds.

    Fields: ``facts`` (:class:`EngineFacts`), ``cache_spec`` (the user's ``moe_cache``), ``n_slots`` (GPU expert
    slots; ``None`` until completed for ``"auto"``), ``slots_note`` (how they were chosen), ``policy_spec`` (the
    user's ``moe_policy``), ``policies`` (:class:`hybrimoe.policy.presets.PolicySet`; ``None`` until completed for
    ``"auto"``), ``prefetch_layers``, ``cost`` (the planner's ``CostModel``; ``None`` until completed when it is
    to be measured), ``cost_source`` (where it came from), ``device`` (ggml device pointer of the accelerator, or
    ``None``), ``device_label``, ``host_buffer_type`` (the device's pinned host buffer type, where the routed
    experts are kept; ``None``: plain host memory), ``profile`` (float64 counts ``[MoE layers, experts]`` from
    ``moe_profile``, :func:`load_profile`; ``None``: none given), ``profile_source`` (where they came from) and
    ``cpu_weights``, the CPU-weight layout option the routed experts load with (:func:`cpu_weights_option`), and
    ``cpu_fused`` (``moe_cpu_fused`` as :func:`fused_mode` gives it: 0 off). With several accelerators holding MoE
    layers (:meth:`with_devices`): ``device``, ``n_slots``, ``policies`` are the first device's, ``more_devices`` the
    others' (:class:`DeviceShare`), and ``layer_device`` gives each MoE layer's device (an index: 0 the first).
    ``cost_given``: the user gave ``moe_cost_model`` (every device plans with it). ``host_layers``: the MoE layers
    llama.cpp left on the host (their GPU share runs on the main device).
    """

    facts: EngineFacts
    cache_spec: object
    n_slots: Optional[int]
    slots_note: str
    policy_spec: object
    policies: Optional[PolicySet]
    prefetch_layers: int
    cost: Optional["_core.CostModel"]
    cost_source: str
    device: Optional[int]
    device_label: str
    host_buffer_type: Optional[str]
    profile: Optional[np.ndarray] = field(default=None, compare=False)
    profile_source: str = ""
    ram_spec: object = None
    ram_slots: Optional[int] = None
    ram_note: str = ""
    ram_policy: object = field(default=None, compare=False)
    ram_ranges: Optional[dict] = field(default=None, compare=False)
    ram_exclusive: bool = False
    cpu_weights: str = "repack"
    cpu_fused: int = 0
    more_devices: tuple = ()
    layer_device: tuple = ()
    host_layers: tuple = ()
    cost_given: bool = False

    @property
    def ram_tier(self) -> bool:
        """Whether the routed experts come from the file through the RAM tier (``moe_ram_cache``)."""
        return self.ram_spec is not None

    @property
    def ram_preset(self) -> Optional[str]:
        """The RAM preset the engine runs (:func:`ram_preset_of`), None without a RAM tier."""
        return ram_preset_of(self.ram_tier, self.ram_exclusive)

    @classmethod
    def create(cls, model_path, *, moe_cache, moe_policy=None, moe_prefetch_layers=None, moe_cost_model=None,
               moe_profile=None, kv_overrides: Optional[dict] = None, rpc_devices: Sequence[int] = (),
               tensor_overrides: Sequence[tuple] = (), moe_ram_cache=None, moe_ram_policy=None,
               n_ubatch: int = 512, no_repack: bool = False, no_host: bool = False,
               moe_cpu_fused: bool = False, moe_ram_exclusive: bool = False) -> Optional["EngineSetup"]:
        """The set-up for these options, or None when the engine is off (``moe_cache`` None).

        ``moe_profile``: a routing trace file or counts ``[MoE layers, experts]`` (:func:`load_profile`): the
        profile ``hot-set`` needs and the adaptive caches start filled from (:func:`build_policies`).
        ``rpc_devices``: the device pointers of the Llama's RPC servers (the first is the accelerator, else this
        machine's first GPU); ``tensor_overrides``: the user's ``(pattern, buffer type)`` overrides (none may put
        routed experts on a device: the engine keeps them in host memory). ``moe_ram_cache``: the RAM tier's
        budget (:mod:`hybrimoe.runtime.ram_tier`; turns the engine on with ``moe_cache=0`` when that is not given;
        with a GPU cache too, every GPU load copies from a RAM slot), ``moe_ram_policy`` its cache policy
        (:func:`ram_cache_policy`), ``n_ubatch`` the context's ubatch (the smallest RAM budget); ``no_repack``
        and ``no_host`` the Llama's options of those names (:func:`cpu_weights_option`); ``moe_cpu_fused`` the fused
        CPU share (src/runtime/fused_moe.h).

        Raises:
            ValueError: a ``moe_*`` option without ``moe_cache``; a bad budget, policy, prefetch depth, cost model,
                profile (``hot-set`` without one, a trace of another shape) or ``expert_used_count`` override; not a
                MoE model; a cache without an accelerator; an override that moves routed experts to a device.
            RuntimeError: the process's CPU backend is not hybrimoe's ggml-cpu (llama_cpp loaded first).
        """
        if moe_ram_cache is None and moe_ram_policy is not None:
            raise ValueError("moe_ram_policy set without moe_ram_cache: there is no RAM tier to apply it to")
        if not isinstance(moe_ram_exclusive, bool):
            raise ValueError(f"moe_ram_exclusive must be True or False, got {moe_ram_exclusive!r}")
        if moe_ram_exclusive and moe_ram_cache is None:
            raise ValueError("moe_ram_exclusive (--moe-ram-exclusive) needs a RAM tier, moe_ram_cache "
                             "(--moe-ram-cache), and a GPU cache above it, moe_cache (--moe-cache)")
        if moe_ram_exclusive and moe_cache is None:
            raise ValueError("moe_ram_exclusive (--moe-ram-exclusive) needs a GPU cache above the RAM tier, moe_cache "
                             "(--moe-cache): without one the RAM tier is the only tier")
        if moe_ram_cache is not None and moe_cache is None:
            moe_cache = 0  # the RAM tier runs in the engine: on, with no GPU cache
        if moe_cache is None:
            # a bad value is named as such, and "off" asks for nothing the engine would do
            fused_on = fused_mode(moe_cpu_fused) != 0
            given = [n for n, v in (("moe_policy", moe_policy), ("moe_prefetch_layers", moe_prefetch_layers),
                                    ("moe_cost_model", moe_cost_model), ("moe_profile", moe_profile))
                     if v is not None] + (["moe_cpu_fused"] if fused_on else [])
            if given:
                raise ValueError(f"{', '.join(given)} set without moe_cache: the MoE engine is off; give moe_cache "
                                 "(e.g. '25%', 'auto', or 0 for no GPU cache) to turn it on")
            return None
        policy_spec = DEFAULT_PRESET if moe_policy is None else moe_policy
        prefetch = PREFETCH_LAYERS if moe_prefetch_layers is None else moe_prefetch_layers
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"moe_prefetch_layers must be an integer >= 0, got {prefetch!r}")
        why = engine_module().cpu_backend_problem()
        if why:  # the engine's own check, made before the model is loaded (which can take minutes)
            raise RuntimeError(f"moe_cache: {why}")
        facts = engine_facts(model_path)
        # llama.cpp applies kv_overrides of "<arch>.expert_used_count" to top-k: the engine must see the same k
        k_over = (kv_overrides or {}).get(f"{facts.arch}.expert_used_count")
        if k_over is not None:
            if isinstance(k_over, bool) or not isinstance(k_over, int) or not 1 <= k_over <= facts.n_expert:
                raise ValueError(f"kv_overrides {facts.arch}.expert_used_count must be an integer in "
                                 f"1..{facts.n_expert}, got {k_over!r}")
            facts = dataclasses.replace(facts, top_k=int(k_over))
        # a list of budgets, one per device (checked against the devices once the model is loaded): each entry is
        # checked now, and the first sizes the set-up until then
        entries = budget_list(moe_cache)
        if entries is not None:
            if not entries:
                raise ValueError("moe_cache: an empty list of budgets")
            for e in entries:
                if not (isinstance(e, str) and e.strip().lower() == "auto"):
                    cache_slots(e, facts)
        first = entries[0] if entries is not None else moe_cache
        auto = isinstance(first, str) and first.strip().lower() == "auto"
        n_slots = None if auto else cache_slots(first, facts)
        if moe_ram_exclusive and n_slots == 0:
            raise ValueError(f"moe_ram_exclusive (--moe-ram-exclusive) needs a GPU cache above the RAM tier, moe_cache "
                             f"(--moe-cache) of at least one expert slot, got {moe_cache!r}: without one the RAM tier "
                             "is the only tier")
        profile, profile_source = load_profile(moe_profile, facts)
        # an unknown or clairvoyant policy, or hot-set without a profile, fails now, not after the model loaded
        policies = build_policies(policy_spec, facts, 0 if auto else n_slots, prefetch, profile,
                                  ram_preset=ram_preset_of(moe_ram_cache is not None, bool(moe_ram_exclusive)))
        if auto:
            policies = None
        device = _ggml.accelerator(list(rpc_devices))
        require_accelerator(device, None if auto else n_slots, f"moe_cache={moe_cache!r} (--moe-cache)")
        host = _ggml.host_buffer_type_name(device) if device else None
        for pattern, buft_name in tensor_overrides:
            if buft_name not in ("CPU", host) and re.search(pattern, "blk.0.ffn_up_exps.weight"):
                raise ValueError(f"tensor override {pattern}={buft_name} puts routed experts on a device; with "
                                 "moe_cache the engine keeps them in host memory and caches them itself")
        label = _ggml.device_label(device)
        cost, source = None, "none yet (a stored calibration, else one measured at first use)"
        if moe_cost_model is not None:
            cost = resolve_cost_model(moe_cost_model, facts.model)
            source = "CostModel object" if isinstance(moe_cost_model, _core.CostModel) else str(moe_cost_model)
        note = "" if auto else f"moe_cache={moe_cache!r}: {n_slots} slots of {facts.slot_bytes} bytes"
        ram = {}
        if moe_ram_cache is not None:
            from hybrimoe.runtime import ram_tier
            ram_auto = isinstance(moe_ram_cache, str) and moe_ram_cache.strip().lower() == "auto"
            ram_n, ram_note = (None, "") if ram_auto else ram_tier.ram_slots(moe_ram_cache, facts, n_ubatch)
            ram = dict(ram_spec=moe_ram_cache, ram_slots=ram_n, ram_note=ram_note,
                       ram_policy=ram_cache_policy(moe_ram_policy, ram_preset_of(True, bool(moe_ram_exclusive))),
                       ram_ranges=ram_tier.expert_file_ranges(facts),
                       ram_exclusive=bool(moe_ram_exclusive))
        return cls(facts=facts, cache_spec=moe_cache, n_slots=n_slots, slots_note=note, policy_spec=policy_spec,
                   policies=policies, prefetch_layers=prefetch, cost=cost, cost_source=source, device=device,
                   device_label=label, host_buffer_type=host, profile=profile, profile_source=profile_source,
                   cpu_weights=cpu_weights_option(no_repack, no_host),
                   cpu_fused=fused_mode(moe_cpu_fused), cost_given=moe_cost_model is not None, **ram)

    @property
    def cpu_path(self) -> str:
        """The CPU share's path as a calibration's store key names it: the CPU-weight option (``cpu_weights``), then
        ``-fused`` or ``-fused-fast`` when it runs fused (``cpu_fused`` 1 or 2)."""
        return self.cpu_weights + {0: "", 1: "-fused", 2: "-fused-fast"}[self.cpu_fused]

    def expert_override(self) -> tuple:
        """The tensor override that keeps the routed experts in host memory (``(pattern, buffer type name)``): the
        device's pinned host buffer type when it has one (in the file's layout), else llama.cpp's choice among the CPU
        buffer types (repacked where ggml-cpu can, unless ``no_repack``), also with ``no_host``."""
        host = None if self.cpu_weights == "repack-nohost" else self.host_buffer_type
        return (EXPS_REGEX, host or "CPU")

    def with_auto_ram_slots(self, n_ubatch: int, other_in_ram: bool = False) -> "EngineSetup":
        """For ``moe_ram_cache="auto"``, once the model is loaded: the set-up with the RAM slots that fit the memory
        available now (:func:`hybrimoe.runtime.ram_tier.auto_ram_slots`); other set-ups are returned unchanged.
        ``other_in_ram``: the weights outside the routed experts were read into the process's memory at load
        (``use_mmap=False``), so the memory available now excludes them already; else they are in the page cache,
        which the available memory counts as free, and are set aside.

        Raises:
            ValueError: too little memory for a layer's experts.
        """
        if not self.ram_tier or self.ram_slots is not None:
            return self
        from hybrimoe.model.reader import open_gguf
        from hybrimoe.runtime import ram_tier
        other = 0 if other_in_ram else max(0, int(open_gguf(self.facts.path).size) - int(self.facts.total_expert_bytes))
        n, why = ram_tier.auto_ram_slots(self.facts, n_ubatch, other)
        return dataclasses.replace(self, ram_slots=n, ram_note=why)

    def with_devices(self, layer_devs: Sequence[Optional[int]], order: Sequence[int],
                     main: Optional[int] = None) -> "EngineSetup":
        """Once the model is loaded: the set-up over the devices that hold its MoE layers (llama.cpp's layer split,
        :func:`hybrimoe.runtime.devices.model_layer_devices`): one slot pool per device, each layer's GPU share on
        its own device (a layer on the host: on ``main``, else this set-up's device). With one device, this set-up
        on that device; with several, the budget split per device (:func:`hybrimoe.runtime.devices.device_slots`)
        and a cache per device that holds only its layers. ``order``: the Llama's devices in order (``-ts``).

        Raises:
            ValueError: a list of budgets whose length is not the number of devices, or an entry too small for one
                slot (the message names the device).
        """
        devs, layer_device = engine_devices(layer_devs, order, main or self.device)
        host = tuple(i for i, d in enumerate(layer_devs) if d is None)
        entries = budget_list(self.cache_spec)
        if len(devs) <= 1:
            if entries is not None and len(entries) != 1:
                where = _ggml.device_label(devs[0]) if devs else "no device"
                raise ValueError(f"moe_cache lists {len(entries)} budgets, but the MoE layers are on one device "
                                 f"({where}): give one budget")
            if devs and devs[0] != self.device:
                return dataclasses.replace(self, device=devs[0], device_label=_ggml.device_label(devs[0]),
                                           host_layers=host)
            return dataclasses.replace(self, host_layers=host)
        labels = [_ggml.device_label(d) for d in devs]
        slots = device_slots(self.cache_spec, self.facts, layer_device, len(devs), labels)
        shares = []
        for i, (d, n) in enumerate(zip(devs, slots)):
            mask = [x == i for x in layer_device]
            pol = None if n is None else build_policies(self.policy_spec, self.facts, n, self.prefetch_layers,
                                                        self.profile, layers=mask, ram_preset=self.ram_preset)
            note = (f"sized at load (auto) for its {sum(mask)} MoE layers" if n is None else
                    f"{n} slots of {self.facts.slot_bytes} bytes for its {sum(mask)} MoE layers")
            shares.append(DeviceShare(d, labels[i], n, note, pol))
        first = shares[0]
        return dataclasses.replace(self, device=first.device, device_label=first.label, n_slots=first.n_slots,
                                   slots_note=f"{first.label}: {first.slots_note}", policies=first.policies,
                                   more_devices=tuple(shares[1:]), layer_device=tuple(layer_device),
                                   host_layers=host)

    def _layers_of(self, index: int) -> Optional[list]:
        """Per MoE layer, whether device ``index`` serves it (None with one device: all of them)."""
        return [x == index for x in self.layer_device] if self.layer_device else None

    def _auto_share(self, device: int, index: int, n_ubatch: int) -> tuple[int, str, PolicySet]:
        free, _ = _ggml.device_memory(device)
        n, why = auto_slots(self.facts, free, int(n_ubatch))
        mask = self._layers_of(index)
        if mask is not None:
            n = min(n, sum(mask) * self.facts.n_expert)
        if n < 1:
            raise ValueError(f"moe_cache='auto' found no room for an expert slot on {_ggml.device_label(device)} "
                             f"({why}); give a smaller ubatch, or moe_cache=0")
        return n, why, build_policies(self.policy_spec, self.facts, n, self.prefetch_layers, self.profile,
                                      layers=mask, ram_preset=self.ram_preset)

    def with_auto_slots(self, n_ubatch: int) -> "EngineSetup":
        """For ``moe_cache="auto"``, once the model is loaded: the set-up with the slots that fit the device's free
        memory now (:func:`auto_slots`) and the policies for them, on each device that is to be sized so; other
        set-ups are returned unchanged.

        Raises:
            ValueError: no room for a single slot (the message names the device).
        """
        out = self
        if self.n_slots is None:
            n, why, pol = self._auto_share(self.device, 0, n_ubatch)
            out = dataclasses.replace(out, n_slots=n, slots_note=why, policies=pol)
        if any(d.n_slots is None for d in self.more_devices):
            shares = []
            for i, d in enumerate(self.more_devices, start=1):
                if d.n_slots is None:
                    n, why, pol = self._auto_share(d.device, i, n_ubatch)
                    d = dataclasses.replace(d, n_slots=n, slots_note=why, policies=pol)
                shares.append(d)
            out = dataclasses.replace(out, more_devices=tuple(shares))
        return out

    def make_engine(self):
        """The ``hybrimoe._engine.Engine`` of a completed set-up (:func:`make_engine`)."""
        if self.n_slots is None or self.cost is None or self.policies is None:
            raise ValueError("EngineSetup.make_engine: the set-up lacks its slots or cost model (with_auto_slots, "
                             "hybrimoe.runtime.calibration.with_first_use_cost)")
        ram = None
        if self.ram_tier:
            if self.ram_slots is None:
                raise ValueError("EngineSetup.make_engine: the set-up lacks its RAM slots (with_auto_ram_slots)")
            from hybrimoe.runtime.ram_tier import IO_THREADS
            # the slots keep the file's layout unless HYBRIMOE_RAM_REPACK asks for upstream's repacked one where
            # upstream repacks CPU weights (never under a GPU cache: the engine keeps the file's layout for copies)
            ram = {"slots": self.ram_slots, "policy": self.ram_policy, "ranges": self.ram_ranges,
                   "io_threads": IO_THREADS, "repack": self.cpu_weights != "plain" and ram_repack(),
                   "exclusive": self.ram_exclusive, "two_pass": ram_two_pass()}
        if any(d.n_slots is None or d.policies is None for d in self.more_devices):
            raise ValueError("EngineSetup.make_engine: a device lacks its slots (with_auto_slots)")
        return make_engine(self.facts, self.n_slots, self.device, self.policies, self.cost, self.prefetch_layers,
                           ram, fused_cpu=self.cpu_fused, more_devices=self.more_devices,
                           layer_device=self.layer_device)
