"""Moved in 0.2: the GGUF reader is :mod:`hybrimoe.model.reader`, its tables :mod:`hybrimoe.model.tables`, the command
:mod:`hybrimoe.commands.info`. This alias module goes in 0.3 (CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of

_NAMES = {
    "describe": "hybrimoe.model.reader",
    "expert_gating": "hybrimoe.model.reader",
    "expert_variant": "hybrimoe.model.reader",
    "gguf_type_bytes": "hybrimoe.model.reader",
    "EXPERT_KINDS": "hybrimoe.model.tables",
    "LAYER_PARTS": "hybrimoe.model.tables",
    "GATING_FUNCS": "hybrimoe.model.tables",
    "ARCH_ACTIVATION": "hybrimoe.model.tables",
}
__getattr__ = moved(__name__, _NAMES)
__dir__ = names_of(__name__, _NAMES)
