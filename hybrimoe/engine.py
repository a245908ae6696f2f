"""Set-up of the hybrid CPU+GPU MoE engine (``hybrimoe._engine.Engine``) for a model and the user's options.

What ``hybrimoe.Llama(..., moe_cache=..., moe_policy=..., moe_prefetch_layers=..., moe_cost_model=...)`` and
``hybrimoe run --moe-cache ...`` use: model facts from the GGUF (expert sizes per layer and matrix, routers for
prefetch prediction), the slot count from the cache budget, the policies (policy core, or Python objects) and the
planner's cost model (a named hardware preset or a JSON file; calibration is a later issue).
"""
from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from . import _core
from . import policy as pol
from .trace import ModelFacts

DEFAULT_COST_PRESET = "rtx4090-desktop"
#: engine policy presets: the simulator's system presets that need no clairvoyance (hybrimoe.policy.SYSTEM_PRESETS)
ENGINE_PRESETS = ("hybrimoe", "hybrimoe-lru", "ktransformers", "upstream-ncmoe", "gpu-on-demand")
_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_BLK = re.compile(r"^blk\.(\d+)\.")


def _engine_module():
    """hybrimoe._engine, after our libllama is loaded (the module links it and resolves its symbols there)."""
    from ._lib import llama_cpp_module

    llama_cpp_module()
    from . import _engine

    return _engine


@dataclass
class EngineFacts:
    """What the engine needs to know about a GGUF MoE model.

    ``expert_bytes``: per MoE layer, bytes of one expert's (gate, up, down) matrices as stored (ggml ``nb[2]``);
    ``expert_types``: per MoE layer, their ggml type ids;
    ``routers``: per MoE layer, F32 ``[n_expert, n_embd]`` router weights (empty array when the file's router is
    not F32); ``router_bias``: per MoE layer, F32 ``[n_expert]`` selection bias (DeepSeek-V3 ``exp_probs_b``) or empty.
    """

    path: str
    arch: str
    n_layer: int
    n_expert: int
    top_k: int
    n_embd: int
    moe_layers: list
    expert_bytes: list
    expert_types: list = field(default_factory=list)
    routers: list = field(default_factory=list)
    router_bias: list = field(default_factory=list)
    sigmoid_gating: bool = False
    model: Optional[ModelFacts] = None

    @property
    def slot_bytes(self) -> int:
        """Bytes of one GPU expert slot (the largest gate, up and down over the layers, each padded to 256)."""
        return int(_engine_module().Engine.slot_bytes_for([tuple(b) for b in self.expert_bytes],
                                                 [tuple(t) for t in self.expert_types]))

    @property
    def total_expert_bytes(self) -> int:
        """Bytes of all routed experts of all MoE layers, as stored."""
        return int(sum(sum(b) for b in self.expert_bytes) * self.n_expert)


