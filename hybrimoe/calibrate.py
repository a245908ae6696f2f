"""``hybrimoe calibrate``: measures the engine's cost model for one model on this machine's devices and stores it
where the engine finds it (:mod:`hybrimoe.calibration` says what is measured and how)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from . import policy as pol
from .calibration import QUICK_SIZES, SIZES, calibration_path, measure, save, stored  # noqa: F401 (stored: API)


def calibrate(model_path, *, rpc_servers=None, n_gpu_layers: int = 99, threads: Optional[int] = None,
              quick: bool = False, progress: bool = True, desc: str = "calibrating",
              reps: Optional[int] = None) -> tuple["_core.CostModel", dict, str]:
    """Measures the cost model of ``model_path`` on this machine (``hybrimoe calibrate``): loads it once with the
    engine's hook (``moe_cache=0``, the user's devices) and runs :func:`measure` with GPU slots for every expert
    when they fit the device's free memory, else as many as ``moe_cache="auto"`` would take.

    Returns ``(cost model, sources {field: how it was measured}, device name)``. Without an accelerator (no GPU, no
    ``rpc_servers``) the GPU and copy fields stay at the default preset's values (marked so).

    Raises:
        ValueError: not a MoE model or not loadable; RuntimeError: a measurement failed.
    """
    from .engine import auto_slots, device_memory, engine_facts, resolve_cost_model
    from .llama import Llama

    facts = engine_facts(model_path)
    top = max(QUICK_SIZES if quick else SIZES)
    kw = dict(n_ctx=top + 64, n_batch=top, n_ubatch=top, verbose=False, rpc_servers=rpc_servers,
              n_gpu_layers=n_gpu_layers)
    if threads:
        kw.update(n_threads=threads, n_threads_batch=threads)
    # an explicit cost model: no first-use calibration inside the calibration
    llm = Llama(str(model_path), moe_cache=0, moe_cost_model=resolve_cost_model(None, facts), **kw)
    try:
        dev = llm.moe_setup.device
        n_slots = 0
        if dev:
            # every expert if it fits beside the GPU share's work buffers, else what "auto" would take
            free, _ = device_memory(dev)
            n_slots = auto_slots(facts, free, top)[0]
        return measure(llm, device=dev, n_slots=n_slots, quick=quick, threads=threads, progress=progress, reps=reps,
                       desc=desc)
    finally:
        llm.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="GGUF model")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT", help="ggml RPC server to calibrate as the GPU")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=99, help="layers on the GPU (default %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    p.add_argument("--quick", action="store_true", help="fewer ubatch sizes and repetitions")
    p.add_argument("-r", "--reps", type=int, default=None,
                   help="measured runs per ubatch size (default 2, 1 with --quick); more: steadier figures")
    p.add_argument("-o", "--output", default=None,
                   help="write here instead of the calibration store (calibration/ in hybrimoe's cache directory: "
                        "$HYBRIMOE_CACHE_DIR, else $XDG_CACHE_HOME/hybrimoe, else ~/.cache/hybrimoe)")
    p.add_argument("--force", action="store_true", help="replace an existing -o file")


def run(args) -> int:
    try:
        if args.output:
            from .outputs import check_output

            check_output(args.output, "-o", force=getattr(args, "force", False), inputs=[("-m", args.model)])
        cm, sources, device = calibrate(args.model, rpc_servers=args.rpc, n_gpu_layers=args.n_gpu_layers,
                                        threads=args.threads, quick=args.quick, reps=args.reps)
        out = save(cm, sources, Path(args.output) if args.output else calibration_path(args.model, device))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"hybrimoe calibrate: error: {e}", file=sys.stderr)
        return 1
    doc = json.loads(out.read_text())
    for f in pol.COST_FIELDS:
        print(f"{f:18s} {doc[f]:.6g}   ({sources.get(f, '')})")
    print(f"hybrimoe calibrate: wrote {out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="hybrimoe calibrate", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))
