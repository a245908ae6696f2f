"""Python face of the HybriMoE policy core: policy base classes, cost models, hardware presets, system presets.

Policies (subclass in Python; they run inside the C++ simulator through pybind11 trampolines, and an exception in
one surfaces as RuntimeError naming the policy class and method):

- :class:`CachePolicy`: ``name()``, ``priority(layer, expert) -> float`` (higher keeps longer; ties evict the
  least recently used), optional ``reset(n_layers, n_experts)``, ``observe(obs)``, ``admit(layer, expert)``,
  ``bypass()``, ``prepare(future)``, ``clairvoyant()``. C++: MRS (HybriMoE §IV.D), LRU, LFU, static, Belady.
- :class:`SchedulePolicy`: ``name()``, ``split(layer_input, cost) -> k flags`` (1 = GPU). C++: HybriMoE §IV.B
  greedy (best of greedy / all-CPU / all-GPU), kTransformers-style, GPU on demand, static per layer, exhaustive.
- :class:`PrefetchPolicy`: ``name()``, ``plan(ctx, cache, cost) -> [(layer, expert), ...]``. C++: impact-driven
  (HybriMoE §IV.C), next-layer top-k, none.

Cost model JSON, schema ``hybrimoe.cost_model/3`` (all times in seconds, bandwidth in bytes/s; ``/2`` files,
without ``cpu_copy_overlap`` and ``cpu_c_s``, read with 1 and 0; ``/1`` files, without ``copy_overlap`` either, read
with it 1)::

    {"schema": "hybrimoe.cost_model/3",
     "cpu_a_s": float, "cpu_b_s": float, "cpu_c_s": float,         # CPU expert: a + b*n + c*min(n, 8) (n tokens)
     "cpu_startup_s": float,                                        # (+ start-up once per layer)
     "gpu_a_s": float, "gpu_b_s": float,                            # GPU expert: a + b*tokens
     "h2d_bandwidth_Bps": float, "h2d_latency_s": float,            # copy: bytes/bandwidth + latency
     "act_a_s": float, "act_b_s": float,                            # activation round trip of a GPU share
     "layer_a_s": float, "layer_b_s": float,                        # non-expert work of a MoE layer
     "dense_a_s": float, "dense_b_s": float,                        # a dense layer
     "copy_overlap": float,                                         # 0..1: device computes while it copies
     "cpu_copy_overlap": float,                                     # 0..1: host CPU share runs while it copies
     "sources": {field: str, ...}}                                  # optional: where each number comes from

Every listed number is required, finite and >= 0 (bandwidth > 0, the overlaps <= 1); unknown keys are errors;
NaN and Infinity (which Python's json reads and writes) are reported as bad values. ``copy_overlap``: the share of a
host-to-device copy's time during which the device still computes (1: a GPU's copy engine runs beside compute; 0: the
device does one thing at a time, as the RPC stand-in does). ``cpu_copy_overlap``: the share of a copy's time during
which the host's CPU share still runs at full speed (1: copies cost the CPU nothing; 0: the copies issued for a layer
delay its CPU share by their whole time; between: host-memory contention). This module is the only reader and writer
of these files (:func:`load_cost_model`, :func:`save_cost_model`, :func:`cost_model_from_dict`,
:func:`cost_model_to_dict`); the engine and the simulator are handed the resulting ``CostModel`` object.

Hardware preset JSON, schema ``hybrimoe.hardware/1`` (files in ``hybrimoe/presets/``): ``name``,
``description`` and ``facts``: ``{fact: {"value": number, "source": str}}`` with the facts in
:data:`HARDWARE_FACTS`. :func:`cost_model_from_hardware` turns a preset and a model's facts into a CostModel.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from hybrimoe import _core
from hybrimoe.facts import ModelFacts

CachePolicy = _core.CachePolicy
SchedulePolicy = _core.SchedulePolicy
PrefetchPolicy = _core.PrefetchPolicy
CostModel = _core.CostModel
ExpertCache = _core.ExpertCache
LayerInput = _core.LayerInput
MRSPolicy = _core.MRSPolicy
LRUPolicy = _core.LRUPolicy
LFUPolicy = _core.LFUPolicy
StaticPolicy = _core.StaticPolicy
BeladyPolicy = _core.BeladyPolicy
HybriMoEScheduler = _core.HybriMoEScheduler
ExhaustiveScheduler = _core.ExhaustiveScheduler
ImpactPrefetcher = _core.ImpactPrefetcher
TopKPrefetcher = _core.TopKPrefetcher
NoPrefetcher = _core.NoPrefetcher

PRESET_DIR = Path(__file__).resolve().parent / "presets"
COST_MODEL_SCHEMA = "hybrimoe.cost_model/3"         # written
COST_MODEL_SCHEMA_V2 = "hybrimoe.cost_model/2"      # still read: no cpu_copy_overlap (read as 1), no cpu_c_s (0)
COST_MODEL_SCHEMA_V1 = "hybrimoe.cost_model/1"      # still read: no copy_overlap either (both read as 1)
COST_MODEL_SCHEMAS = (COST_MODEL_SCHEMA, COST_MODEL_SCHEMA_V2, COST_MODEL_SCHEMA_V1)  # read
#: the schema version each field first appeared in (an older document reads CostModel's default, 1, for it)
_FIELD_SINCE = {"copy_overlap": 2, "cpu_copy_overlap": 3, "cpu_c_s": 3}
HARDWARE_SCHEMA = "hybrimoe.hardware/1"
COST_FIELDS = ("cpu_a_s", "cpu_b_s", "cpu_c_s", "cpu_startup_s", "gpu_a_s", "gpu_b_s", "h2d_bandwidth_Bps",
               "h2d_latency_s", "act_a_s", "act_b_s", "layer_a_s", "layer_b_s", "dense_a_s", "dense_b_s",
               "copy_overlap", "cpu_copy_overlap")
HARDWARE_FACTS = ("gpu_mem_bandwidth_Bps", "gpu_mem_efficiency", "gpu_effective_flops", "gpu_kernel_launch_s",
                  "gpu_kernels_per_expert", "gpu_kernels_per_layer", "cpu_mem_bandwidth_Bps", "cpu_mem_efficiency",
                  "cpu_effective_flops", "cpu_startup_s", "h2d_bandwidth_Bps", "h2d_latency_s", "gpu_memory_bytes")


class CostModelError(ValueError):
    """A cost-model or hardware-preset file that cannot be used (names the file and the problem)."""


# ---- cost model JSON -------------------------------------------------------------------------------------------

def _json_type(v) -> str:
    """JSON's name for the type of a parsed value (a Python type name for what JSON cannot hold)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (list, tuple)):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _shown(v) -> str:
    """A bad value as an error message shows it: a number as JSON writes it (NaN, Infinity), a string quoted, else
    its JSON type."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    return _json_type(v)


def _cost_model_and_sources(doc, where: str) -> tuple["_core.CostModel", dict]:
    """(CostModel, sources) of a parsed cost-model document; raises CostModelError naming ``where`` and the field."""
    if not isinstance(doc, dict):
        raise CostModelError(f"{where}: expected a JSON object, got {_json_type(doc)}")
    schema = doc.get("schema")
    if schema not in COST_MODEL_SCHEMAS:
        got = "nothing" if "schema" not in doc else _shown(schema) if isinstance(schema, str) else _json_type(schema)
        raise CostModelError(f"{where}: 'schema' must be '{COST_MODEL_SCHEMA}' (or '{COST_MODEL_SCHEMA_V2}', "
                             f"'{COST_MODEL_SCHEMA_V1}'), got {got}")
    version = 3 - COST_MODEL_SCHEMAS.index(schema)
    unknown = [str(k) for k in doc if k not in ("schema", "sources", *COST_FIELDS)]
    if unknown:
        raise CostModelError(f"{where}: unknown field(s) {', '.join(unknown)}")
    cm = _core.CostModel()
    for f in COST_FIELDS:
        if _FIELD_SINCE.get(f, 1) > version:
            if f in doc:
                raise CostModelError(f"{where}: field '{f}' is not in schema {schema}")
            continue  # an older schema: CostModel's default (overlaps 1: copies beside compute, free for the CPU; c 0)
        if f not in doc:
            raise CostModelError(f"{where}: missing field '{f}'")
        v = doc[f]
        try:
            x = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
        except OverflowError:  # an integer beyond the float range
            x = math.inf
        if not (math.isfinite(x) and x >= 0.0):
            raise CostModelError(f"{where}: field '{f}' must be a finite number >= 0, got {_shown(v)}")
        setattr(cm, f, x)
    if cm.h2d_bandwidth_Bps <= 0.0:
        raise CostModelError(f"{where}: field 'h2d_bandwidth_Bps' must be > 0")
    for f in ("copy_overlap", "cpu_copy_overlap"):
        if getattr(cm, f) > 1.0:
            raise CostModelError(f"{where}: field '{f}' must be in [0, 1]")
    sources = doc.get("sources", {})
    if not isinstance(sources, dict):
        raise CostModelError(f"{where}: 'sources' must be an object of strings, got {_json_type(sources)}")
    for k, v in sources.items():
        if not isinstance(v, str):
            raise CostModelError(f"{where}: sources['{k}'] must be a string")
    try:
        cm.validate()  # the C++ rules the engine and the simulator hold a CostModel to
    except ValueError as e:
        raise CostModelError(f"{where}: {e}") from e
    return cm, dict(sources)


def cost_model_from_dict(d: dict, where: str = "cost model") -> "_core.CostModel":
    """CostModel from a ``hybrimoe.cost_model/3`` (or ``/2``, ``/1``) dict, as :func:`json.load` gives it.

    Raises:
        CostModelError: not a dict, wrong schema, or a missing, unknown or bad field (named, with ``where``).
    """
    return _cost_model_and_sources(d, where)[0]


def cost_model_to_dict(cm: "_core.CostModel", sources: Optional[dict] = None,
                       where: str = "cost model") -> dict:
    """The ``hybrimoe.cost_model/3`` dict of a CostModel: the schema, every field as a float, and ``"sources"``
    (str -> str, sorted by field) when given and not empty.

    Raises:
        CostModelError: a field is not finite (named, with ``where``): JSON has no such number.
    """
    d: dict = {"schema": COST_MODEL_SCHEMA}
    for f in COST_FIELDS:
        x = float(getattr(cm, f))
        if not math.isfinite(x):
            raise CostModelError(f"{where}: field '{f}' is not finite ({_shown(x)}) and cannot be written")
        d[f] = x
    src = _sources_map(sources)
    if src:
        d["sources"] = dict(sorted(src.items()))
    return d


def _sources_map(sources: Optional[dict]) -> dict:
    """``sources`` as the str -> str map the schema stores."""
    return {str(k): str(v) for k, v in (sources or {}).items()}


def load_cost_model(path: Union[str, os.PathLike]) -> "_core.CostModel":
    """Reads a cost-model JSON file (UTF-8).

    Raises:
        CostModelError (a ValueError), naming the path: unreadable file, not JSON (with line and column), or a
        document :func:`cost_model_from_dict` refuses.
    """
    p = os.fspath(path)
    where = f"cost model {p}"
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise CostModelError(f"cannot read cost model {p}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise CostModelError(f"{where} is not valid JSON: not UTF-8 text (byte {e.start})") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CostModelError(f"{where} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from e
    except RecursionError as e:
        raise CostModelError(f"{where} is not valid JSON: nesting too deep") from e
    return _cost_model_and_sources(doc, where)[0]


def save_cost_model(cm: "_core.CostModel", path: Union[str, os.PathLike], sources: Optional[dict] = None) -> None:
    """Writes a cost-model JSON file (schema above, UTF-8, indented). Numbers are written as Python's ``repr`` of
    the float, the shortest text that reads back to the same double, so a saved model loads bit for bit.

    Raises:
        CostModelError, naming the path: a field is not finite, or the file cannot be written.
    """
    p = os.fspath(path)
    text = json.dumps(cost_model_to_dict(cm, sources, where=f"cost model {p}"), indent=2, ensure_ascii=False,
                      allow_nan=False) + "\n"
    try:
        with open(p, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        raise CostModelError(f"cannot write cost model {p}: {e.strerror or e}") from e


# ---- hardware presets --------------------------------------------------------------------------------------------

def preset_names() -> list[str]:
    """Names of the bundled hardware presets."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


