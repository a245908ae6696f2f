"""Moved in 0.2: calibration is :mod:`hybrimoe.runtime.calibration`. This alias module goes in 0.3 (CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of

_NAMES = {
    "measure": "hybrimoe.runtime.calibration",
    "save": "hybrimoe.runtime.calibration",
    "stored": "hybrimoe.runtime.calibration",
    "calibration_path": "hybrimoe.runtime.calibration",
    "model_key": "hybrimoe.runtime.calibration",
    "on_first_use": "hybrimoe.runtime.calibration",
    "with_stored_cost": "hybrimoe.runtime.calibration",
    "with_first_use_cost": "hybrimoe.runtime.calibration",
    "SIZES": "hybrimoe.runtime.calibration",
    "QUICK_SIZES": "hybrimoe.runtime.calibration",
    "NothingMeasured": "hybrimoe.runtime.calibration",
    "NOTHING_MEASURED": "hybrimoe.runtime.calibration",
    "auto_enabled": "hybrimoe.envs:auto_calibrate",
}
__getattr__ = moved(__name__, _NAMES)
__dir__ = names_of(__name__, _NAMES)
