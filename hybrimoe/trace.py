"""Moved in 0.2: the trace format is :mod:`hybrimoe.traces.format`, synthetic traces :mod:`hybrimoe.traces.synthetic`.
This alias module goes in 0.3 (CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of
from hybrimoe.synth import _NAMES as _SYNTH_NAMES

_NAMES = {
    "RoutingTrace": "hybrimoe.traces.format",
    "load_trace": "hybrimoe.traces.format",
    "default_trace_path": "hybrimoe.traces.format",
    "FORMAT": "hybrimoe.traces.format",
    "FORMAT_VERSION": "hybrimoe.traces.format",
    "PHASE_PREFILL": "hybrimoe.traces.format",
    "PHASE_DECODE": "hybrimoe.traces.format",
    "REPO_ROOT": "hybrimoe.traces.format",
    "MODEL_FACTS": "hybrimoe.model.facts",
    "ModelFacts": "hybrimoe.model.facts",
    "facts_from_gguf": "hybrimoe.model.facts",
    "selection_bias_from_gguf": "hybrimoe.model.facts",
    "GATINGS": "hybrimoe.model.tables",
    **_SYNTH_NAMES,
}
__getattr__ = moved(__name__, _NAMES)
__dir__ = names_of(__name__, _NAMES)
