"""``hybrimoe calibrate``: measure the engine's cost model (HybriMoE §IV.B) for one model on this machine's devices.

What is measured (all through the engine itself, on the model's own quant types and the devices it will use):

- CPU experts: the model runs with ``moe_cache=0`` (every routed expert on ggml's CPU kernels) for ubatches of
  several sizes; per MoE layer and run the engine reports the time from its plan to its wait op, the distinct
  experts computed and the routed (token, expert) pairs. A least-squares fit of
  ``time = cpu_startup_s + cpu_a_s * experts + cpu_b_s * pairs`` (relative error: decode and prefill alike)
  gives the CPU part. The engine's CPU share computes only the CPU experts' pairs, so this is the cost of the
  pairs the scheduler leaves to the CPU.
- GPU experts (with an accelerator): the same with every expert resident on the GPU (``gpu-on-demand`` policy, a
  cache that holds all experts, warmed up first): ``time = act_a_s + gpu_a_s * experts + gpu_b_s * pairs``.
- Host-to-device copies: ``hybrimoe._engine.measure_h2d_s`` times copies of a small and of an expert-sized block
  (pinned host memory when the device offers it): bandwidth and latency from the two; and
  ``hybrimoe._engine.measure_copy_overlap`` whether the device computes while it copies (``copy_overlap``), and
  ``hybrimoe._engine.measure_cpu_copy_overlap`` whether the CPU computes at full speed while copies are in flight
  (``cpu_copy_overlap``: the copies the engine queues for a layer run before and beside its CPU share).
- Non-expert work per MoE layer: (the run's compute time - the MoE layers' engine time) / layers, fitted against
  the tokens: ``layer_a_s + layer_b_s * tokens`` (dense layers get the same figures; an approximation).

The result is a cost-model JSON (schema ``hybrimoe.cost_model/3``, with ``sources``) stored under
``~/.cache/hybrimoe/calibration/`` (``$HYBRIMOE_CACHE_DIR``), keyed by the model file and the device; the engine
then uses it when ``moe_cost_model`` is not given. When none is stored, the engine's first use of that model on
that device runs a short calibration itself (:func:`on_first_use`; ``HYBRIMOE_AUTO_CALIBRATE=0`` turns this off).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from . import _core
from . import policy as pol


def _cache_dir() -> Path:
    base = os.environ.get("HYBRIMOE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hybrimoe")
    return Path(base) / "calibration"


def model_key(model_path) -> str:
    """Identifies a model file: name, size and a hash of its first MiB (its header and first tensors)."""
    p = Path(model_path)
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(1 << 20))
    return f"{p.stem}-{p.stat().st_size}-{h.hexdigest()[:12]}"


def calibration_path(model_path, device: str) -> Path:
    """Where the calibration of ``model_path`` on ``device`` (a ggml device description or endpoint, or "cpu") is
    stored."""
    dev = re.sub(r"[^A-Za-z0-9._-]+", "_", device or "cpu")
    return _cache_dir() / f"{model_key(model_path)}--{dev}.json"


def stored(model_path, device: str) -> Optional[Path]:
    """The stored calibration for this model and device, or None."""
    p = calibration_path(model_path, device)
    return p if p.is_file() else None


def _fit(rows: list[tuple[float, ...]], y: list[float], relative: bool = False) -> np.ndarray:
    """Least squares with non-negative coefficients (a coefficient that comes out negative is fixed at 0).
    ``relative``: minimise the relative error (each sample divided by its value), so that a one-token decode layer
    weighs as much as a 512-token prefill layer."""
    X = np.asarray(rows, dtype=np.float64)
    Y = np.asarray(y, dtype=np.float64)
    if relative:
        w = 1.0 / np.maximum(Y, 1e-12)
        X, Y = X * w[:, None], Y * w
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], Y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def _runs(llm, prompt: list[int], sizes: Sequence[int], reps: int, k: int, tick) -> tuple[list, list, list]:
    """Per (MoE layer, run) feature rows (1, experts, pairs), engine seconds, and per eval (tokens, non-expert s)."""
    from ._lib import llama_cpp_module

    lc = llama_cpp_module().llama_cpp
    ctx = llm._ctx.ctx
    eng = llm._moe_engine
    feats, ys, layer_rows = [], [], []
    for T in sizes:
        for r in range(reps + 1):
            llm.reset()
            eng.reset_stats()
            lc.llama_perf_context_reset(ctx)
            llm.eval(prompt[:T])
            lc.llama_synchronize(ctx)
            total = lc.llama_perf_context(ctx).t_p_eval_ms * 1e-3
            tick()
            if r == 0:
                continue  # warm-up (graph allocation, first copies)
            engine_s = 0.0
            n_moe = 0
            for s in eng.layer_stats():
                if s["runs"] == 0:
                    continue
                n_moe += 1
                engine_s += s["layer_s"]
                experts = (s["cpu_experts"] + s["gpu_experts"]) / s["runs"]
                pairs = s["tokens"] * k / s["runs"]
                feats.append((1.0, experts, pairs))
                ys.append(s["layer_s"] / s["runs"])
            if n_moe:
                layer_rows.append((T, max(0.0, total - engine_s) / n_moe))
    return feats, ys, layer_rows


def calibrate(model_path, *, rpc_servers=None, n_gpu_layers: int = 99, threads: Optional[int] = None,
              quick: bool = False, progress: bool = True, desc: str = "calibrating") -> tuple["_core.CostModel", dict, str]:
    """Measures the cost model of ``model_path`` on this machine.

    Returns ``(cost model, sources {field: how it was measured}, device name)``. Without an accelerator (no GPU, no
    ``rpc_servers``) the GPU and copy fields stay at the ``rtx4090-desktop`` preset's values (marked so).

    Raises:
        ValueError: not a MoE model or not loadable; RuntimeError: a measurement failed.
    """
    from tqdm import tqdm

    from . import _ggml
    from .engine import _engine_module, engine_facts, resolve_cost_model
    from .llama import Llama

    facts = engine_facts(model_path)
    k = facts.top_k
    # decode-sized ubatches up to prefill-sized ones: an expert's kernel changes with its row count (ggml-cpu's
    # tiled K-quant path from 8 rows), and prefill ubatches give experts tens of rows
    sizes = [1, 4, 16, 64] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    reps = 1 if quick else 2
    base = dict(n_ctx=max(sizes) + 64, n_batch=max(sizes), n_ubatch=max(sizes), verbose=False,
                rpc_servers=rpc_servers, n_gpu_layers=n_gpu_layers)
    if threads:
        base.update(n_threads=threads, n_threads_batch=threads)
    preset = resolve_cost_model(None, facts)
    cm = _core.CostModel()
    for f in pol.COST_FIELDS:
        setattr(cm, f, getattr(preset, f))
    sources = {f: "rtx4090-desktop preset (not measured)" for f in pol.COST_FIELDS}
    steps = len(sizes) * (reps + 1) * 2 + 2
    bar = tqdm(total=steps, desc=desc, unit="step", file=sys.stderr,
               disable=not progress or (not sys.stderr.isatty() and not os.environ.get("HYBRIMOE_PROGRESS")))
    device_name = "cpu"
    try:
        def measure(fields, note, **kw):
            """Loads the model with the engine options kw, runs the ubatch sizes, fits `fields`."""
            # an explicit cost model: no first-use calibration inside the calibration
            llm = Llama(str(model_path), moe_cost_model=preset, **kw, **base)
            try:
                prompt = llm.tokenize(b"calibration " * (max(sizes) + 8), add_bos=True)[:max(sizes)]
                if kw.get("moe_cache"):
                    llm.eval(prompt)  # bring the experts the prompt uses to the GPU first
                feats, ys, layer_rows = _runs(llm, prompt, sizes, reps, k, lambda: bar.update(1))
            finally:
                llm.close()
            for f, v in zip(fields, _fit(feats, ys, relative=True)):
                setattr(cm, f, float(v))
                sources[f] = f"fit over {len(ys)} (MoE layer, run) samples, ubatches {sizes}, {note}"
            return layer_rows

        layer_rows = measure(("cpu_startup_s", "cpu_a_s", "cpu_b_s"), "moe_cache=0", moe_cache=0)
        la, lb = _fit([(1.0, T) for T, _ in layer_rows], [v for _, v in layer_rows])
        cm.layer_a_s, cm.layer_b_s = float(la), float(lb)
        cm.dense_a_s, cm.dense_b_s = float(la), float(lb)
        for f in ("layer_a_s", "layer_b_s"):
            sources[f] = "(compute time - MoE layers' engine time) / MoE layers, fit against tokens"
        for f in ("dense_a_s", "dense_b_s"):
            sources[f] = "set to the MoE layer's non-expert figures (approximation)"

        # the accelerator: the first RPC server given, else the first GPU
        dev = _ggml.accelerator(_ggml.add_rpc_server(rpc_servers.split(",")[0].strip()) if rpc_servers else [])
        if dev is not None:
            d = next(x for x in _ggml.devices() if x["ptr"] == dev)
            device_name = _ggml.device_label(dev)
            eng = _engine_module()
            big = int(max(sum(b_) for b_ in facts.expert_bytes))
            t_small = eng.measure_h2d_s(dev, 4096, 5)
            t_big = eng.measure_h2d_s(dev, big * 4, 5)
            bar.update(1)
            bw = (big * 4 - 4096) / max(t_big - t_small, 1e-9)
            cm.h2d_bandwidth_Bps = float(bw)
            cm.h2d_latency_s = float(max(0.0, t_small - 4096 / bw))
            sources["h2d_bandwidth_Bps"] = f"timed copies of 4096 and {big * 4} bytes ({device_name})"
            sources["h2d_latency_s"] = sources["h2d_bandwidth_Bps"]
            cm.act_b_s = 2.0 * facts.n_embd * 4 / bw
            sources["act_b_s"] = "hidden state to the GPU and back per token at the measured bandwidth"
            cm.copy_overlap = float(eng.measure_copy_overlap(dev, big, 3 if quick else 5))
            sources["copy_overlap"] = (f"a copy of {big} bytes and a compute of about its length, alone and together "
                                       f"({device_name})")
            n_thr = int(threads or max(1, (os.cpu_count() or 2) // 2))  # llama-cpp-python's default n_threads
            cm.cpu_copy_overlap = float(eng.measure_cpu_copy_overlap(dev, big * 4, 3 if quick else 5, n_thr))
            sources["cpu_copy_overlap"] = (f"copies of {big * 4} bytes queued as the engine queues them and a "
                                           f"memory-bound CPU chain ({n_thr} threads) of about their length, alone "
                                           f"and together ({device_name})")
            free = d["free"]
            n_all = len(facts.moe_layers) * facts.n_expert
            slots = n_all
            if (slots + 1) * facts.slot_bytes > free:
                slots = max(1, int(free // facts.slot_bytes) // 2)
            measure(("act_a_s", "gpu_a_s", "gpu_b_s"), f"every expert on {device_name} ({slots} slots, "
                    "gpu-on-demand)", moe_cache=slots * facts.slot_bytes, moe_policy="gpu-on-demand",
                    moe_prefetch_layers=0)
        bar.update(1)
    finally:
        bar.close()
    cm.validate()
    return cm, sources, device_name


def save(cm: "_core.CostModel", sources: dict, out: Path) -> Path:
    """Writes a calibration atomically (a reader never sees half a file; an existing one is replaced whole)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    pol.save_cost_model(cm, tmp, sources)
    os.replace(tmp, out)
    return out


