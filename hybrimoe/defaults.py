"""Names and defaults shared by the engine, the simulator, the command line and the docstrings: defined here once.

The preset names live with the presets (:data:`hybrimoe.policy.SYSTEM_PRESETS`, :data:`hybrimoe.policy.ENGINE_PRESETS`);
the engine's prediction confidences and the simulator's predictor recall live in the policy core, where they are
used (read here from ``hybrimoe._core``).
"""
from __future__ import annotations

import os
from pathlib import Path

#: MoE layers whose experts are predicted and prefetched ahead (HybriMoE §IV.C looks ahead over the next layers;
#: ``moe_prefetch_layers``, ``--moe-prefetch-layers``, ``hybrimoe simulate --prefetch-depth``)
PREFETCH_LAYERS = 3
#: the planner's cost model when no calibration is stored and none is measured (``hybrimoe/presets``)
COST_PRESET = "rtx4090-desktop"
#: environment variable that turns the first-use calibration off ("0")
AUTO_CALIBRATE_ENV = "HYBRIMOE_AUTO_CALIBRATE"
#: environment variable that moves hybrimoe's cache directory
CACHE_DIR_ENV = "HYBRIMOE_CACHE_DIR"
#: ``moe_cache="auto"``: bytes of device memory left free besides the engine's own estimate (1/32 of what is free,
#: at least 256 MiB): allocations the estimate misses (the backend's scratch, other processes) must still fit
AUTO_MARGIN_FRACTION = 1.0 / 32.0
AUTO_MARGIN_MIN_BYTES = 256 * 1024 * 1024


def cache_dir() -> Path:
    """hybrimoe's cache directory: ``$HYBRIMOE_CACHE_DIR``, else ``$XDG_CACHE_HOME/hybrimoe``, else
    ``~/.cache/hybrimoe`` (the XDG base directory rule). Holds the default tiny model (``models/``) and the stored
    calibrations (``calibration/``)."""
    root = os.environ.get(CACHE_DIR_ENV)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybrimoe"


def prediction_confidence() -> tuple:
    """The engine's assumed confidence of its router look-ahead per distance 1, 2, ... (policy core)."""
    from . import _core

    return tuple(_core.DEFAULT_PREDICTION_CONFIDENCE)


def predictor_recall() -> tuple:
    """The simulator's assumed recall of a trace predictor per distance 1, 2, ... (policy core)."""
    from . import _core

    return tuple(_core.DEFAULT_PREDICTOR_RECALL)


#: set to show progress bars when stderr is not a terminal
PROGRESS_ENV = "HYBRIMOE_PROGRESS"


def progress_on() -> bool:
    """Whether commands draw tqdm progress bars: on a terminal (stderr), or anywhere with ``HYBRIMOE_PROGRESS`` set;
    never into a redirected file or pipe otherwise."""
    import sys

    return sys.stderr.isatty() or bool(os.environ.get(PROGRESS_ENV))
