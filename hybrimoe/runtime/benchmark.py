"""The measuring machinery of ``hybrimoe bench`` (and of ``bench/bench_engine.py``): one loaded Llama per mode
(:class:`Config`), interleaved repetitions (:func:`interleave`), the upstream placements at the same GPU memory
(:func:`upstream_modes`) and the noise check of the figures (:func:`noise_warnings`).

Timings come from llama.cpp's own context timer (``llama_perf_context``, with ``llama_synchronize`` after every
``eval``): graph compute, no Python.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from hybrimoe import _core
from hybrimoe._lib import llama_cpp_module
from hybrimoe.model.reader import layer_bytes
from hybrimoe.runtime.decision_replay import replay_engine_log
from hybrimoe.runtime.llama import Llama
from hybrimoe.runtime.stats import layer_totals
from hybrimoe.tiny.tokenizers import WORDS


def io_counters() -> tuple[int, int]:
    """``(bytes this process has read from block devices, major page faults)`` so far: ``/proc/self/io``'s
    ``read_bytes`` (what reached the storage layer: page-cache hits are not in it, read-ahead is) and getrusage's
    ``ru_majflt`` (faults that had to read the disk). ``(0, faults)`` where ``/proc/self/io`` is not readable."""
    import resource

    n = 0
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    n = int(line.split()[1])
    except OSError:
        pass
    return n, int(resource.getrusage(resource.RUSAGE_SELF).ru_majflt)


def prompts(llm, n: int, n_tokens: int) -> list[list[int]]:
    """``n`` prompts of exactly ``n_tokens`` tokens (BOS + seeded random words), one per repetition."""
    out = []
    for i in range(n):
        rng = np.random.default_rng(1000 + i)
        toks: list[int] = []
        while len(toks) < n_tokens:
            text = " ".join(rng.choice(WORDS, size=4 * n_tokens))
            toks = llm.tokenize(text.encode(), add_bos=True, special=False)
        out.append(toks[:n_tokens])
    return out


class Config:
    """One loaded ``hybrimoe.Llama`` and its measurements. ``flash_attn``: as ``hybrimoe.Llama``'s; by default
    ``"auto"``, upstream's (llama-bench's and llama-server's) default, in every mode alike."""

    def __init__(self, label: str, path: Path, n_ctx: int, threads: int, flash_attn="auto", **kw):
        self.label = label
        self.kw = {k: v for k, v in kw.items() if k != "rpc_servers"}
        self.llm = Llama(str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False, flash_attn=flash_attn, **kw)
        self.reps: list[dict] = []
        self.engine_acc: dict | None = None
        st = self.llm.moe_stats()
        self.skipped = st.get("unsupported", []) + st.get("engine_skipped", [])
        # the engine's decision records from its first ubatch on, for the simulator's replay; each repetition keeps
        # the indices of its prompt's and its decode's records
        self.log: list[dict] = []
        if self.llm.moe_engine is not None:
            self.llm.moe_log()

    # ---- one repetition: start() evaluates the prompt, step() decodes one greedy token, finish() collects ----
    def start(self, prompt: list[int]) -> None:
        self._lc = lc = llama_cpp_module().llama_cpp
        llm = self.llm
        ctx = llm.ctx
        llm.reset()
        if llm.moe_engine is not None:
            llm.moe_engine.reset_stats()  # the prompt's MoE time alone (not the previous repetition's decode)
        lc.llama_perf_context_reset(ctx)
        t0 = time.perf_counter()
        llm.eval(prompt)
        lc.llama_synchronize(ctx)  # llama_decode may return before the compute ends; the perf timer stops here
        wall = time.perf_counter() - t0
        self._cur = dict(prompt_wall_s=wall, prompt_perf_s=lc.llama_perf_context(ctx).t_p_eval_ms * 1e-3,
                         n_prompt=len(prompt), tokens=[], step_wall_s=[], step_perf_s=[])
        eng = llm.moe_engine
        if eng is not None:
            # the prompt's decision records and measured MoE time, then counters over the decode phase only
            part = llm.moe_take_log()
            self._cur["prefill_idx"] = list(range(len(self.log), len(self.log) + len(part)))
            self._cur["prefill_layer_s"] = layer_totals(eng.layer_stats())["layer_s"]
            self.log.extend(part)
            eng.reset_stats()
            llm.moe_setup.policies.cache.reset_stats()
        lc.llama_perf_context_reset(ctx)
        self._t_eval = 0.0

    def step(self) -> None:
        lc, llm = self._lc, self.llm
        ctx = llm.ctx
        tok = int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(llm.n_vocab(),))))
        t0 = time.perf_counter()
        llm.eval([tok])
        lc.llama_synchronize(ctx)
        wall = time.perf_counter() - t0
        t_eval = lc.llama_perf_context(ctx).t_eval_ms * 1e-3
        r = self._cur
        r["tokens"].append(tok)
        r["step_wall_s"].append(wall)
        r["step_perf_s"].append(t_eval - self._t_eval)
        self._t_eval = t_eval

    def finish(self, keep: bool = True) -> dict:
        lc, llm = self._lc, self.llm
        r = self._cur
        n = len(r["tokens"])
        pd = lc.llama_perf_context(llm.ctx)
        if pd.n_eval != n:
            raise RuntimeError(f"{self.label}: llama_perf_context counted {pd.n_eval} decodes, expected {n}")
        r.update(n_decode=n, decode_wall_s=sum(r["step_wall_s"]), decode_perf_s=sum(r["step_perf_s"]))
        eng = llm.moe_engine
        if eng is not None:
            layers = eng.layer_stats()
            cs = llm.moe_setup.policies.cache.stats
            tot = layer_totals(layers)
            e = {k: tot[k] for k in ("runs", "tokens", "plan_s", "wait_s", "layer_s", "cpu_experts", "gpu_experts",
                                     "bytes_demand", "bytes_prefetch", "bytes_fill")}
            e.update(bytes=tot["bytes_copied"], accesses=cs.accesses, hits=cs.demand_hits + cs.prefetch_hits,
                     failed=int(bool(eng.failed)))
            r["engine"] = e
            part = llm.moe_take_log()
            r["decode_idx"] = list(range(len(self.log), len(self.log) + len(part)))
            r["decode_layer_s"] = e["layer_s"]
            self.log.extend(part)
            if keep:
                acc = self.engine_acc or {}
                for k, v in e.items():
                    acc[k] = acc.get(k, 0) + v
                self.engine_acc = acc
        if keep:
            self.reps.append(r)
        return r

    def replay_decisions(self) -> dict:
        """Replays the decision log through the simulator (fresh policies, same preset, budget and cost model) and
        compares: ``decisions_agree``, ``decision_difference`` (the first one, if any, or why the replay failed), and
        the MoE time that the cost model predicts for the replayed plans (the scheduler's makespans, summed over the
        MoE layers) against the engine's measured one (plan start to GPU share done, summed over the MoE layers), in
        prefill (milliseconds per prompt) and decode (milliseconds per token): medians over the repetitions, and
        ``prediction_ratio_pp`` / ``prediction_ratio_tg``, the median over repetitions of predicted / measured."""
        out = dict(decision_records=len(self.log))
        try:
            sim = replay_engine_log(self.llm, self.log)
            diff = _core.first_difference(self.log, sim)
        except (ValueError, RuntimeError) as e:  # a replay that fails is a finding, not the end of the bench
            out.update(decisions_agree=False, decision_difference=f"replay failed: {e}")
            return out
        out["decisions_agree"] = diff == ""
        if diff:
            out["decision_difference"] = diff
        pp_pred, pp_meas, tg_pred, tg_meas = [], [], [], []
        for r in self.reps:
            if "prefill_idx" not in r or "decode_idx" not in r:
                continue
            pp_pred.append(sum(sim[i]["makespan_s"] for i in r["prefill_idx"]))
            pp_meas.append(r["prefill_layer_s"])
            n = max(1, r["n_decode"])
            tg_pred.append(sum(sim[i]["makespan_s"] for i in r["decode_idx"]) / n)
            tg_meas.append(r["decode_layer_s"] / n)
        if pp_pred:
            out["predicted_moe_ms_per_prompt"] = 1e3 * statistics.median(pp_pred)
            out["measured_moe_ms_per_prompt"] = 1e3 * statistics.median(pp_meas)
            out["predicted_moe_ms_per_token"] = 1e3 * statistics.median(tg_pred)
            out["measured_moe_ms_per_token"] = 1e3 * statistics.median(tg_meas)
            # ratios only where something was measured (none when no MoE layer ran through the engine)
            for key, pred, meas in (("prediction_ratio_pp", pp_pred, pp_meas),
                                    ("prediction_ratio_tg", tg_pred, tg_meas)):
                ratios = [a / b for a, b in zip(pred, meas) if b > 0]
                if ratios:
                    out[key] = statistics.median(ratios)
        return out

    def close(self) -> None:
        self.llm.close()


