"""Python face of the HybriMoE policy core: the policy base classes and the pure decisions around them.

Policies (subclass in Python; they run inside the C++ simulator and the engine through pybind11 trampolines, and an
exception in one surfaces as RuntimeError naming the policy class and method):

- :class:`CachePolicy`: ``name()``, ``priority(layer, expert) -> float`` (higher keeps longer; ties evict the
  least recently used), optional ``reset(n_layers, n_experts)``, ``observe(obs)``, ``admit(layer, expert)``,
  ``bypass()``, ``prepare(future)``, ``clairvoyant()``. C++: MRS (HybriMoE §IV.D), LRU, LFU, static, Belady.
- :class:`SchedulePolicy`: ``name()``, ``split(layer_input, cost) -> k flags`` (1 = GPU). C++: HybriMoE §IV.B
  greedy (best of greedy / all-CPU / all-GPU), kTransformers-style, GPU on demand, static per layer, exhaustive.
- :class:`PrefetchPolicy`: ``name()``, ``plan(ctx, cache, cost) -> [(layer, expert), ...]``. C++: impact-driven
  (HybriMoE §IV.C), next-layer top-k, none.

Modules, one concept each (a leaf package: it imports the policy core and :mod:`hybrimoe.model` only):

=================  ================================================================================================
``cost_model``     the cost-model JSON format (schema ``hybrimoe.cost_model/4``): load, save, validate
``hardware``       hardware files (``hybrimoe.hardware/1``) and disk files (``hybrimoe.disk/1``), the cost and
                   truth models derived from them,
                   :func:`~hybrimoe.policy.hardware.resolve_cost_model`
``presets``        the policy presets (:data:`~hybrimoe.policy.presets.SYSTEM_PRESETS`) and
                   :func:`~hybrimoe.policy.presets.build_preset`
``budget``         cache budgets (``"25%"``, ``"3GiB"``) as bytes
``profile``        profiles of expert frequencies: one count, the hot-first order
=================  ================================================================================================

The names below are importable from ``hybrimoe.policy`` itself (the API of earlier releases).
"""
from __future__ import annotations

from hybrimoe import _core
from hybrimoe.policy.budget import parse_budget
from hybrimoe.policy.cost_model import (
    COST_FIELDS,
    COST_MODEL_SCHEMA,
    COST_MODEL_SCHEMAS,
    DISK_FIELDS,
    CostModelError,
    cost_model_from_dict,
    cost_model_to_dict,
    load_cost_model,
    save_cost_model,
)
from hybrimoe.policy.hardware import (
    HARDWARE_DIR,
    HARDWARE_FACTS,
    HARDWARE_SCHEMA,
    Hardware,
    cost_model_from_hardware,
    disk_names,
    hardware_names,
    load_disk,
    load_hardware,
    resolve_cost_model,
    set_disk,
    truth_model_for,
)
from hybrimoe.policy.presets import (
    DEFAULT_PRESET,
    ENGINE_PRESETS,
    EXCLUSIVE_RAM_MRS_ALPHA,
    GPU_OVER_EXCLUSIVE_RAM_MRS_ALPHA,
    OPT_IN_PRESETS,
    PROFILE_PRESETS,
    RAM_BASELINES,
    RAM_MRS_ALPHA,
    RAM_PRESETS,
    STATIC_PRESETS,
    STREAMING_FRACTION,
    SYSTEM_PRESETS,
    PolicySet,
    build_preset,
    build_ram_tier,
    gpu_mrs_alpha,
    leading_layers_that_fit,
    ram_cache_policy_of,
    ram_preset,
    system_preset,
)
from hybrimoe.policy.profile import expert_counts, hot_keys_from_counts

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
ReusePolicy = _core.ReusePolicy
HybriMoEScheduler = _core.HybriMoEScheduler
ExhaustiveScheduler = _core.ExhaustiveScheduler
ImpactPrefetcher = _core.ImpactPrefetcher
TopKPrefetcher = _core.TopKPrefetcher
NoPrefetcher = _core.NoPrefetcher

#: earlier names of hardware files' helpers ("preset" now means a policy preset only); kept for one release
preset_names = hardware_names
PRESET_DIR = HARDWARE_DIR

__all__ = [
    "COST_FIELDS", "COST_MODEL_SCHEMA", "COST_MODEL_SCHEMAS", "CostModelError", "cost_model_from_dict",
    "cost_model_to_dict", "load_cost_model", "save_cost_model", "HARDWARE_DIR", "HARDWARE_FACTS", "HARDWARE_SCHEMA",
    "Hardware", "cost_model_from_hardware", "hardware_names", "load_hardware", "resolve_cost_model",
    "truth_model_for", "DEFAULT_PRESET", "ENGINE_PRESETS", "PROFILE_PRESETS", "STATIC_PRESETS",
    "STREAMING_FRACTION", "SYSTEM_PRESETS", "PolicySet", "build_preset", "leading_layers_that_fit", "system_preset",
    "RAM_BASELINES", "RAM_MRS_ALPHA", "RAM_PRESETS", "build_ram_tier", "GPU_OVER_EXCLUSIVE_RAM_MRS_ALPHA",
    "EXCLUSIVE_RAM_MRS_ALPHA",
    "gpu_mrs_alpha", "OPT_IN_PRESETS", "ram_cache_policy_of", "ram_preset",
    "expert_counts", "hot_keys_from_counts", "parse_budget", "CachePolicy", "SchedulePolicy", "PrefetchPolicy",
    "CostModel", "ExpertCache", "LayerInput", "MRSPolicy", "LRUPolicy", "LFUPolicy", "StaticPolicy", "BeladyPolicy",
    "ReusePolicy",
    "HybriMoEScheduler", "ExhaustiveScheduler", "ImpactPrefetcher", "TopKPrefetcher", "NoPrefetcher",
    "preset_names", "PRESET_DIR", "DISK_FIELDS", "disk_names", "load_disk", "set_disk",
]
