"""Moved in 0.2: model facts are :mod:`hybrimoe.model.facts`. This alias module goes in 0.3 (CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of

_NAMES = {
    "ModelFacts": "hybrimoe.model.facts",
    "MODEL_FACTS": "hybrimoe.model.facts",
    "FACTS_SCHEMA": "hybrimoe.model.facts",
    "facts_from_gguf": "hybrimoe.model.facts",
    "facts_from_description": "hybrimoe.model.facts",
    "selection_bias_from_gguf": "hybrimoe.model.facts",
    "bits_per_weight": "hybrimoe.model.facts",
    "q4_k_m_expert_bytes": "hybrimoe.model.facts",
    "QUANT_BLOCKS": "hybrimoe.model.facts",
    "GATINGS": "hybrimoe.model.tables",
}
__getattr__ = moved(__name__, _NAMES)
__dir__ = names_of(__name__, _NAMES)