def interleave(configs: list[Config], reps: int, n_prompt: int, n_decode: int, tag: str) -> None:
    """One warm-up, then ``reps`` repetitions. In each, every configuration evaluates prompt i (the order rotates
    between repetitions), then the configurations decode token by token in turn (A B C A B C ...), so that drift
    and other processes' load hit them alike at millisecond scale."""
    ps = prompts(configs[0].llm, reps + 1, n_prompt)
    for i in range(-1, reps):
        k = i % len(configs)
        order = configs[k:] + configs[:k]
        for c in order:
            c.start(ps[i])
        for _ in range(min(8, n_decode) if i < 0 else n_decode):
            for c in order:
                c.step()
        for c in order:
            c.finish(keep=i >= 0)  # the warm-up pages the weights in and allocates the graphs; not kept
        if i >= 0:
            print(f"  [{tag}] repetition {i + 1}/{reps} done", file=sys.stderr, flush=True)


def med_spread(xs: list[float], fmt: str = "{:.1f}") -> str:
    """``median (min..max)`` of ``xs``, each formatted with ``fmt``."""
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}..{fmt.format(max(xs))})"


def upstream_modes(path, budget: int, n_layer: int) -> list[tuple[str, dict, int]]:
    """The upstream modes at a GPU budget of ``budget`` bytes for routed experts: (label, Llama kwargs, GPU bytes of
    routed experts). ``--n-cpu-moe N`` keeps experts of layers N.. on the GPU (as many whole MoE layers as fit);
    ``-ngl K`` puts the last K whole layers on the GPU within the same total GPU memory."""
    lb = layer_bytes(path)
    layers = lb["layers"]
    n_cpu, used = n_layer, 0
    for il in range(n_layer - 1, -1, -1):
        e = layers.get(il, (0, 0))[1]
        if used + e > budget:
            break
        used += e
        n_cpu = il
    non_expert = sum(a - e for a, e in layers.values())
    total = non_expert + budget
    k, acc = 0, 0
    for il in range(n_layer - 1, -1, -1):
        a = layers.get(il, (0, 0))[0]
        if acc + a > total:
            break
        acc += a
        k += 1
    ngl_experts = sum(layers.get(il, (0, 0))[1] for il in range(n_layer - k, n_layer))
    return [("upstream -ot exps=CPU", dict(tensor_buft_overrides="exps=CPU"), 0),
            (f"upstream --n-cpu-moe {n_cpu}", dict(n_cpu_moe=n_cpu), used),
            (f"upstream -ngl {k}", dict(n_gpu_layers=k), ngl_experts)]