@dataclass
class Hardware:
    """A hardware preset: ``facts[name] = value`` (SI units) and ``sources[name]`` (why that number)."""

    name: str
    description: str
    facts: dict
    sources: dict


def load_hardware(name_or_path: str) -> Hardware:
    """Loads a bundled preset by name (see :func:`preset_names`) or a preset JSON file by path.

    Raises ValueError naming an unknown preset, and CostModelError for corrupt JSON, a wrong schema, or a fact
    that is missing, not a positive finite number, or without a source string.
    """
    p = Path(name_or_path)
    if not p.suffix == ".json":
        p = PRESET_DIR / f"{name_or_path}.json"
        if not p.is_file():
            raise ValueError(f"unknown hardware preset '{name_or_path}' (known: {', '.join(preset_names())}), and "
                             "no such file either (a preset or cost-model file is a .json path)")
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise CostModelError(f"cannot read hardware preset {p}: {e}") from e
    except json.JSONDecodeError as e:
        raise CostModelError(f"hardware preset {p} is not valid JSON: {e}") from e
    if not isinstance(d, dict) or d.get("schema") != HARDWARE_SCHEMA or not isinstance(d.get("facts"), dict):
        raise CostModelError(f"hardware preset {p}: expected schema '{HARDWARE_SCHEMA}' with a 'facts' object")
    facts, sources = {}, {}
    for f in HARDWARE_FACTS:
        entry = d["facts"].get(f)
        if not isinstance(entry, dict) or "value" not in entry:
            raise CostModelError(f"hardware preset {p}: missing fact '{f}' ({{'value': ..., 'source': ...}})")
        v = entry["value"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise CostModelError(f"hardware preset {p}: fact '{f}' must be a positive number, got {v!r}")
        if not isinstance(entry.get("source"), str) or not entry["source"].strip():
            raise CostModelError(f"hardware preset {p}: fact '{f}' has no source")
        facts[f], sources[f] = float(v), entry["source"]
    return Hardware(name=str(d.get("name", p.stem)), description=str(d.get("description", "")), facts=facts,
                    sources=sources)


def cost_model_from_hardware(hw: Hardware, model: ModelFacts) -> "_core.CostModel":
    """Derives a CostModel for ``model`` on ``hw`` (docs/design.md §1 and §6).

    - CPU expert: reading its bytes at the effective host bandwidth (a decode-time expert is bandwidth bound), plus
      2*params FLOP per token at the effective CPU throughput; start-up from the preset.
    - GPU expert: kernel launches + reading its bytes at effective GPU bandwidth, plus 2*params FLOP per token.
    - Copy: the preset's effective link bandwidth and latency.
    - Activations: hidden state (fp32, n_embd) to the GPU and back per token, plus two link latencies.
    - Non-expert work of a layer (attention, router, shared experts, norms) and dense layers: launches + weight
      bytes at GPU bandwidth, plus 2*params FLOP per token; counts and bytes are the model's facts (a GGUF's real
      tensors with :func:`hybrimoe.facts.facts_from_gguf`; params x bytes per param where only counts are known).
    - Copies overlap compute (``copy_overlap`` 1): an assumption for discrete GPUs, whose copy engines run beside the
      compute queue (the engine copies on a second stream).
    - What copies cost the CPU share (``cpu_copy_overlap = 1 - h2d bandwidth / effective host bandwidth``, at
      least 0): an assumption of the planner: a copy's DMA reads host memory at the link's bandwidth, which a
      bandwidth-bound CPU expert running beside it loses (the copy-aware planner charges that share of every copy
      queued for a layer to its CPU share). The simulator's truth model charges the same physics in another form,
      per overlapped second (:func:`truth_model_for`); HybriMoE §IV.B itself keeps PCIe on a timeline of its own.
    """
    f = hw.facts
    gpu_bw = f["gpu_mem_bandwidth_Bps"] * f["gpu_mem_efficiency"]
    cpu_bw = f["cpu_mem_bandwidth_Bps"] * f["cpu_mem_efficiency"]
    launch = f["gpu_kernel_launch_s"]
    cm = _core.CostModel()
    cm.cpu_a_s = model.expert_bytes / cpu_bw
    cm.cpu_b_s = 2.0 * model.expert_params / f["cpu_effective_flops"]
    cm.cpu_c_s = 0.0
    cm.cpu_startup_s = f["cpu_startup_s"]
    cm.gpu_a_s = f["gpu_kernels_per_expert"] * launch + model.expert_bytes / gpu_bw
    cm.gpu_b_s = 2.0 * model.expert_params / f["gpu_effective_flops"]
    cm.h2d_bandwidth_Bps = f["h2d_bandwidth_Bps"]
    cm.h2d_latency_s = f["h2d_latency_s"]
    cm.act_a_s = 2.0 * f["h2d_latency_s"]
    cm.act_b_s = 2.0 * model.n_embd * 4 / f["h2d_bandwidth_Bps"]
    ne_bytes = model.moe_layer_other_bytes()
    cm.layer_a_s = f["gpu_kernels_per_layer"] * launch + ne_bytes / gpu_bw
    cm.layer_b_s = 2.0 * model.non_expert_params_per_moe_layer / f["gpu_effective_flops"]
    dense_bytes = model.dense_bytes()
    cm.dense_a_s = f["gpu_kernels_per_layer"] * launch + dense_bytes / gpu_bw
    cm.dense_b_s = 2.0 * model.dense_layer_params / f["gpu_effective_flops"]
    cm.copy_overlap = 1.0
    cm.cpu_copy_overlap = max(0.0, 1.0 - f["h2d_bandwidth_Bps"] / cpu_bw)
    cm.validate()
    return cm


def truth_model_for(hw: Hardware, seed: int = 1) -> "_core.TruthModel":
    """The simulator's "truth" (what the planner does not see), documented assumptions:

    per-task log-normal noise (CPU 10%, GPU 5%, copy 5%, activations 10%, non-expert 3%), an extra first-CPU-expert
    overhead of half the planned start-up, and memory-bandwidth contention: while the link copies from host memory,
    CPU experts slow by (link bandwidth / effective host bandwidth) of the overlapped time.
    """
    t = _core.TruthModel()
    t.seed = int(seed)
    t.cpu_startup_extra_s = 0.5 * hw.facts["cpu_startup_s"]
    t.contention = hw.facts["h2d_bandwidth_Bps"] / (hw.facts["cpu_mem_bandwidth_Bps"] *
                                                    hw.facts["cpu_mem_efficiency"])
    t.validate()
    return t


# ---- budgets -----------------------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "kib": 1024.0,
          "mib": 1024.0 ** 2, "gib": 1024.0 ** 3}


