"""The policy core is one shared library, hybrimoe/lib/libhybrimoe_policy.so, linked by both extension modules:
hybrimoe._core binds its classes once and hybrimoe._engine takes those objects as they are (no second copy of the
code, no conversion between the modules). Also the assumptions _core exposes by name."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hybrimoe
from hybrimoe import _core

PKG = Path(hybrimoe.__file__).resolve().parent
LIB = PKG / "lib" / "libhybrimoe_policy.so"
needs_binutils = pytest.mark.skipif(not (shutil.which("readelf") and shutil.which("nm")), reason="needs binutils")


def _module_path(name: str) -> Path:
    import importlib

    return Path(importlib.import_module(f"hybrimoe.{name}").__file__)


def _run(*cmd) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


@needs_binutils
def test_both_modules_load_the_one_policy_library():
    assert LIB.is_file()
    lib = _run("readelf", "-d", str(LIB))
    assert "Library soname: [libhybrimoe_policy.so]" in lib and "[$ORIGIN]" in lib
    for name in ("_core", "_engine"):
        dyn = _run("readelf", "-d", str(_module_path(name)))
        assert "Shared library: [libhybrimoe_policy.so]" in dyn, name
        runpath = [line for line in dyn.splitlines() if "RUNPATH" in line or "RPATH" in line]
        assert runpath and "$ORIGIN/lib" in runpath[0], (name, runpath)


@needs_binutils
def test_policy_code_is_defined_only_in_the_library():
    """Out-of-line policy functions (one from each of the core's sources) are exported by the library; neither
    module defines them, and both refer to the library's (a static copy of the core would resolve them inside the
    module: no undefined hybrimoe:: symbol at all)."""
    probes = ("hybrimoe::CostModel::validate() const", "hybrimoe::ExpertCache::admit(", "hybrimoe::MRSPolicy::observe(",
              "hybrimoe::HybriMoEScheduler::greedy_split(", "hybrimoe::ImpactPrefetcher::plan(",
              "hybrimoe::RouterPredictor::predict(", "hybrimoe::LayerDecider::split(", "hybrimoe::simulate(")
    exported = _run("nm", "-DC", "--defined-only", str(LIB))
    for p in probes:
        assert p in exported, p
    for name in ("_core", "_engine"):
        path = str(_module_path(name))
        # the dynamic symbols and, when the module is not stripped, all of them
        defined = _run("nm", "-DC", "--defined-only", path)
        defined += subprocess.run(["nm", "-C", "--defined-only", path], capture_output=True, text=True).stdout
        for p in probes:
            assert p not in defined, (name, p)
        assert "hybrimoe::CostModel::validate() const" in _run("nm", "-DC", "--undefined-only", path), name


def test_the_engine_module_imports_core_first(tmp_path):
    code = ("import sys, hybrimoe; assert 'hybrimoe._core' not in sys.modules; import hybrimoe._engine; "
            "assert 'hybrimoe._core' in sys.modules")
    # run outside the checkout: `python -c` puts the working directory first on sys.path, and the source tree's
    # hybrimoe has no built modules
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def _engine_args(**changes):
    """Arguments of a CPU-only Engine (no slots, no device) of one MoE layer with 4 F32 experts."""
    args = dict(n_layer=1, n_expert=4, top_k=2, n_embd=8, moe_layers=[0], expert_bytes=[(256, 256, 256)],
                expert_types=[(0, 0, 0)], n_slots=0, device=0, cost_model=_core.CostModel(), prefetch_layers=0,
                fill_on_miss=False, routers=[], router_bias=[], sigmoid_gating=False,
                cache=_core.ExpertCache([768.0], 4, 0.0, _core.LRUPolicy()), scheduler=_core.HybriMoEScheduler(),
                prefetcher=_core.NoPrefetcher())
    args.update(changes)
    return args


def test_the_engine_takes_core_objects_as_they_are():
    """A CostModel object (not JSON), _core's cache and a Python subclass of _core's SchedulePolicy go straight in;
    the engine validates the cost model; anything else is a TypeError from the argument conversion."""
    from hybrimoe import _engine

    class AllOnCpu(_core.SchedulePolicy):
        def name(self):
            return "all-on-cpu"

        def split(self, layer_input, cost):
            return [0] * len(layer_input)

    eng = _engine.Engine(**_engine_args(scheduler=AllOnCpu()))
    assert eng.n_slots == 0
    bad = _core.CostModel()
    bad.h2d_bandwidth_Bps = 0.0
    with pytest.raises(ValueError, match="h2d_bandwidth_Bps must be > 0"):
        _engine.Engine(**_engine_args(cost_model=bad))
    with pytest.raises(TypeError):
        _engine.Engine(**_engine_args(cost_model='{"schema": "hybrimoe.cost_model/2"}'))
    with pytest.raises(TypeError):
        _engine.Engine(**_engine_args(cache=_core.LRUPolicy()))


def test_prediction_assumptions_are_named_constants():
    """The engine's assumed prediction confidence and the simulator's assumed predictor recall are two constants,
    read-only tuples in _core; the simulator's defaults (C++ SimConfig, the CLI) are the recall one."""
    from hybrimoe.commands import simulate

    conf, recall = _core.DEFAULT_PREDICTION_CONFIDENCE, _core.DEFAULT_PREDICTOR_RECALL
    assert isinstance(conf, tuple) and isinstance(recall, tuple)
    assert conf == (0.8, 0.65, 0.5) and recall == (0.8, 0.65, 0.5)
    assert _core.SimConfig().recall == list(recall)
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    assert [float(v) for v in parser.parse_args([]).recall.split(",")] == list(recall)
