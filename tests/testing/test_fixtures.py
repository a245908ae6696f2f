"""The suite's shared fixtures (hybrimoe.testing.fixtures) as a pytest session of their own sees them: paths the user
means relative to where pytest started stay so after the fixtures move the working directory."""
from __future__ import annotations

import os
import subprocess
import sys


def test_the_trace_skip_names_the_folder_beside_the_checkout(tmp_path):
    """Without the development trace, the skip reason names ``../shared/traces/`` beside the folder pytest started in,
    not a path under pytest's temporary folder (the working directory the fixtures move to)."""
    checkout = tmp_path / "work" / "checkout"
    (checkout / "tests").mkdir(parents=True)
    (checkout / "tests" / "conftest.py").write_text('pytest_plugins = ("hybrimoe.testing.fixtures",)\n')
    (checkout / "tests" / "test_uses_the_trace.py").write_text(
        "def test_needs_the_trace(dev_trace):\n    raise AssertionError('the trace is not there: no run')\n")
    env = {k: v for k, v in os.environ.items() if k != "HYBRIMOE_TRACE"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-q",
                        f"--basetemp={tmp_path / 'inner-tmp'}", "tests"], cwd=checkout, env=env,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "1 skipped" in out, out
    want = tmp_path / "work" / "shared" / "traces" / "dsv2lite_dev.npz"
    assert f"routing trace not present at {want} (set HYBRIMOE_TRACE)" in out, out
    assert "inner-tmp" not in out, out