def parse_budget(spec: Union[str, float, int], total_expert_bytes: float, expert_bytes: float) -> float:
    """Budget in bytes from ``"25%"`` (of all routed-expert bytes), ``"3GiB"``, ``"512MB"`` or a number of bytes.

    0 is valid (nothing cached). Raises ValueError on an unparsable spec, a negative budget, a percentage above
    100, or a positive budget smaller than one expert (``expert_bytes``).
    """
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        b = float(spec)
    else:
        s = str(spec).strip().lower()
        m = re.fullmatch(r"([-+]?[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(%|[a-z]*)", s)
        if not m or (m.group(2) not in _UNITS and m.group(2) != "%"):
            raise ValueError(f"cannot parse cache budget {spec!r}: use e.g. '25%', '3GiB', '512MB' or bytes")
        v = float(m.group(1))
        if m.group(2) == "%":
            if v < 0 or v > 100:
                raise ValueError(f"cache budget {spec!r}: a percentage must be within 0..100")
            b = v / 100.0 * total_expert_bytes
        else:
            b = v * _UNITS[m.group(2)]
    if not math.isfinite(b) or b < 0:
        raise ValueError(f"cache budget {spec!r} is negative or not finite")
    if 0 < b < expert_bytes:
        raise ValueError(f"cache budget {spec!r} = {b:.0f} bytes is smaller than one expert ({expert_bytes:.0f} "
                         "bytes); use 0 for no cache")
    return b


