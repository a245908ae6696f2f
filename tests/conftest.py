"""The suite's shared fixtures come from hybrimoe.testing.fixtures (tiny models written once per session, RPC servers
as the accelerator stand-in, the split cost model); its yardsticks from hybrimoe.testing.upstream."""
from __future__ import annotations

import os

# The engine calibrates its cost model on first use of a model on a device (hybrimoe.runtime.calibration.on_first_use).
# Tests give their cost model or get the default hardware's, so that their splits do not depend on timings of the
# shared CPU; the first-use calibration is tested on its own (tests/runtime/test_calibrate.py).
os.environ.setdefault("HYBRIMOE_AUTO_CALIBRATE", "0")

pytest_plugins = ("hybrimoe.testing.fixtures",)


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    # CI runs the property tests with a fixed seed: a red CI run must be reproducible, not a draw
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")
