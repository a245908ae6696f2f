"""Tables of simulator configurations on a persistent process pool (the never-worse tests' runner).

A table is many :func:`hybrimoe.sim.simulator.total_times` jobs over a few routing traces. A trace is named by a
spec rather than passed: ``("synthetic", shape, n_tokens, locality, seed)``
(:func:`hybrimoe.traces.synthetic.synthetic_trace`, deterministic in its arguments) or ``("file", path)``
(:func:`hybrimoe.traces.format.load_trace`). Each synthetic trace is generated once, by whichever worker is free,
while the other workers simulate, and written to a file the others read (a DeepSeek-V3-shaped trace with router
scores is about 160 MB: generating it takes seconds, reading it a fraction of one). Workers keep the last few traces
they used in memory, with the C++ trace of each stage they ran on it (:func:`hybrimoe.sim.simulator.stage_core_trace`:
built once per trace and stage, not once per job).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from hybrimoe.sim.simulator import stage_core_trace, total_times
from hybrimoe.traces.format import load_trace
from hybrimoe.traces.synthetic import synthetic_trace

#: a job: (trace spec, hardware preset, cache budget, stage, preset names, total_times keyword arguments)
Job = Tuple[tuple, str, str, str, Sequence[str], dict]

#: traces a worker keeps in memory (a table's traces: the never-worse tests use three per table)
_KEEP = 3
_traces: "OrderedDict[tuple, object]" = OrderedDict()
#: (trace spec, stage) -> the C++ trace of that stage's tokens, for the traces in _traces (stage None: a trace
#: without phases, whose stages simulate the same tokens)
_cores: Dict[Tuple[tuple, Optional[str]], object] = {}


def _build(spec: tuple):
    kind = spec[0]
    if kind == "synthetic":
        _, shape, n_tokens, locality, seed = spec
        return synthetic_trace(shape, n_tokens, locality=locality, seed=seed)
    if kind == "file":
        return load_trace(spec[1])
    raise ValueError(f"unknown trace spec {spec!r} (known kinds: 'synthetic', 'file')")


def _remember(spec: tuple, trace) -> None:
    _traces[spec] = trace
    _traces.move_to_end(spec)
    while len(_traces) > _KEEP:
        gone, _ = _traces.popitem(last=False)
        for key in [key for key in _cores if key[0] == gone]:
            del _cores[key]


def _trace(spec: tuple, path: Optional[str]):
    """The trace of ``spec`` in this process: from memory, else from ``path`` (written by :func:`_write`), else
    built."""
    if spec in _traces:
        _traces.move_to_end(spec)
        return _traces[spec]
    if path is not None:
        with open(path, "rb") as f:
            trace = pickle.load(f)
    else:
        trace = _build(spec)
    _remember(spec, trace)
    return trace


def _write(spec: tuple, path: str) -> str:
    """Worker job: builds the trace of ``spec`` and writes it to ``path`` (whole or not at all: a temporary file
    renamed into place)."""
    trace = _build(spec)
    _remember(spec, trace)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(trace, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
    return path


def _run(spec: tuple, path: Optional[str], hw: str, cache: str, stage: str, names: Sequence[str],
         max_tokens: int, kwargs: dict) -> dict:
    """Worker job: :func:`hybrimoe.sim.simulator.total_times` on the trace of ``spec``."""
    trace = _trace(spec, path)
    key = (spec, stage if trace.phases is not None else None)
    core = _cores.get(key)
    if core is None:
        core = _cores[key] = stage_core_trace(trace, stage)
    return total_times(trace, hw, cache, stage, names=names, max_tokens=max_tokens, core_trace=core, **kwargs)


class TablePool:
    """Runs tables of :func:`hybrimoe.sim.simulator.total_times` jobs on ``workers`` spawned processes (not forked:
    the caller may hold ggml threads) that live as long as the pool, so that the interpreter start, the imports and
    the traces are paid once for many tables. ``workers`` <= 1 runs every job in this process.

    ``directory``: where synthetic traces are written for the workers to share (about 160 MB for a DeepSeek-V3-shaped
    trace of 2,700 tokens with router scores); the files are removed by :meth:`close`.
    """

    def __init__(self, workers: int, directory: Path):
        self.workers = max(1, int(workers))
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._ex = (ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"))
                    if self.workers > 1 else None)
        self._files: Dict[tuple, Tuple[str, Optional[Future]]] = {}

    def prepare(self, specs: Sequence[tuple]) -> None:
        """Starts building the synthetic traces among ``specs`` that are not yet built (returns at once; a
        :meth:`run` that needs one waits for it)."""
        for spec in specs:
            if spec[0] != "synthetic" or spec in self._files:
                continue
            path = str(self.directory / ("-".join(str(p) for p in spec[1:]) + ".pkl"))
            if self._ex is None:
                self._files[spec] = (path, None)  # built in this process when first used
            else:
                self._files[spec] = (path, self._ex.submit(_write, spec, path))

    def _path(self, spec: tuple) -> Optional[str]:
        if spec[0] != "synthetic" or self._ex is None:
            return None
        self.prepare([spec])
        path, future = self._files[spec]
        future.result()  # raises what the build raised
        return path

    def run(self, jobs: Sequence[Job], max_tokens: int) -> List[dict]:
        """The ``total_times`` result of each job, in order. Jobs with the oracle, then decode jobs, are submitted
        first (the slowest first keeps the pool's tail short)."""
        if self._ex is None:
            return [_run(spec, None, hw, cache, stage, names, max_tokens, kw)
                    for spec, hw, cache, stage, names, kw in jobs]
        self.prepare([job[0] for job in jobs])
        order = sorted(range(len(jobs)), key=lambda i: ("oracle" not in jobs[i][4], jobs[i][3] != "decode"))
        futures = {}
        for i in order:
            spec, hw, cache, stage, names, kw = jobs[i]
            futures[i] = self._ex.submit(_run, spec, self._path(spec), hw, cache, stage, tuple(names), max_tokens,
                                         dict(kw))
        return [futures[i].result() for i in range(len(jobs))]

    def close(self) -> None:
        """Stops the workers and removes the trace files."""
        if self._ex is not None:
            self._ex.shutdown(wait=True, cancel_futures=True)
        for path, _ in self._files.values():
            Path(path).unlink(missing_ok=True)
        self._files.clear()
