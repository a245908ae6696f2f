"""Moved in 0.2: every default and environment variable is in :mod:`hybrimoe.envs`. This alias module goes in 0.3
(CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of

_NAMES = {
    "PREFETCH_LAYERS": "hybrimoe.envs",
    "COST_PRESET": "hybrimoe.envs:DEFAULT_COST_HARDWARE",
    "AUTO_CALIBRATE_ENV": "hybrimoe.envs",
    "CACHE_DIR_ENV": "hybrimoe.envs",
    "AUTO_MARGIN_FRACTION": "hybrimoe.envs",
    "AUTO_MARGIN_MIN_BYTES": "hybrimoe.envs",
    "cache_dir": "hybrimoe.envs",
    "PROGRESS_ENV": "hybrimoe.envs",
    "progress_on": "hybrimoe.envs",
}
__getattr__ = moved(__name__, _NAMES)
__dir__ = names_of(__name__, _NAMES)
