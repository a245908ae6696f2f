"""The trace-driven simulator: policy presets timed on routing traces under a hardware file's truth model
(:mod:`~hybrimoe.sim.simulator`), the exact optimum of small instances that bounds every policy
(:mod:`~hybrimoe.sim.bounds`) and the plots of ``hybrimoe simulate --plot`` (:mod:`~hybrimoe.sim.plots`). It uses
:mod:`hybrimoe.model`, :mod:`hybrimoe.policy` and :mod:`hybrimoe.traces`, and never the runtime (llama.cpp).
"""
from hybrimoe._lazy import lazy_submodules

__getattr__ = lazy_submodules(__name__, ("simulator", "bounds", "plots"))
