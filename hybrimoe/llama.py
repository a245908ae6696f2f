"""Moved in 0.2: :class:`hybrimoe.Llama` is :mod:`hybrimoe.runtime.llama`, its parameter handling
:mod:`hybrimoe.runtime.params`. This alias module goes in 0.3 (CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of

_NAMES = {
    "Llama": "hybrimoe.runtime.llama",
    "parse_tensor_overrides": "hybrimoe.runtime.params",
    "moe_overrides": "hybrimoe.runtime.params",
    "check_gguf": "hybrimoe.model.reader",
}
__getattr__ = moved(__name__, _NAMES)
__dir__ = names_of(__name__, _NAMES)
