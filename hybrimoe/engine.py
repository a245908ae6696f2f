"""Moved in 0.2: the engine's set-up is :mod:`hybrimoe.runtime.setup`, its model facts
:mod:`hybrimoe.runtime.engine_facts`. This alias module goes in 0.3 (CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of

_NAMES = {
    "EngineFacts": "hybrimoe.runtime.engine_facts",
    "engine_facts": "hybrimoe.runtime.engine_facts",
    "slot_bytes": "hybrimoe.runtime.engine_facts",
    "_engine_module": "hybrimoe.runtime.engine_facts:engine_module",
    "cache_slots": "hybrimoe.runtime.setup",
    "load_profile": "hybrimoe.runtime.setup",
    "build_policies": "hybrimoe.runtime.setup",
    "make_engine": "hybrimoe.runtime.setup",
    "gpu_work_bytes": "hybrimoe.runtime.setup",
    "auto_slots": "hybrimoe.runtime.setup",
    "EngineSetup": "hybrimoe.runtime.setup",
    "require_accelerator": "hybrimoe.runtime.setup",
    "EXPS_REGEX": "hybrimoe.model.tables",
    "layer_totals": "hybrimoe.runtime.stats",
    "host_buffer_type_name": "hybrimoe._ggml",
    "device_memory": "hybrimoe._ggml",
    "max_buffer_bytes": "hybrimoe.envs",
    "resolve_cost_model": "hybrimoe.runtime.setup:resolve_engine_cost_model",
}
__getattr__ = moved(__name__, _NAMES)
__dir__ = names_of(__name__, _NAMES)