def engine_facts(path: Union[str, os.PathLike]) -> EngineFacts:
    """Reads the facts the engine needs from a GGUF file (gguf library).

    Raises:
        ValueError: not a MoE model, or its experts are not separate gate/up/down matrices.
    """
    import gguf

    from .info import _field, describe

    d = describe(path)
    if not d["has_experts"]:
        raise ValueError(f"{path}: not a Mixture-of-Experts model (no ffn_*_exps tensors): the MoE engine has "
                         "nothing to do")
    kinds = d["expert_tensors"]
    if not all(k in kinds for k in ("gate", "up", "down")):
        raise ValueError(f"{path}: experts are not separate gate/up/down matrices ({', '.join(kinds)}): not "
                         "supported by the MoE engine")
    r = gguf.GGUFReader(os.fspath(path))
    arch = d["architecture"]
    moe_layers = list(d["moe_layers"])
    eb = [[int(kinds[k]["layers"][il]["bytes_per_expert"]) for k in ("gate", "up", "down")] for il in moe_layers]
    et = [[int(gguf.GGMLQuantizationType[kinds[k]["layers"][il]["type"]]) for k in ("gate", "up", "down")]
          for il in moe_layers]
    tensors = {t.name: t for t in r.tensors}
    routers, biases = [], []
    for il in moe_layers:
        t = tensors.get(f"blk.{il}.ffn_gate_inp.weight")
        if t is not None and int(t.tensor_type) == int(gguf.GGMLQuantizationType.F32):
            routers.append(np.ascontiguousarray(np.asarray(t.data, dtype=np.float32).reshape(d["n_expert"],
                                                                                            d["n_embd"])))
        else:
            routers.append(np.zeros(0, np.float32))
        b = tensors.get(f"blk.{il}.exp_probs_b.bias")
        biases.append(np.asarray(b.data, dtype=np.float32).ravel().copy() if b is not None
                      else np.zeros(0, np.float32))
    gating = _field(r, f"{arch}.expert_gating_func")
    sigmoid = gating is not None and int(gating) == int(gguf.ExpertGatingFuncType.SIGMOID)

    # facts for the hardware presets' cost model (hybrimoe.policy.cost_model_from_hardware)
    n_moe = len(moe_layers)
    ff = int(kinds["gate"]["shape"][1])
    expert_bytes = float(np.mean([sum(b) for b in eb]))
    per_layer_other = {}
    for t in r.tensors:
        m = _BLK.match(t.name)
        if m and not _EXPS.match(t.name):
            per_layer_other.setdefault(int(m.group(1)), []).append((int(t.n_elements), int(t.n_bytes)))
    moe_other = [sum(n for n, _ in per_layer_other.get(il, [])) for il in moe_layers]
    dense = [il for il in range(d["n_layer"]) if il not in moe_layers]
    dense_params = [sum(n for n, _ in per_layer_other.get(il, [])) for il in dense]
    all_other = [x for v in per_layer_other.values() for x in v]
    bpp = (sum(b for _, b in all_other) / max(1, sum(n for n, _ in all_other))) if all_other else 2.0
    model = ModelFacts(
        name=os.path.basename(os.fspath(path)), n_moe_layers=n_moe, n_dense_layers=len(dense),
        n_experts=int(d["n_expert"]), top_k=int(d["n_expert_used"]),
        n_shared_experts=int(d["shared"]["count"]) if d["shared"] else 0, n_embd=int(d["n_embd"]), n_ff_exp=ff,
        expert_bytes=expert_bytes, expert_params=3.0 * d["n_embd"] * ff,
        non_expert_params_per_moe_layer=float(np.mean(moe_other)) if moe_other else 0.0,
        dense_layer_params=float(np.mean(dense_params)) if dense_params else 0.0,
        bytes_per_param_non_expert=float(bpp), sources={"all": f"read from {os.fspath(path)}"})
    return EngineFacts(path=os.fspath(path), arch=arch, n_layer=int(d["n_layer"]), n_expert=int(d["n_expert"]),
                       top_k=int(d["n_expert_used"]), n_embd=int(d["n_embd"]), moe_layers=moe_layers,
                       expert_bytes=eb, expert_types=et, routers=routers, router_bias=biases, sigmoid_gating=sigmoid, model=model)


def slot_bytes(model_path: Union[str, os.PathLike]) -> int:
    """Bytes of one GPU expert slot for a model: ``moe_cache`` budgets are whole slots of this size."""
    return engine_facts(model_path).slot_bytes