# ---- system presets -------------------------------------------------------------------------------------------------
# The one place that says what each preset is made of; the engine (hybrimoe.engine) and the simulator
# (hybrimoe.simulate) both build their policies with build_preset().

#: Each preset: its components (``scheduler``, ``cache``, ``prefetch``, ``fill``), whether its prefetcher sees the
#: true routing (``oracle``) or its cache the future (``clairvoyant``: simulator only), whether it needs a profile
#: of expert frequencies (``needs_profile``: the simulator's profiling prompts, the engine's ``moe_profile``),
#: ``about`` (what it does) and ``source`` (the system or document whose behaviour it reproduces). A clairvoyant
#: preset may name other clairvoyant presets in ``also``: the simulator runs each and reports the fastest plan
#: (hybrimoe.simulate.Setup.run), since a planner that knows the routing can time every plan before choosing.
#: ``streaming``: demand loads of a (layer, ubatch) whose router activated at least this fraction of the layer's
#: experts enter the cache on probation (:meth:`hybrimoe._core.ExpertCache.set_streaming_demand`; LIP insertion,
#: Qureshi et al., ISCA 2007): in a large prefill ubatch every resident is needed again at its layer's next visit,
#: so a demand load should reuse the slot of the previous one instead of evicting a resident. A decode token
#: activates top_k of the experts (at most a quarter in the shapes of hybrimoe.facts), so it never streams.
STREAMING_FRACTION = 0.5
SYSTEM_PRESETS = {
    "hybrimoe": dict(scheduler="hybrimoe", cache="mrs", prefetch="impact", fill=True, oracle=False,
                     clairvoyant=False, needs_profile=False, admission="tinylfu", streaming=STREAMING_FRACTION,
                     about="HybriMoE split + MRS cache (TinyLFU admission; demand loads of a ubatch that "
                           "activates half a layer's experts or more enter at the lowest eviction rank, LIP) + "
                           "impact-driven prefetch",
                     source="Zhong et al., HybriMoE, arXiv:2504.05897, §IV.B-D (docs/design.md §2-§4)"),
    "hybrimoe-lru": dict(scheduler="hybrimoe", cache="lru", prefetch="impact", fill=True, oracle=False,
                         clairvoyant=False, needs_profile=False, admission="tinylfu", streaming=STREAMING_FRACTION,
                         about="HybriMoE split + LRU cache (TinyLFU admission; demand loads of a ubatch that "
                               "activates half a layer's experts or more enter at the lowest eviction rank, LIP) + "
                               "impact-driven prefetch",
                         source="HybriMoE §IV.D's LRU comparison (MRS replaced by LRU)"),
    "ktransformers": dict(scheduler="ktransformers", cache="static-leading-layers", prefetch="none", fill=False,
                          oracle=False, clairvoyant=False, needs_profile=False,
                          about="the experts of the leading MoE layers resident (as many whole layers as fit), "
                                "every other expert on the CPU, nothing loaded at run time",
                          source="the HybriMoE authors' kTransformers optimize rules (Qwen2-25%.yaml and siblings "
                                 "in their repository) keep whole leading layers' experts on the GPU; the rule "
                                 "files are not in this repository: the layer choice follows a description of "
                                 "them, not the files"),
    "hot-set": dict(scheduler="ktransformers", cache="static-frequency", prefetch="none", fill=False,
                    oracle=False, clairvoyant=False, needs_profile=True,
                    about="a static set of the most frequently routed experts of a profile resident, every other "
                          "expert on the CPU, nothing loaded at run time",
                    source="docs/design.md §5: the 'kTransformers-style' baseline, a static hot set chosen by "
                           "profiled frequency (the comparison point of HybriMoE, arXiv:2504.05897, §V)"),
    "upstream-ncmoe": dict(scheduler="upstream-ncmoe", cache="static-layers", prefetch="none", fill=False,
                           oracle=False, clairvoyant=False, needs_profile=False,
                           about="llama.cpp --n-cpu-moe: the last MoE layers' experts resident (as many whole "
                                 "layers as fit), the rest on the CPU",
                           source="upstream llama.cpp --n-cpu-moe N (common/arg.cpp of the pinned tree: the "
                                  "experts of the first N layers stay on the CPU)"),
    "gpu-on-demand": dict(scheduler="gpu-on-demand", cache="lru", prefetch="none", fill=False, oracle=False,
                          clairvoyant=False, needs_profile=False,
                          about="every expert on GPU, LRU cache, load on demand",
                          source="GPU-only on-demand loading as in AdapMoE and MoE-Infinity (arXiv:2401.14361); "
                                 "docs/design.md §5"),
    "belady": dict(scheduler="hybrimoe", cache="belady", prefetch="impact", fill=True, oracle=False,
                   clairvoyant=True, needs_profile=False,
                   about="bound: hybrimoe with a clairvoyant (Belady, bypass) cache",
                   source="Belady's MIN with bypass (docs/design.md §5 bounds)"),
    "oracle": dict(scheduler="exhaustive", cache="belady", prefetch="impact", fill=True, oracle=True,
                   clairvoyant=True, needs_profile=False, also=("belady",),
                   about="bound: clairvoyant cache + exhaustive split + oracle prefetch, or belady's plan where "
                         "that is faster (a planner that knows the routing can simulate both and keep the better)",
                   source="docs/design.md §5 bounds"),
}
#: the presets the engine runs: those that need no knowledge of the future routing
ENGINE_PRESETS = tuple(n for n, s in SYSTEM_PRESETS.items() if not s["clairvoyant"])
#: the presets that need a profile of expert frequencies (the engine's ``moe_profile``)
PROFILE_PRESETS = tuple(n for n, s in SYSTEM_PRESETS.items() if s["needs_profile"])
DEFAULT_PRESET = "hybrimoe"


