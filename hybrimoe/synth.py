"""Moved in 0.2: synthetic traces are :mod:`hybrimoe.traces.synthetic`, their statistics :mod:`hybrimoe.traces.stats`.
This alias module goes in 0.3 (CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of

_NAMES = {
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