def cache_slots(spec, facts: EngineFacts) -> int:
    """Number of GPU expert slots for a ``moe_cache`` budget.

    ``spec``: ``"25%"`` (of the model's routed experts: 100% = a slot for every expert), ``"3GiB"``, ``"512MB"``, or
    bytes (int). 0 is valid (nothing cached). A byte budget is rounded down to whole slots of ``facts.slot_bytes``
    (a slot fits the largest expert of the model, so mixed quant types need a little more than the file's expert
    bytes) and capped at one slot per expert.

    Raises:
        ValueError: unparsable, negative, above 100%, or positive but smaller than one slot.
    """
    sb = facts.slot_bytes
    n_all = len(facts.moe_layers) * facts.n_expert
    b = pol.parse_budget(spec, float(n_all * sb), sb)
    return min(n_all, int(b // sb + 1e-9))


def resolve_cost_model(spec, facts: EngineFacts) -> "_core.CostModel":
    """The planner's cost model: None (the ``rtx4090-desktop`` preset), a hardware preset name or file
    (schema ``hybrimoe.hardware/1``), a cost-model JSON file (schema ``hybrimoe.cost_model/2`` or ``/1``), or a
    CostModel.

    Raises:
        ValueError (CostModelError): unknown preset, unreadable or invalid file.
    """
    if isinstance(spec, _core.CostModel):
        spec.validate()
        return spec
    if spec is not None and not isinstance(spec, (str, os.PathLike)):
        raise ValueError(f"moe_cost_model must be a preset name, a JSON file path or a CostModel, not "
                         f"{type(spec).__name__}")
    name = DEFAULT_COST_PRESET if spec is None else os.fspath(spec)
    if os.path.isfile(name):
        import json

        try:
            with open(name) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise pol.CostModelError(f"{name}: cannot read the cost model: {e}") from None
        if isinstance(doc, dict) and doc.get("schema") in pol.COST_MODEL_SCHEMAS:
            return pol.load_cost_model(name)
    hw = pol.load_hardware(name)
    return pol.cost_model_from_hardware(hw, facts.model)


@dataclass
class Policies:
    """The engine's policy objects (hybrimoe._core), plus whether CPU-computed misses are offered to the cache."""

    cache: object
    scheduler: object
    prefetcher: object
    fill_on_miss: bool
    name: str


def build_policies(policy, facts: EngineFacts, n_slots: int, prefetch_layers: int) -> Policies:
    """Policy objects for ``moe_policy``.

    ``policy``: a preset name (:data:`ENGINE_PRESETS`); a ``SchedulePolicy``, ``CachePolicy`` or ``PrefetchPolicy``
    object (Python subclass or C++), which replaces that part of the ``hybrimoe`` preset; or a dict with keys
    ``scheduler``, ``cache``, ``prefetch`` (names as in ``hybrimoe._core.make_*`` or objects) and ``fill``.

    The ``ktransformers`` preset has no offline profile here: its hot set is learned online (LFU cache, filled with
    CPU-computed misses; nothing is ever loaded for a layer that needs it). ``upstream-ncmoe`` keeps whole layers
    (the last ones, as many as fit) resident, like upstream's ``--n-cpu-moe``.

    Raises:
        ValueError: unknown preset or component name, or a clairvoyant preset (``belady``, ``oracle``: simulator only).
    """
    L, E, sb = len(facts.moe_layers), facts.n_expert, facts.slot_bytes
    budget = float(n_slots * sb)
    spec: dict
    if isinstance(policy, str):
        if policy in ("belady", "oracle"):
            raise ValueError(f"moe_policy '{policy}' is clairvoyant (it needs the future routing): simulator only")
        if policy not in ENGINE_PRESETS:
            raise ValueError(f"unknown moe_policy '{policy}' (known: {', '.join(ENGINE_PRESETS)}, or a policy object)")
        spec = pol.system_preset(policy)
        name = policy
    elif isinstance(policy, dict):
        unknown = set(policy) - {"scheduler", "cache", "prefetch", "fill"}
        if unknown:
            raise ValueError(f"moe_policy dict has unknown keys {sorted(unknown)} (scheduler, cache, prefetch, fill)")
        spec = dict(pol.system_preset("hybrimoe"))
        spec.update(policy)
        name = "custom"
    elif isinstance(policy, (_core.SchedulePolicy, _core.CachePolicy, _core.PrefetchPolicy)):
        spec = dict(pol.system_preset("hybrimoe"))
        key = ("scheduler" if isinstance(policy, _core.SchedulePolicy) else
               "cache" if isinstance(policy, _core.CachePolicy) else "prefetch")
        spec[key] = policy
        name = f"custom {key}"
    else:
        raise ValueError(f"moe_policy must be a preset name, a policy object or a dict, not {type(policy).__name__}")

    n_cpu_layers = 0
    cache_spec = spec["cache"]
    fill = bool(spec.get("fill", True))
    if isinstance(cache_spec, _core.CachePolicy):
        cache = _core.ExpertCache([float(sb)] * L, E, budget, cache_spec)
    elif cache_spec == "static-layers":
        n_gpu_layers = min(L, n_slots // E) if E else 0
        n_cpu_layers = L - n_gpu_layers
        keys = [l * E + e for l in range(n_cpu_layers, L) for e in range(E)]
        cache = _core.ExpertCache([float(sb)] * L, E, budget, _core.StaticPolicy(keys, []))
        cache.fill(keys)
    elif cache_spec == "static-frequency":
        cache = _core.ExpertCache([float(sb)] * L, E, budget, _core.make_cache_policy("lfu"))
        fill = True
    else:
        if cache_spec == "belady":
            raise ValueError("the belady cache is clairvoyant: simulator only")
        cache = _core.ExpertCache([float(sb)] * L, E, budget, _core.make_cache_policy(str(cache_spec)))
    sched = spec["scheduler"]
    if not isinstance(sched, _core.SchedulePolicy):
        sched = _core.make_scheduler(str(sched), n_cpu_layers)
    pre = spec["prefetch"]
    if not isinstance(pre, _core.PrefetchPolicy):
        pre = _core.make_prefetcher(str(pre) if prefetch_layers > 0 else "none")
    return Policies(cache=cache, scheduler=sched, prefetcher=pre, fill_on_miss=fill, name=name)


def layer_totals(layers: list) -> dict:
    """Sums of the engine's per-MoE-layer counters (``Engine.layer_stats()``) over the layers, plus
    ``bytes_copied`` (demand + prefetch + fill H2D bytes)."""
    tot = {k: sum(s[k] for s in layers) for k in (layers[0] if layers else {})}
    tot["bytes_copied"] = sum(tot.get(k, 0.0) for k in ("bytes_demand", "bytes_prefetch", "bytes_fill"))
    return tot


def host_buffer_type_name(device_ptr: int) -> Optional[str]:
    """Name of the device's pinned host buffer type (e.g. ``CUDA_Host``), or None when it has none (RPC)."""
    from . import _ggml

    g = _ggml.libggml()
    fn = g.ggml_backend_dev_host_buffer_type
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = ctypes.c_void_p
    buft = fn(device_ptr)
    if not buft:
        return None
    return g.ggml_backend_buft_name(buft).decode()


def device_memory(device_ptr: int) -> tuple[int, int]:
    """(free, total) bytes of a ggml device."""
    from . import _ggml

    for d in _ggml.devices():
        if d["ptr"] == device_ptr:
            return int(d["free"]), int(d["total"])
    raise ValueError("unknown ggml device")


def make_engine(facts: EngineFacts, n_slots: int, device_ptr: Optional[int], policies: Policies,
                cost: "_core.CostModel", prefetch_layers: int):
    """Builds the ``hybrimoe._engine.Engine``.

    Raises:
        ValueError: the slot pool does not fit in the device's free memory, or no device for a non-empty cache.
        RuntimeError: the device cannot allocate the pool.
    """
    _engine = _engine_module()
    if n_slots > 0:
        if not device_ptr:
            raise ValueError("moe_cache needs an accelerator (a CUDA device or an RPC server via rpc_servers); none "
                             "was found. Use moe_cache=0 to run every expert on the CPU")
        free, total = device_memory(device_ptr)
        need = (n_slots + 1) * facts.slot_bytes
        if need > free:
            raise ValueError(f"moe_cache needs {need} bytes ({n_slots} expert slots + 1 of {facts.slot_bytes} bytes), "
                             f"more than the {free} bytes free on the device (of {total})")
    return _engine.Engine(
        n_layer=facts.n_layer, n_expert=facts.n_expert, top_k=facts.top_k, n_embd=facts.n_embd,
        moe_layers=list(facts.moe_layers), expert_bytes=[tuple(b) for b in facts.expert_bytes],
        expert_types=[tuple(t) for t in facts.expert_types], n_slots=n_slots,
        device=int(device_ptr or 0), cost_model=cost,
        prefetch_layers=int(prefetch_layers), fill_on_miss=policies.fill_on_miss, routers=facts.routers,
        router_bias=facts.router_bias, sigmoid_gating=facts.sigmoid_gating, cache=policies.cache,
        scheduler=policies.scheduler, prefetcher=policies.prefetcher)
