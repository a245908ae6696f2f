"""The full calibration of a model file on this machine (what ``hybrimoe calibrate`` runs): load the model once with
the engine's hook and measure (:func:`hybrimoe.runtime.calibration.measure`)."""
from __future__ import annotations

from typing import Optional

from hybrimoe import _core, _ggml
from hybrimoe.policy.hardware import resolve_cost_model
from hybrimoe.runtime.calibration import QUICK_SIZES, SIZES, measure
from hybrimoe.runtime.engine_facts import engine_facts
from hybrimoe.runtime.llama import Llama
from hybrimoe.runtime.setup import auto_slots


def calibrate_model(model_path, *, rpc_servers=None, n_gpu_layers: int = 99, threads: Optional[int] = None,
                    quick: bool = False, progress: bool = True, desc: str = "calibrating",
                    reps: Optional[int] = None, no_repack: bool = False,
                    no_host: bool = False, moe_cpu_fused=False) -> tuple["_core.CostModel", dict, str]:
    """Measures the cost model of ``model_path`` on this machine (``hybrimoe calibrate``): loads it once with the
    engine's hook (``moe_cache=0``, the user's devices) and runs :func:`hybrimoe.runtime.calibration.measure` with GPU
    slots for every expert when they fit the device's free memory, else as many as ``moe_cache="auto"`` would take.
    ``no_repack``, ``no_host``, ``moe_cpu_fused``: the options of the runs it is for (the CPU share's kernels depend
    on them; ``sources["cpu_weights"]`` says which ran).

    Returns ``(cost model, sources {field: how it was measured}, device name)``. Without an accelerator (no GPU, no
    ``rpc_servers``) the GPU and copy fields stay at the default hardware's values (marked so).

    Raises:
        ValueError: not a MoE model or not loadable; RuntimeError: a measurement failed.
    """
    facts = engine_facts(model_path)
    top = max(QUICK_SIZES if quick else SIZES)
    kw = dict(n_ctx=top + 64, n_batch=top, n_ubatch=top, verbose=False, rpc_servers=rpc_servers,
              n_gpu_layers=n_gpu_layers, no_repack=no_repack, no_host=no_host)
    if threads:
        kw.update(n_threads=threads, n_threads_batch=threads)
    # an explicit cost model: no first-use calibration inside the calibration
    llm = Llama(str(model_path), moe_cache=0, moe_cost_model=resolve_cost_model(None, facts.model),
                moe_cpu_fused=moe_cpu_fused, **kw)
    try:
        dev = llm.moe_setup.device
        n_slots = 0
        if dev:
            # every expert if it fits beside the GPU share's work buffers, else what "auto" would take
            free, _ = _ggml.device_memory(dev)
            n_slots = auto_slots(facts, free, top)[0]
        return measure(llm, device=dev, n_slots=n_slots, quick=quick, threads=threads, progress=progress, reps=reps,
                       desc=desc)
    finally:
        llm.close()
