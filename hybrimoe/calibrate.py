"""Moved in 0.2: the calibration of a model file is :func:`hybrimoe.runtime.calibrate_model.calibrate_model`. This alias
module goes in 0.3 (CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of

_NAMES = {
    "calibrate": "hybrimoe.runtime.calibrate_model:calibrate_model",
    "measure": "hybrimoe.runtime.calibration",
    "save": "hybrimoe.runtime.calibration",
    "stored": "hybrimoe.runtime.calibration",
    "calibration_path": "hybrimoe.runtime.calibration",
    "SIZES": "hybrimoe.runtime.calibration",
    "QUICK_SIZES": "hybrimoe.runtime.calibration",
}
__getattr__ = moved(__name__, _NAMES)
__dir__ = names_of(__name__, _NAMES)
