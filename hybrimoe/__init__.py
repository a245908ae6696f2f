"""hybrimoe: HybriMoE (Zhong et al., arXiv:2504.05897) hybrid CPU-GPU MoE inference on a patched llama.cpp.

``from hybrimoe import Llama`` gives llama-cpp-python's ``Llama`` running on hybrimoe's patched libllama.
Import hybrimoe before ``llama_cpp``: a process can load only one libllama.

The package is layered (each layer imports only the ones above it in this list; a test checks it):

==============  ====================================================================================================
``model``       the GGUF reader and validator, model facts, upstream's per-architecture tables
``policy``      policy base classes, cost-model files, hardware files, policy presets, budgets, profiles
``traces``      routing traces: the file format, statistics, synthetic traces, routing replay tables
``sim``         the trace-driven simulator (one GPU or several, concurrent decode streams) and the exact bound
                (never imports the runtime)
``runtime``     :class:`Llama`, llama.cpp parameters, the engine's set-up (over every device of a layer split),
                calibration, the token loop, the RPC stand-in
``server``      ``hybrimoe serve``'s app (llama-cpp-python's server)
``commands``    one module per ``hybrimoe`` subcommand (nothing imports them)
``testing``     yardsticks for tests and scripts (the upstream comparison, pytest fixtures, simulator tables)
``tiny``        tiny synthetic GGUF models
==============  ====================================================================================================

``envs`` holds every ``HYBRIMOE_*`` environment variable and default. This module re-exports the public API lazily
(nothing is loaded before it is used: the simulator needs neither llama.cpp nor the engine) and is the only module
that points down into every layer.
"""
from __future__ import annotations

import importlib
import os
import sys

from hybrimoe._lib import LIB_DIR, HybrimoeImportError, preload_ggml
from hybrimoe._version import __version__

# Point llama-cpp-python at our libllama now, so that a later plain `import llama_cpp` gets it too, and load ggml
# with hybrimoe's ggml-cpu (hybrimoe._lib.preload_ggml) before any module asks for it by soname.
if "llama_cpp" not in sys.modules and (LIB_DIR / "libllama.so").exists():
    os.environ["LLAMA_CPP_LIB_PATH"] = str(LIB_DIR)
    try:
        preload_ggml()
    except (HybrimoeImportError, OSError):
        pass  # reported when the Llama API is used (hybrimoe._lib.llama_cpp_module)

__all__ = ["Llama", "HybrimoeImportError", "make_tiny_model", "CachePolicy", "SchedulePolicy", "PrefetchPolicy",
           "__version__"]

#: the public names and where they live
_PUBLIC = {"Llama": "hybrimoe.runtime.llama", "CachePolicy": "hybrimoe.policy", "SchedulePolicy": "hybrimoe.policy",
           "PrefetchPolicy": "hybrimoe.policy", "make_tiny_model": "hybrimoe.tiny"}
#: submodules reachable as attributes after a plain ``import hybrimoe`` (documented names work as written)
_SUBMODULES = ("commands", "envs", "model", "policy", "runtime", "server", "sim", "testing", "tiny", "traces",
               "outputs", "_core", "_engine", "_ggml", "_lib", "_lazy", "_version")


def __getattr__(name: str):
    # load llama_cpp (and our libllama) only when the Llama API is used: the simulator needs neither
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    if name == "_engine":  # links our libllama: llama_cpp must be loaded on it first
        return importlib.import_module("hybrimoe.runtime.engine_facts").engine_module()
    if name in _SUBMODULES:
        try:
            return importlib.import_module(f"hybrimoe.{name}")
        except ModuleNotFoundError as e:
            if name != "_core" or e.name != "hybrimoe._core":
                raise
            # a source checkout on sys.path (python -m pytest, or python run inside it) hides the installed package
            raise ModuleNotFoundError(
                f"No module named 'hybrimoe._core': the compiled part of hybrimoe is not in {__path__[0]}. Python "
                "imported hybrimoe from a source checkout, which shadows the installed package when Python runs from "
                "it (python -m pytest puts the working directory first on sys.path): run pytest, or work from "
                "another directory; or install it (pip install .)", name=e.name) from None
    raise AttributeError(f"module 'hybrimoe' has no attribute {name!r}")
