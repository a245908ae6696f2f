"""Moved in 0.2: the trace format is :mod:`hybrimoe.traces.format`, synthetic traces :mod:`hybrimoe.traces.synthetic`.
This alias module goes in 0.3 (CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of

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
    "DEFAULT_TOPK_MASS": "hybrimoe.traces.synthetic",
    "FITTED_DSV2_LITE": "hybrimoe.traces.synthetic",
    "LOCALITY": "hybrimoe.traces.synthetic",
    "SHAPES": "hybrimoe.traces.synthetic",
    "Knobs": "hybrimoe.traces.synthetic",
    "calibrate": "hybrimoe.traces.synthetic:solve_parameters",
    "solve_parameters": "hybrimoe.traces.synthetic",
    "fit_synthetic": "hybrimoe.traces.synthetic",
    "resolve_knobs": "hybrimoe.traces.synthetic",
    "synthetic_trace": "hybrimoe.traces.synthetic",
    "default_prompts": "hybrimoe.traces.synthetic",
    "DEFAULT_PROMPT_TOKENS": "hybrimoe.traces.synthetic",
    "SYNTH_FORMAT": "hybrimoe.traces.synthetic",
    "PERSIST_LAG": "hybrimoe.traces.stats",
    "STAT_LAGS": "hybrimoe.traces.stats",
    "routing_stats": "hybrimoe.traces.stats",
}
__getattr__ = moved(__name__, _NAMES)
__dir__ = names_of(__name__, _NAMES)