def system_preset(name: str) -> dict:
    """The component names of a system preset; ValueError naming an unknown preset."""
    if name not in SYSTEM_PRESETS:
        raise ValueError(f"unknown policy preset '{name}' (known: {', '.join(SYSTEM_PRESETS)})")
    return dict(SYSTEM_PRESETS[name])


@dataclass
class PolicySet:
    """The policy objects of one run (hybrimoe._core): cache, scheduler and prefetcher, whether CPU-computed misses
    are offered to the cache as fills, whether the prefetcher is shown the true routing (``oracle``), and a name."""

    cache: object
    scheduler: object
    prefetcher: object
    fill_on_miss: bool
    name: str
    oracle: bool = False


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


def hot_keys_from_counts(counts) -> list[int]:
    """Keys ``layer * n_experts + expert``, hottest first, of a profile: ``counts`` ``[moe_layers, experts]`` (or
    flat), activations per (MoE layer, expert). Ties (equal counts, zeros included) go to the lower key. This is
    the order both the simulator (its profiling prompts) and the engine (``moe_profile``) fill caches in."""
    import numpy as np

    c = np.asarray(counts, dtype=np.float64).ravel()
    return [int(k) for k in np.lexsort((np.arange(c.size), -c))]


def build_preset(spec: Union[str, dict], expert_bytes: Sequence[float], n_experts: int, budget_bytes: float, *,
                 prefetch: bool = True, hot_keys: Optional[Sequence[int]] = None,
                 profile: Optional[Sequence[float]] = None, name: Optional[str] = None) -> PolicySet:
    """Builds the policies of a system preset (:data:`SYSTEM_PRESETS`) or of a dict of components: the one place
    that gives a preset its meaning, for the engine (:func:`hybrimoe.engine.build_policies`) and the simulator
    (:class:`hybrimoe.simulate.Setup`) alike.

    ``spec``: a preset name or a dict with keys ``scheduler``, ``cache``, ``prefetch`` (names as in
    ``hybrimoe._core.make_*``, or policy objects), ``fill`` (bool), ``admission`` (``"none"``, the default for
    dicts, or ``"tinylfu"``: :meth:`hybrimoe._core.ExpertCache.set_frequency_admission`, which the ``hybrimoe``
    presets use) and ``streaming`` (0, the default for dicts, or a fraction of a layer's experts:
    :data:`STREAMING_FRACTION`, :meth:`hybrimoe._core.ExpertCache.set_streaming_demand`). ``expert_bytes``: bytes
    of one expert per MoE layer (the engine passes its slot size for every layer); ``budget_bytes``: the GPU cache
    budget, bytes.
    ``prefetch=False`` replaces the prefetcher with none (prefetch depth 0). ``hot_keys``: keys ``layer *
    n_experts + expert`` hottest first (:func:`hot_keys_from_counts`), from a profile (the simulator's profiling
    prompts, the engine's ``moe_profile``); ``profile``: the counts per key (flat ``[moe_layers * experts]``), the
    static hot set's priorities.

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
        if spec.get("admission", "none") not in ("none", "tinylfu"):
            raise ValueError(f"policy dict: unknown admission {spec['admission']!r} (none, tinylfu)")
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
    fill = bool(comp.get("fill", True))
    n_cpu_layers = 0
    c = comp["cache"]
    if isinstance(c, _core.CachePolicy):
        cache = _core.ExpertCache(eb, E, budget_bytes, c)
    elif c == "static-layers":
        n_gpu_layers = min(L, int(budget_bytes // (eb[0] * E))) if E and budget_bytes > 0 else 0
        n_cpu_layers = L - n_gpu_layers
        keys = [l * E + e for l in range(n_cpu_layers, L) for e in range(E)]
        cache = _core.ExpertCache(eb, E, budget_bytes, _core.StaticPolicy(keys, []))
        cache.fill(keys)
    elif c == "static-leading-layers":
        n_gpu_layers = leading_layers_that_fit(eb, E, budget_bytes) if budget_bytes > 0 else 0
        keys = [l * E + e for l in range(n_gpu_layers) for e in range(E)]
        cache = _core.ExpertCache(eb, E, budget_bytes, _core.StaticPolicy(keys, []))
        cache.fill(keys)
    elif c == "static-frequency":
        if hot_keys is None:
            raise ValueError(f"'{name}': the static-frequency cache (a profiled hot set) needs a profile of expert "
                             "frequencies (hot_keys: the engine's moe_profile, --moe-profile TRACE.npz), and none was given")
        n_fit = int(budget_bytes // eb[0]) if budget_bytes > 0 and eb else 0
        keys = [int(k) for k in hot_keys[:n_fit]]
        prio = [float(profile[k]) for k in keys] if profile is not None else []
        cache = _core.ExpertCache(eb, E, budget_bytes, _core.StaticPolicy(keys, prio))
        cache.fill(keys)
    else:
        cache = _core.ExpertCache(eb, E, budget_bytes, _core.make_cache_policy(str(c)))
        if hot_keys is not None and budget_bytes > 0:
            cache.fill([int(k) for k in hot_keys])
    if comp.get("admission", "none") == "tinylfu":
        cache.set_frequency_admission(True)
    if comp.get("streaming", 0.0):
        cache.set_streaming_demand(float(comp["streaming"]))
    sched = comp["scheduler"]
    if not isinstance(sched, _core.SchedulePolicy):
        sched = _core.make_scheduler(str(sched), n_cpu_layers)
    pre = comp["prefetch"]
    if not isinstance(pre, _core.PrefetchPolicy):
        pre = _core.make_prefetcher(str(pre) if prefetch else "none")
    return PolicySet(cache=cache, scheduler=sched, prefetcher=pre, fill_on_miss=fill, name=name,
                     oracle=bool(comp.get("oracle", False)))