def auto_enabled() -> bool:
    """First-use calibration is on unless ``HYBRIMOE_AUTO_CALIBRATE=0``."""
    return os.environ.get("HYBRIMOE_AUTO_CALIBRATE", "1").strip().lower() not in ("0", "no", "false", "off")


def on_first_use(model_path, device: str, *, rpc_servers=None, n_gpu_layers: int = 99,
                 threads: Optional[int] = None) -> "Path | _core.CostModel":
    """The engine's first use of ``model_path`` on ``device`` without a stored calibration: runs a short one (the
    ``--quick`` sizes: ubatches of 1, 4, 16 and 64 tokens, one repetition each; a progress bar on a terminal, or with
    ``HYBRIMOE_PROGRESS=1``), stores it where :func:`stored` finds it and returns its path; when the store cannot
    be written it warns and returns the measured cost model itself (used for this run only). ``hybrimoe
    calibrate`` makes a fuller one. Turn it off with ``HYBRIMOE_AUTO_CALIBRATE=0`` (the preset is used then).

    Raises:
        ValueError, RuntimeError, OSError: as :func:`calibrate` (the measurement failed).
    """
    print(f"hybrimoe: no calibration of {Path(model_path).name} on {device}: measuring a short one "
          "(hybrimoe calibrate makes a fuller one; HYBRIMOE_AUTO_CALIBRATE=0 skips this)", file=sys.stderr)
    cm, sources, measured_on = calibrate(model_path, rpc_servers=rpc_servers, n_gpu_layers=n_gpu_layers,
                                         threads=threads, quick=True, desc="hybrimoe: calibrating (first use)")
    for f in sources:
        sources[f] = f"first-use calibration (quick): {sources[f]}"
    out = calibration_path(model_path, measured_on)
    try:
        return save(cm, sources, out)
    except OSError as e:
        import warnings

        warnings.warn(f"cannot store the first-use calibration in {out.parent} ({e}); it is used for this run only",
                      RuntimeWarning, stacklevel=3)
        return cm


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="GGUF model")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT", help="ggml RPC server to calibrate as the GPU")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=99, help="layers on the GPU (default %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    p.add_argument("--quick", action="store_true", help="fewer ubatch sizes and repetitions")
    p.add_argument("-o", "--output", default=None,
                   help="write here instead of the calibration store (~/.cache/hybrimoe/calibration)")


def run(args) -> int:
    try:
        if args.output:
            d = Path(args.output).resolve().parent
            if not d.is_dir() or not os.access(d, os.W_OK):
                raise ValueError(f"cannot write {args.output}: {d} is not a writable directory")
        cm, sources, device = calibrate(args.model, rpc_servers=args.rpc, n_gpu_layers=args.n_gpu_layers,
                                        threads=args.threads, quick=args.quick)
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
