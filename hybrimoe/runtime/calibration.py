"""Calibration of the engine's cost model (HybriMoE §IV.B) for one model on this machine's devices: the measurement
(:func:`measure`, on a loaded model), the first-use calibration (:func:`on_first_use`) and the store.
``hybrimoe calibrate`` (:mod:`hybrimoe.commands.calibrate`) is its command; :func:`calibrate` is what it runs.

What is measured (all through the engine itself, on one loaded model with the engine's hook: its own quant types,
context and devices; :func:`measure` swaps measuring engines onto the hook):

- CPU experts: every routed expert on ggml's CPU kernels (an engine without GPU slots) for ubatches of several
  sizes, each repetition on other tokens (shuffled English words: varied routing, as in decoding); per MoE layer
  and run the engine reports the time from its plan to its wait op, the distinct experts computed, the routed
  (token, expert) pairs and, from its decision records, the small rows (per expert min(rows, 8)). A least-squares
  fit of ``time = cpu_startup_s + cpu_a_s * experts + cpu_b_s * pairs + cpu_c_s * small rows`` (relative error:
  decode and prefill alike; ``cpu_c_s``: ggml-cpu's row-by-row kernels for experts with few rows cost more per row
  than its tiled ones) gives the CPU part. The engine's CPU share computes only the CPU experts' pairs, so this is
  the cost of the pairs the scheduler leaves to the CPU.
- GPU experts (with an accelerator): the same with every expert resident on the GPU (``gpu-on-demand`` policy,
  warmed up first, on the ubatch sizes whose experts fit the slots): ``time = act_a_s + gpu_a_s * experts +
  gpu_b_s * pairs``. ``hybrimoe calibrate`` gives it slots for every expert; the first-use calibration the user's.
- Host-to-device copies: ``hybrimoe._engine.measure_h2d_s`` times copies of a small and of an expert-sized block
  (pinned host memory when the device offers it): bandwidth and latency from the two;
  ``hybrimoe._engine.measure_copy_overlap`` whether the device computes while it copies (``copy_overlap``), and
  ``hybrimoe._engine.measure_cpu_copy_overlap`` whether the CPU computes at full speed while copies are in flight
  (``cpu_copy_overlap``: the copies the engine queues for a layer run before and beside its CPU share).
- Non-expert work per MoE layer: (the run's compute time - the MoE layers' engine time) / layers, fitted against
  the tokens: ``layer_a_s + layer_b_s * tokens`` (dense layers get the same figures; an approximation).

The result is a cost-model JSON (schema ``hybrimoe.cost_model/4``, with ``sources``) stored under ``calibration/``
in hybrimoe's cache directory (:func:`hybrimoe.envs.cache_dir`), keyed by the model file and the device; the
engine then uses it when ``moe_cost_model`` is not given. When none is stored, the engine's first use of that model
on that device runs a short calibration on the model it just loaded (:func:`on_first_use`;
``HYBRIMOE_AUTO_CALIBRATE=0`` turns this off).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import re
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from tqdm import tqdm

from hybrimoe import _core, _ggml
from hybrimoe._lib import llama_cpp_module
from hybrimoe.envs import AUTO_CALIBRATE_ENV, DEFAULT_COST_HARDWARE, auto_calibrate, cache_dir, progress_on
from hybrimoe.outputs import atomic_path
from hybrimoe.policy.cost_model import COST_FIELDS, DISK_FIELDS, CostModelError, save_cost_model
from hybrimoe.policy.hardware import resolve_cost_model
from hybrimoe.runtime.engine_facts import engine_module
from hybrimoe.runtime.generate import FIXED_TEXT
from hybrimoe.runtime.setup import build_policies, make_engine


def _store_dir() -> Path:
    return cache_dir() / "calibration"


def model_key(model_path) -> str:
    """Identifies a model file: name, size and a hash of its first MiB (its header and first tensors)."""
    p = Path(model_path)
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(1 << 20))
    return f"{p.stem}-{p.stat().st_size}-{h.hexdigest()[:12]}"


def calibration_path(model_path, device: str, cpu_path: str = "repack") -> Path:
    """Where the calibration of ``model_path`` on ``device`` (a ggml device description or endpoint, or "cpu") with
    the CPU share's path ``cpu_path`` (:attr:`hybrimoe.runtime.setup.EngineSetup.cpu_path`: the CPU weights'
    layout option and whether the share runs fused; its kernels and so its cost depend on them) is stored."""
    dev = re.sub(r"[^A-Za-z0-9._-]+", "_", device or "cpu")
    return _store_dir() / f"{model_key(model_path)}--{dev}--cpu-{cpu_path}.json"


def stored(model_path, device: str, cpu_path: str = "repack") -> Optional[Path]:
    """The stored calibration for this model, device and CPU path, or None."""
    p = calibration_path(model_path, device, cpu_path)
    return p if p.is_file() else None


NOTHING_MEASURED = ("no MoE layer of this model went through hybrimoe's engine (its expert variant runs on upstream's "
                    "path, e.g. gpt-oss's), so there is nothing to calibrate")


class NothingMeasured(ValueError):
    """No MoE layer of the model went through the engine (every one runs on upstream's path, e.g. gpt-oss's
    experts), so a calibration has no sample to fit."""


def _fit(rows: list[tuple[float, ...]], y: list[float], relative: bool = False) -> np.ndarray:
    """Least squares with non-negative coefficients (a coefficient that comes out negative is fixed at 0).
    ``relative``: minimise the relative error (each sample divided by its value), so that a one-token decode layer
    weighs as much as a 512-token prefill layer.

    Raises:
        NothingMeasured: no samples (no MoE layer went through the engine).
    """
    if len(rows) == 0 or len(y) == 0:
        raise NothingMeasured(NOTHING_MEASURED)
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


#: ubatch sizes of a calibration: decode-sized up to prefill-sized (an expert's kernel changes with its row count:
#: ggml-cpu's tiled K-quant path from 8 rows; prefill ubatches give experts tens of rows)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
QUICK_SIZES = (1, 4, 16, 64)


def _varied_prompt(llm, n: int, seed: int = 0) -> list[int]:
    """``n`` tokens of English words in a seeded random order (BOS first): varied routing, as real decoding has
    (one token repeated would route to the same few experts every time, whose weights and page tables stay warm
    and cost the CPU less than a varied decode's)."""
    words = FIXED_TEXT.split()
    rng = random.Random(seed)
    toks = llm.tokenize(b"", add_bos=True)
    while len(toks) < n:
        rng.shuffle(words)
        toks += llm.tokenize(" ".join(words).encode(), add_bos=False)
    return toks[:n]


def _runs(llm, engine, prompt: list[int], sizes: Sequence[int], reps: int, k: int, tick,
          vary: bool = False) -> tuple[list, list, list, dict]:
    """Per (MoE layer, run) feature rows (1, experts, pairs, small rows: the sum over the layer's experts of
    min(rows, CPU_SMALL_ROWS), from the engine's decision records), engine seconds, per eval (tokens, non-expert s),
    and per size the distinct experts the MoE layers used (summed over the layers). ``vary``: repetition r
    evaluates tokens [r*T, (r+1)*T) of ``prompt`` (varied routing), else its first T tokens every time."""
    lc = llama_cpp_module().llama_cpp
    knee = int(_core.CPU_SMALL_ROWS)
    engine.set_logging(True)
    feats, ys, layer_rows, used = [], [], [], {}
    for T in sizes:
        for r in range(reps + 1):
            llm.reset()
            engine.reset_stats()
            engine.clear_failure()
            lc.llama_perf_context_reset(llm.ctx)
            start = r * T if vary else 0
            llm.eval(prompt[start:start + T])
            lc.llama_synchronize(llm.ctx)
            err = engine.take_error()
            if err:  # its layers ran on the CPU: timings of the wrong thing
                raise RuntimeError(f"the measuring engine failed: {err}")
            pd = lc.llama_perf_context(llm.ctx)
            total = (pd.t_p_eval_ms + pd.t_eval_ms) * 1e-3  # llama.cpp counts a 1-token ubatch as t_eval
            tick()
            small = {}  # MoE layer -> sum over its experts of min(rows, knee)
            for rec in engine.take_log():
                counts = np.bincount(np.asarray(rec["ids"], dtype=np.int64).ravel())
                small[rec["layer"]] = small.get(rec["layer"], 0.0) + float(np.minimum(counts, knee).sum())
            if r == 0:
                continue  # warm-up (graph allocation, first copies)
            engine_s = 0.0
            n_moe, n_used = 0, 0.0
            for ml, st in enumerate(engine.layer_stats()):
                if st["runs"] == 0:
                    continue
                n_moe += 1
                engine_s += st["layer_s"]
                experts = (st["cpu_experts"] + st["gpu_experts"]) / st["runs"]
                n_used += experts
                feats.append((1.0, experts, st["tokens"] * k / st["runs"], small.get(ml, 0.0) / st["runs"]))
                ys.append(st["layer_s"] / st["runs"])
            used[T] = n_used
            if n_moe:
                layer_rows.append((T, max(0.0, total - engine_s) / n_moe))
    engine.set_logging(False)
    return feats, ys, layer_rows, used


def cpu_weights_note(repacked: Sequence, facts, fused: Sequence = ()) -> str:
    """How the CPU share read the routed experts in a measurement, for a cost model's ``sources["cpu_weights"]``:
    which matrices (by quant type) were repacked (upstream's CPU_REPACK layout and kernels) and which kept the
    file's layout, and how many MoE layers ran fused. ``repacked``: per MoE layer, (gate or gate_up, up, down) flags
    (``Engine.repacked()``); ``fused``: per MoE layer, the largest ubatch run fused, -1 none
    (``Engine.fused_max_tokens()``)."""
    import gguf

    names = ("gate", "up", "down")
    kinds: dict[bool, set] = {True: set(), False: set()}
    for flags, types, sizes in zip(repacked, facts.expert_types, facts.expert_bytes):
        for r in range(3):
            if sizes[r]:
                kinds[bool(flags[r])].add(f"{names[r]} {gguf.GGMLQuantizationType(int(types[r])).name}")
    parts = []
    if kinds[True]:
        parts.append("repacked (upstream's CPU_REPACK kernels): " + ", ".join(sorted(kinds[True])))
    if kinds[False]:
        parts.append("file layout (plain kernels): " + ", ".join(sorted(kinds[False])))
    n_fused = sum(1 for f in fused if f >= 0)
    if n_fused:
        parts.append(f"fused (one op per layer) in {n_fused} of {len(fused)} MoE layers")
    return "CPU share on " + "; ".join(parts) if parts else "no MoE layer measured"


class _Measurement:
    """One calibration of :func:`measure` on a loaded Llama: the cost model being filled in, where each field came
    from, and the progress bar."""

    def __init__(self, llm, device: Optional[int], sizes: list, reps: int, threads: Optional[int], bar):
        self.llm, self.device, self.sizes, self.reps, self.threads, self.bar = llm, device, sizes, reps, threads, bar
        self.facts = llm.moe_setup.facts
        self.preset = resolve_cost_model(None, self.facts.model)
        self.cm = _core.CostModel()
        for f in COST_FIELDS:
            setattr(self.cm, f, getattr(self.preset, f))
        self.sources = {f: f"{DEFAULT_COST_HARDWARE} preset (not measured)" for f in COST_FIELDS}
        self.sources.update({f: "no disk figures (the disk is not measured)" for f in DISK_FIELDS})
        self.hook = llm.moe_hook
        self.before = llm.moe_engine  # the Llama's own engine (None during its first-use calibration)
        self.prompt = _varied_prompt(llm, max(sizes) * (reps + 1))
        self.device_name = _ggml.device_label(device) if device else "cpu"

    def share(self, n: int, run_sizes: list, policy: str, note: str, fields: tuple) -> tuple:
        """A measuring engine with ``n`` slots and ``policy`` on the hook for ``run_sizes``; fits ``fields`` (the
        CPU's or the GPU's share). Returns the runs' (tokens, non-expert s) rows and the experts used per size."""
        facts, llm = self.facts, self.llm
        eng = make_engine(facts, n, self.device if n > 0 else None, build_policies(policy, facts, n, 0), self.preset,
                          0, fused_cpu=llm.moe_setup.cpu_fused)
        self.hook.set_engine(eng)
        try:
            if n > 0:
                llm.reset()
                llm.eval(self.prompt[:max(run_sizes)])  # bring the experts the prompt uses to the GPU first
            # the CPU on varied routing; the GPU on one prompt whose experts the warm-up made resident
            feats, ys, rows, used = _runs(llm, eng, self.prompt, run_sizes, self.reps, facts.top_k,
                                          lambda: self.bar.update(1), vary=n == 0)
            if n == 0:
                self.sources["cpu_weights"] = cpu_weights_note(eng.repacked(), facts, eng.fused_max_tokens())
        finally:
            self.hook.set_engine(self.before)
            eng.release()
        self.fit(feats, ys, run_sizes, note, fields)
        return rows, used

    def fit(self, feats: list, ys: list, run_sizes: list, note: str, fields: tuple) -> None:
        """Least-squares fit of ``fields`` over the samples (:func:`_fit`, relative error); a small-row term that
        the samples cannot separate from the per-pair one is left at 0."""
        rows_used = [row[:len(fields)] for row in feats]
        if not rows_used:
            raise NothingMeasured(NOTHING_MEASURED)
        rank = int(np.linalg.matrix_rank(np.asarray(rows_used, dtype=np.float64)))
        if rank < len(fields) and fields[-1] == "cpu_c_s":
            # the small-row and per-pair terms move together at these sizes (few experts reach 8 rows): c is left
            # at 0 and the rest fitted
            self.cm.cpu_c_s = 0.0
            self.sources["cpu_c_s"] = f"0: not separable from cpu_b_s at ubatches {list(run_sizes)}"
            fields = fields[:-1]
            rows_used = [row[:len(fields)] for row in rows_used]
            rank = int(np.linalg.matrix_rank(np.asarray(rows_used, dtype=np.float64)))
        caveat = ""
        if rank < len(fields):
            # e.g. a model whose only MoE layer is the last: upstream computes just the output row there, so every
            # ubatch size reaches it with the same routed pairs
            caveat = (f"; the samples do not separate {', '.join(fields)} (rank {rank} of {len(fields)}: the MoE "
                      "layers saw the same experts and pairs at every size), so these are one of many fits")
            warnings.warn(f"calibration: {note}{caveat}", RuntimeWarning, stacklevel=5)
        for f, v in zip(fields, _fit(rows_used, ys, relative=True)):
            setattr(self.cm, f, float(v))
            self.sources[f] = f"fit over {len(ys)} (MoE layer, run) samples, ubatches {list(run_sizes)}, {note}{caveat}"

    def non_expert(self, layer_rows: list) -> None:
        """The non-expert work per MoE layer, fitted against the tokens (dense layers get the same figures)."""
        cm, sources = self.cm, self.sources
        la, lb = _fit([(1.0, T) for T, _ in layer_rows], [v for _, v in layer_rows])
        cm.layer_a_s, cm.layer_b_s = float(la), float(lb)
        cm.dense_a_s, cm.dense_b_s = float(la), float(lb)
        for f in ("layer_a_s", "layer_b_s"):
            sources[f] = "(compute time - MoE layers' engine time) / MoE layers, fit against tokens"
        for f in ("dense_a_s", "dense_b_s"):
            sources[f] = "set to the MoE layer's non-expert figures (approximation)"

    def copies(self) -> None:
        """Host-to-device bandwidth and latency, the activations' round trip, and the two copy overlaps."""
        eng, device, cm, sources, name = engine_module(), self.device, self.cm, self.sources, self.device_name
        overlap_reps = 2 * self.reps + 1
        big = int(max(sum(b_) for b_ in self.facts.expert_bytes))
        t_small = eng.measure_h2d_s(device, 4096, 5)
        t_big = eng.measure_h2d_s(device, big * 4, 5)
        bw = (big * 4 - 4096) / max(t_big - t_small, 1e-9)
        cm.h2d_bandwidth_Bps = float(bw)
        cm.h2d_latency_s = float(max(0.0, t_small - 4096 / bw))
        sources["h2d_bandwidth_Bps"] = f"timed copies of 4096 and {big * 4} bytes ({name})"
        sources["h2d_latency_s"] = sources["h2d_bandwidth_Bps"]
        cm.act_b_s = 2.0 * self.facts.n_embd * 4 / bw
        sources["act_b_s"] = "hidden state to the GPU and back per token at the measured bandwidth"
        cm.copy_overlap = float(eng.measure_copy_overlap(device, big, overlap_reps))
        sources["copy_overlap"] = (f"a copy of {big} bytes and a compute of about its length, alone and together "
                                   f"({name})")
        n_thr = int(self.threads or self.llm.n_threads)
        cm.cpu_copy_overlap = float(eng.measure_cpu_copy_overlap(device, big * 4, overlap_reps, n_thr))
        sources["cpu_copy_overlap"] = (f"copies of {big * 4} bytes queued as the engine queues them and a memory-bound "
                                       f"CPU chain ({n_thr} threads) of about their length, alone and together "
                                       f"({name})")
        self.bar.update(1)

    def gpu(self, n_slots: int, used: dict) -> None:
        """The GPU share, on the ubatch sizes whose experts all stay resident in the slots the user's budget allows."""
        run_sizes = [T for T in self.sizes if used.get(T, 0.0) <= n_slots]
        self.bar.total = self.bar.n + (len(run_sizes) * (self.reps + 1) if len(run_sizes) >= 2 else 0) + 1
        self.bar.refresh()
        if len(run_sizes) >= 2:
            self.share(n_slots, run_sizes, "gpu-on-demand",
                       f"every expert on {self.device_name} ({n_slots} slots, gpu-on-demand)",
                       ("act_a_s", "gpu_a_s", "gpu_b_s"))
            return
        for f in ("act_a_s", "gpu_a_s", "gpu_b_s"):
            self.sources[f] = (f"{DEFAULT_COST_HARDWARE} preset (not measured: {n_slots} GPU slots hold the experts of "
                               "fewer than two calibration ubatches)")


def measure(llm, *, device: Optional[int], n_slots: int, quick: bool = False, threads: Optional[int] = None,
            progress: bool = True, desc: str = "calibrating",
            reps: Optional[int] = None) -> tuple["_core.CostModel", dict, str]:
    """Measures the cost model on a loaded :class:`hybrimoe.Llama` with the engine's hook (``moe_cache`` given):
    its model, context and devices, within its ``n_ubatch`` and ``n_ctx``.

    Measuring engines are put on the Llama's hook in turn (``MoeHook.set_engine``) and the hook's engine is put back
    after; the context's memory (KV cache) is cleared after. ``device``: the accelerator (ggml device pointer) or
    None; ``n_slots``: GPU expert slots the GPU measurement may use (at most: the budget is the user's). The GPU
    is measured on the ubatch sizes whose experts (all MoE layers together) fit in those slots; with fewer than two
    such sizes the GPU fields keep the preset's values (sources say so). ``reps``: measured runs per ubatch size
    (default 2, 1 with ``quick``; the copy-overlap measurements take the median of ``2 reps + 1``); more give
    steadier figures on a noisy machine. Returns ``(cost model, sources {field: how it was measured}, device
    label)``.

    Raises:
        ValueError: the context is too small for two of the ubatch sizes; RuntimeError: a measurement failed (the
            measuring engine included).
    """
    if llm.moe_setup is None:
        raise ValueError("calibration.measure needs a hybrimoe.Llama with the engine's hook (moe_cache=...)")
    limit = min(int(llm.context_params.n_ubatch), int(llm.n_batch), int(llm.n_ctx()) - 1)
    sizes = [T for T in (QUICK_SIZES if quick else SIZES) if T <= limit]
    if len(sizes) < 2:
        raise ValueError(f"too small a context to calibrate in (n_ubatch {llm.context_params.n_ubatch}, n_ctx "
                         f"{llm.n_ctx()}): at least {QUICK_SIZES[1]} tokens needed")
    if reps is None:
        reps = 1 if quick else 2
    if reps < 1:
        raise ValueError(f"calibration repetitions must be >= 1, got {reps}")
    steps = len(sizes) * (reps + 1) * (2 if device and n_slots > 0 else 1) + 2
    bar = tqdm(total=steps, desc=desc, unit="step", file=sys.stderr, disable=not progress or not progress_on())
    m = _Measurement(llm, device, sizes, reps, threads, bar)
    try:
        layer_rows, used = m.share(0, sizes, "hybrimoe", "the calibration's own runs with every expert on the CPU",
                                   ("cpu_startup_s", "cpu_a_s", "cpu_b_s", "cpu_c_s"))
        m.non_expert(layer_rows)
        if device:
            m.copies()
            m.gpu(n_slots, used)
        bar.update(1)
    finally:
        bar.close()
        llm.reset()
        lc = llama_cpp_module().llama_cpp
        lc.llama_memory_clear(lc.llama_get_memory(llm.ctx), True)
    m.cm.validate()
    return m.cm, m.sources, m.device_name


def save(cm: "_core.CostModel", sources: dict, out: Path) -> Path:
    """Writes a calibration atomically (a reader never sees half a file; an existing one is replaced whole)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        save_cost_model(cm, tmp, sources)
    return out


def on_first_use(llm, *, device: int, n_slots: int, threads: Optional[int] = None) -> "Path | _core.CostModel":
    """The engine's first use of a model on a device without a stored calibration: a short one (the ``--quick``
    sizes up to the Llama's ``n_ubatch``: ubatches of 1, 4, 16 and 64 tokens, one repetition each; a progress bar
    on a terminal, or with ``HYBRIMOE_PROGRESS=1``) measured on the loaded ``llm`` itself (:func:`measure`, within
    the user's ``n_slots``), stored where :func:`stored` finds it; returns its path. When the store cannot be
    written it warns and returns the measured cost model itself (used for this run only). ``hybrimoe calibrate``
    makes a fuller one. Turn it off with ``HYBRIMOE_AUTO_CALIBRATE=0`` (the preset is used then).

    Raises:
        ValueError, RuntimeError: as :func:`measure` (the measurement failed).
    """
    model_path = llm.model_path
    label = _ggml.device_label(device)
    print(f"hybrimoe: no calibration of {Path(model_path).name} on {label}: measuring a short one "
          f"(hybrimoe calibrate makes a fuller one; {AUTO_CALIBRATE_ENV}=0 skips this)", file=sys.stderr)
    cm, sources, measured_on = measure(llm, device=device, n_slots=n_slots, quick=True, threads=threads,
                                       desc="hybrimoe: calibrating (first use)")
    for f in sources:
        sources[f] = f"first-use calibration (quick): {sources[f]}"
    out = calibration_path(model_path, measured_on, llm.moe_setup.cpu_path)
    try:
        return save(cm, sources, out)
    except (OSError, CostModelError) as e:
        warnings.warn(f"cannot store the first-use calibration in {out.parent} ({e}); it is used for this run only",
                      RuntimeWarning, stacklevel=3)
        return cm


def with_stored_cost(setup, model_path):
    """``setup`` (a :class:`hybrimoe.runtime.setup.EngineSetup` without a cost model) with this model's stored
    calibration
    on its device, if there is one (else unchanged). A stored file that cannot be used (damaged, or of a schema
    this version does not read) is set aside as ``<name>.bad`` (``.bad2``, ... when that exists) with a
    warning, and the set-up is returned unchanged: the first use measures a new one."""
    if setup.cost is not None:
        return setup
    found = stored(model_path, setup.device_label, setup.cpu_path)
    if found is None:
        return setup
    try:
        cost = resolve_cost_model(str(found), setup.facts.model)
    except ValueError as e:
        bad = found.with_name(found.name + ".bad")
        n = 1
        while bad.exists():  # an earlier damaged file is kept too
            n += 1
            bad = found.with_name(f"{found.name}.bad{n}")
        try:
            os.replace(found, bad)
            kept = f"moved to {bad}"
        except OSError:
            kept = "left in place"
        warnings.warn(f"the stored calibration {found} cannot be used ({e}); {kept}, a new one is measured",
                      RuntimeWarning, stacklevel=3)
        return setup
    return dataclasses.replace(setup, cost=cost, cost_source=str(found))


def with_device_costs(setup, model_path):
    """Several devices (``setup.more_devices``): each with this model's calibration stored under its own label
    (``hybrimoe calibrate`` on that device; an RPC stand-in's label carries its memory), where there is one; the
    others plan with the first device's cost model. Unchanged with one device, or when the user gave
    ``moe_cost_model`` (every device plans with it)."""
    if not setup.more_devices or setup.cost_given:
        return setup
    shares = []
    for d in setup.more_devices:
        found = stored(model_path, d.label, setup.cpu_path) if d.cost is None else None
        if found is not None:
            try:
                d = dataclasses.replace(d, cost=resolve_cost_model(str(found), setup.facts.model),
                                        cost_source=str(found))
            except ValueError as e:
                warnings.warn(f"the stored calibration {found} of {d.label} cannot be used ({e}); that device plans "
                              "with the first device's cost model", RuntimeWarning, stacklevel=3)
        shares.append(d)
    return dataclasses.replace(setup, more_devices=tuple(shares))


def with_first_use_cost(llm, setup, threads: Optional[int] = None):
    """``setup`` with a cost model for the loaded ``llm`` (its hook attached, no engine yet): unchanged when it has
    one; else measured on ``llm`` itself (:func:`on_first_use`) when the engine has GPU slots and
    ``HYBRIMOE_AUTO_CALIBRATE`` is not 0; else, or when that fails (a warning; the user keeps the loaded model), the
    default preset, with the reason in ``cost_source``."""
    if setup.cost is not None:
        return setup
    found, failed = None, None
    if setup.n_slots > 0 and auto_calibrate():
        try:
            found = on_first_use(llm, device=setup.device, n_slots=setup.n_slots, threads=threads)
        except NothingMeasured as e:
            # no warning here: the layers' fallback to upstream's path is what the user is told about, once
            return dataclasses.replace(setup, cost=resolve_cost_model(None, setup.facts.model),
                                       cost_source=f"preset {DEFAULT_COST_HARDWARE} ({e})")
        except (OSError, ValueError, RuntimeError) as e:
            failed = str(e)
            warnings.warn(f"the first-use calibration failed ({e}); using the {DEFAULT_COST_HARDWARE} preset (hybrimoe "
                          "calibrate measures one)", RuntimeWarning, stacklevel=3)
    if isinstance(found, _core.CostModel):  # measured, but the store was not writable
        return dataclasses.replace(setup, cost=found, cost_source="first-use calibration (not stored)")
    if found is not None:
        return dataclasses.replace(setup, cost=resolve_cost_model(str(found), setup.facts.model),
                                   cost_source=str(found))
    if failed:
        why = f"first-use calibration failed: {failed}: hybrimoe calibrate"
    elif setup.n_slots == 0:
        # every expert runs on the CPU: no split is planned, so the preset's GPU figures decide nothing
        why = "no GPU slots: every expert on the CPU, nothing for it to decide"
    else:
        why = "no calibration stored, first-use calibration off: hybrimoe calibrate"
    return dataclasses.replace(setup, cost=resolve_cost_model(None, setup.facts.model),
                               cost_source=f"preset {DEFAULT_COST_HARDWARE} ({why})")