def mean_sd(xs: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation) of ``xs``; (nan, nan) for none, sd 0 for one."""
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (math.nan, math.nan)


#: the coefficient of variation (standard deviation / mean over the repetitions) above which a figure is flagged
NOISY_CV = 0.10


def noise_warnings(rows: Sequence[dict], limit: float = NOISY_CV) -> list[str]:
    """Lines naming every mode whose pp or tg tokens/s vary by more than ``limit`` (standard deviation over mean,
    across the repetitions), and marks those rows ``noisy: True`` (their JSON and CSV say so too); modes whose
    figures are all within ``limit`` are marked ``noisy: False``. Rows with an error are left alone.

    A speed-up read from noisy rows is not a measurement: other processes' load or frequency scaling moved the
    figures between repetitions (rerun on an idle machine, or with more ``-r``)."""
    out = []
    for r in rows:
        if "error" in r:
            continue
        bad = []
        for key, what in (("pp_tps", f"pp{r.get('n_prompt', '')}"), ("tg_tps", f"tg{r.get('n_gen', '')}")):
            mean, sd = r.get(key, math.nan), r.get(key + "_sd", math.nan)
            if mean > 0 and sd / mean > limit:
                bad.append(f"{what} {100 * sd / mean:.0f}%")
        r["noisy"] = bool(bad)
        if bad:
            out.append(f"noisy: {r['mode']}: {', '.join(bad)} spread (standard deviation over mean, > "
                       f"{100 * limit:.0f}%) across {r.get('repetitions', '?')} repetitions: rerun on an idle "
                       "machine or with more -r before reading speed-ups from it")
    return out


#: the CPU paths of a machine without a GPU (``hybrimoe bench --cpu-only``, bench/bench_cpu_kernels.py): upstream
#: as users run it (CPU weights in llama.cpp's default buffers: repacked where ggml-cpu has kernels for the type),
#: upstream ``--no-repack`` (an exactness oracle, not a speed baseline), and hybrimoe's engine with every routed
#: expert in its CPU share (``moe_cache=0``) on the file's layout, on the repacked one, fused (``moe_cpu_fused``:
#: upstream's numbers) and fused with every repacked gemm (``"fast"``: not bit for bit); (label, Llama keywords)
CPU_MODES = (
    ("upstream (default: repacked)", dict(n_gpu_layers=0)),
    ("upstream --no-repack", dict(n_gpu_layers=0, no_repack=True)),
    ("hybrimoe CPU share, --no-repack", dict(n_gpu_layers=0, moe_cache=0, no_repack=True)),
    ("hybrimoe CPU share (repacked)", dict(n_gpu_layers=0, moe_cache=0)),
    ("hybrimoe fused CPU share", dict(n_gpu_layers=0, moe_cache=0, moe_cpu_fused=True)),
    ("hybrimoe fused, fast", dict(n_gpu_layers=0, moe_cache=0, moe_cpu_fused="fast")),
)


def interleaved_runs(path, modes: Sequence[tuple[str, dict]], reps: int, n_prompt: int, n_gen: int, threads: int,
                     tick=None, external: Sequence[tuple[str, object]] = (), flash_attn="auto") -> list[dict]:
    """Every mode loaded once (all at the same time), one warm-up each, then ``reps`` repetitions; in each, every
    mode in turn (the order rotates by one mode per repetition) evaluates that repetition's prompt of ``n_prompt``
    tokens in one ubatch (pp) and then decodes ``n_gen`` greedy tokens (tg). The 1-minute load average is read
    before each run. Timings: llama.cpp's context timer (:class:`Config`). ``external``: more modes run by another
    program, ``(label, run)`` where ``run()`` does one pp and one tg run of the same sizes and returns their
    ``(pp tokens/s, tg tokens/s)`` (another llama.cpp build's llama-bench, say); they take their turns in the same
    rotation, their warm-up included. ``flash_attn``: every mode's (:class:`Config`).

    Returns one row per mode (``modes``, then ``external``): ``mode``, ``pp_tps`` and ``tg_tps`` (lists of tokens/s
    per repetition), ``pp_median``, ``pp_min``, ``pp_max`` and the same for ``tg``, ``loadavg`` (the load averages
    before its runs), ``tokens`` (the greedy tokens per repetition; none for an external mode) and
    ``same_tokens_as_first`` (repetitions whose tokens equal the first mode's), or ``mode`` and ``error`` for a mode
    that could not load or run. ``tick()`` is called after each run.
    """
    import os

    configs, rows, turns = [], [], []
    for label, kw in modes:
        try:
            cfg = Config(label, Path(path), n_ctx=n_prompt + n_gen + 8, threads=threads, flash_attn=flash_attn, **kw)
        except (ValueError, RuntimeError, OSError) as e:
            rows.append(dict(mode=label, error=str(e)))
            continue
        configs.append(cfg)
        rows.append(dict(mode=label, pp_tps=[], tg_tps=[], loadavg=[], tokens=[]))
        turns.append((cfg, rows[-1]))
    for label, run in external:
        rows.append(dict(mode=label, pp_tps=[], tg_tps=[], loadavg=[], tokens=[]))
        turns.append((run, rows[-1]))
    try:
        if not turns:
            return rows
        ps = prompts(configs[0].llm, reps + 1, n_prompt) if configs else []
        for i in range(-1, reps):
            k = i % len(turns)
            for who, row in turns[k:] + turns[:k]:
                if "error" in row:
                    continue
                load = os.getloadavg()[0]
                if isinstance(who, Config):
                    who.start(ps[i])
                    for _ in range(n_gen if i >= 0 else min(8, n_gen)):
                        who.step()
                    rec = who.finish(keep=i >= 0)
                    pp, tg = rec["n_prompt"] / rec["prompt_perf_s"], rec["n_decode"] / rec["decode_perf_s"]
                    if i >= 0:
                        row["tokens"].append(rec["tokens"])
                else:
                    try:
                        pp, tg = who()
                    except (OSError, RuntimeError, ValueError) as e:
                        label = row["mode"]
                        row.clear()
                        row.update(mode=label, error=str(e))
                        continue
                if i >= 0:
                    row["loadavg"].append(load)
                    row["pp_tps"].append(pp)
                    row["tg_tps"].append(tg)
                if tick:
                    tick()
    finally:
        for cfg in configs:
            cfg.close()
    first = next((row["tokens"] for _, row in turns if row.get("tokens")), [])
    for _, row in turns:
        if "error" in row:
            continue
        for key in ("pp", "tg"):
            xs = row[key + "_tps"]
            row.update({key + "_median": statistics.median(xs), key + "_min": min(xs), key + "_max": max(xs)})
        row["same_tokens_as_first"] = sum(a == b for a, b in zip(row["tokens"], first))
    return rows


def cpu_table(rows: Sequence[dict], n_prompt: int, n_gen: int) -> str:
    """Markdown table of :func:`interleaved_runs`' rows: per mode the median and range of pp and tg tokens/s, each
    median against the first mode's (upstream as users run it), the repetitions whose greedy tokens equal the first
    mode's ("-" for an external mode) and the range of the load averages before its runs."""
    out = [f"| mode | pp{n_prompt} t/s median (min..max) | tg{n_gen} t/s median (min..max) | vs first pp, tg | "
           "same tokens | load avg before runs |", "|" + "---|" * 6]
    base = next((r for r in rows if "error" not in r), None)
    for r in rows:
        if "error" in r:
            err = " ".join(r["error"].split())  # one table cell
            out.append(f"| {r['mode']} | error: {err[-300:]} | | | | |")
            continue
        same = f"{r['same_tokens_as_first']}/{len(r['tokens'])}" if r["tokens"] else "-"
        out.append(f"| {r['mode']} | {r['pp_median']:.1f} ({r['pp_min']:.1f}..{r['pp_max']:.1f}) | "
                   f"{r['tg_median']:.2f} ({r['tg_min']:.2f}..{r['tg_max']:.2f}) | "
                   f"{r['pp_median'] / base['pp_median']:.2f}x, {r['tg_median'] / base['tg_median']:.2f}x | {same} | "
                   f"{min(r['loadavg']):.2f}..{max(r['loadavg']):.2f} |")
    return "\n".join(out)
