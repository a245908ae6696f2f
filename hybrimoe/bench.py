"""``hybrimoe bench``: hybrimoe against upstream llama.cpp offloading at the same GPU memory (llama-bench style).

On one model and the same prompts, each mode is loaded, warmed up, measured over ``-r`` repetitions and closed:

- ``upstream -ot exps=CPU``: non-expert weights on the GPU, every routed expert in host memory (upstream's
  default CPU buffers, repacking included);
- ``upstream --n-cpu-moe N``: the routed experts of the last MoE layers on the GPU, as many whole layers as the
  cache budget holds (the smallest N that fits);
- ``upstream -ngl K``: whole layers on the GPU, as many of the last ones as fit in the GPU memory the other modes
  use (their non-expert weights plus the budget);
- ``hybrimoe <policy>`` for each engine policy, with ``moe_cache`` = the budget (by default every engine preset;
  ``hot-set`` only with ``--moe-profile``, which every hybrimoe mode is then given: see ``hybrimoe.Llama``'s
  ``moe_profile``).

Figures per mode: prompt processing (pp, ``-p`` tokens in one batch) and text generation (tg, ``-n`` greedy
tokens after it) in tokens/s, mean and standard deviation over the repetitions; for hybrimoe the cache hit rate
and the bytes copied to the GPU per generated token (decode only). Timings come from llama.cpp's own context timer
(``llama_perf_context``, with ``llama_synchronize`` after every ``eval``): graph compute, no Python. With
``--replay-trace`` every mode routes the trace's expert ids (the text is then meaningless). Without a GPU, use the
RPC stand-in (``--rpc``, or ``--stand-in`` to start one): it is the same CPU, so no speed claim can be made there.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .defaults import progress_on
from .policy import ENGINE_PRESETS, PROFILE_PRESETS

def prompts(llm, n: int, n_tokens: int) -> list[list[int]]:
    """``n`` prompts of exactly ``n_tokens`` tokens (BOS + seeded random words), one per repetition."""
    from hybrimoe.tiny import _WORDS

    out = []
    for i in range(n):
        rng = np.random.default_rng(1000 + i)
        toks: list[int] = []
        while len(toks) < n_tokens:
            text = " ".join(rng.choice(_WORDS, size=4 * n_tokens))
            toks = llm.tokenize(text.encode(), add_bos=True, special=False)
        out.append(toks[:n_tokens])
    return out


class Config:
    """One loaded ``hybrimoe.Llama`` and its measurements."""

    def __init__(self, label: str, path: Path, n_ctx: int, threads: int, **kw):
        from hybrimoe import Llama

        self.label = label
        self.kw = {k: v for k, v in kw.items() if k != "rpc_servers"}
        self.llm = Llama(str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False, **kw)
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
        from hybrimoe._lib import llama_cpp_module

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
            from .engine import layer_totals

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
        from .engine import layer_totals

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

    def replay(self) -> dict:
        """Replays the decision log through the simulator (fresh policies, same preset, budget and cost model) and
        compares: ``decisions_agree``, ``decision_difference`` (the first one, if any, or why the replay failed), and
        the MoE time that the cost model predicts for the replayed plans (the scheduler's makespans, summed over the
        MoE layers) against the engine's measured one (plan start to GPU share done, summed over the MoE layers), in
        prefill (milliseconds per prompt) and decode (milliseconds per token): medians over the repetitions, and
        ``prediction_ratio_pp`` / ``prediction_ratio_tg``, the median over repetitions of predicted / measured."""
        from hybrimoe import _core
        from hybrimoe.simulate import replay_engine_log

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
            for key, pred, meas in (("prediction_ratio_pp", pp_pred, pp_meas), ("prediction_ratio_tg", tg_pred, tg_meas)):
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
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}..{fmt.format(max(xs))})"




# ---- hybrimoe bench ----------------------------------------------------------------------------------------------

def _layer_bytes(path) -> dict:
    """{model layer: (all tensor bytes, routed-expert bytes)} and the bytes outside the layers, from the GGUF."""
    import re

    import gguf

    blk = re.compile(r"^blk\.(\d+)\.")
    exps = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")
    per: dict = {}
    outside = 0
    for t in gguf.GGUFReader(os.fspath(path)).tensors:
        m = blk.match(t.name)
        if not m:
            outside += int(t.n_bytes)
            continue
        a, e = per.get(int(m.group(1)), (0, 0))
        per[int(m.group(1))] = (a + int(t.n_bytes), e + (int(t.n_bytes) if exps.search(t.name) else 0))
    return {"layers": per, "outside": outside}


def upstream_modes(path, budget: int, n_layer: int) -> list[tuple[str, dict, int]]:
    """The upstream modes at a GPU budget of ``budget`` bytes for routed experts: (label, Llama kwargs, GPU bytes of
    routed experts). ``--n-cpu-moe N`` keeps experts of layers N.. on the GPU (as many whole MoE layers as fit);
    ``-ngl K`` puts the last K whole layers on the GPU within the same total GPU memory."""
    lb = _layer_bytes(path)
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="GGUF model")
    p.add_argument("--moe-cache", default="25%", help="GPU memory for routed experts, every mode (default 25%%)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (pp; default %(default)s)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (tg; default %(default)s)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="repetitions per mode (default %(default)s)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: llama-cpp-python's)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=99, help="layers on the GPU for the non-partial "
                   "modes (default %(default)s)")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT", help="ggml RPC server as the GPU")
    p.add_argument("--stand-in", action="store_true",
                   help="start a ggml-rpc-server on 127.0.0.1 as the GPU (machines without one; no speed claim)")
    p.add_argument("--policies", default=None,
                   help=f"engine policies to run, comma-separated (default: {','.join(ENGINE_PRESETS)}; "
                        f"{', '.join(PROFILE_PRESETS)} only with --moe-profile)")
    p.add_argument("--moe-profile", default=None, metavar="TRACE.npz",
                   help="profile of expert frequencies for every hybrimoe mode: a routing trace (hybrimoe trace) of "
                        "this model; hot-set needs it")
    p.add_argument("--upstream", default="exps,ncmoe,ngl", help="upstream modes to run: exps, ncmoe, ngl")
    p.add_argument("--moe-cost-model", default=None, help="planner cost model for hybrimoe (preset or JSON)")
    p.add_argument("--replay-trace", default=None, metavar="TRACE.npz", help="route every mode by a trace")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--csv", default=None, metavar="FILE", help="write the table as CSV")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="bar chart of pp and tg tokens/s")
    p.add_argument("--force", action="store_true", help="replace existing --json, --csv and --plot files")


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (math.nan, math.nan)


def _check_outputs(args) -> None:
    """Every output path is checked before a long run (:func:`hybrimoe.outputs.check_output`: not an input, not an
    existing file without ``--force``, a writable folder), and the plot's format is one matplotlib writes.

    Raises:
        ValueError: naming the option and the problem.
    """
    from .outputs import check_output

    inputs = [("-m", args.model), ("--replay-trace", args.replay_trace),
              ("--moe-profile", getattr(args, "moe_profile", None)),
              ("--moe-cost-model", getattr(args, "moe_cost_model", None))]
    outs = [(flag, f) for flag, f in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)) if f]
    for i, (flag, f) in enumerate(outs):
        check_output(f, flag, force=getattr(args, "force", False), inputs=inputs + outs[:i])
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".pdf", ".svg"):
        raise ValueError(f"--plot {args.plot}: use a .png, .pdf or .svg file name")


UPSTREAM_MODES = ("exps", "ncmoe", "ngl")


def _check_modes(args, facts) -> tuple[list[str], set]:
    """The policies and upstream modes asked for, checked before anything runs."""
    from .engine import resolve_cost_model

    from .engine import load_profile

    profile = getattr(args, "moe_profile", None)
    if args.policies is None:
        pols = [p for p in ENGINE_PRESETS if profile is not None or p not in PROFILE_PRESETS]
    else:
        pols = [x.strip() for x in args.policies.split(",") if x.strip()]
    for p in pols:
        if p not in ENGINE_PRESETS:
            raise ValueError(f"--policies: unknown policy '{p}' (known: {', '.join(ENGINE_PRESETS)})")
        if p in PROFILE_PRESETS and profile is None:
            raise ValueError(f"--policies: '{p}' needs --moe-profile (a routing trace of this model, hybrimoe trace)")
    load_profile(profile, facts)  # a bad profile fails before anything runs
    up = {m.strip() for m in args.upstream.split(",") if m.strip()}
    bad = up - set(UPSTREAM_MODES)
    if bad:
        raise ValueError(f"--upstream: unknown mode(s) {', '.join(sorted(bad))} (known: {', '.join(UPSTREAM_MODES)})")
    if not pols and not up:
        raise ValueError("nothing to run: --policies and --upstream are both empty")
    if args.rpc and args.stand_in:
        raise ValueError("give either --rpc or --stand-in, not both")
    if args.moe_cost_model is not None:
        resolve_cost_model(args.moe_cost_model, facts)
    return pols, up


def run(args) -> int:
    from tqdm import tqdm

    from .engine import cache_slots, engine_facts

    try:
        _check_outputs(args)
        for name, v, low in (("-p", args.n_prompt, 1), ("-n", args.n_gen, 1), ("-r", args.repetitions, 1)):
            if v < low:
                raise ValueError(f"{name} must be >= {low}")
        facts = engine_facts(args.model)
        pols, up = _check_modes(args, facts)
        n_slots = cache_slots(args.moe_cache, facts)
        budget = n_slots * facts.slot_bytes
        replay = None
        if args.replay_trace:
            from .replay import replay_table

            # a recorded trace (with phases): prefill routing for the prompt, decode routing for the generated tokens
            replay = replay_table(args.replay_trace, args.model, layout=(args.n_prompt, args.n_gen))
    except (OSError, ValueError) as e:
        print(f"hybrimoe bench: error: {e}", file=sys.stderr)
        return 1
    if replay is not None:
        print(f"hybrimoe bench: routing replayed from {args.replay_trace}: the generated text is meaningless",
              file=sys.stderr)
    server = None
    endpoint = args.rpc
    if args.stand_in and not endpoint:
        from .rpc import RPCServer

        server = RPCServer(threads=args.threads or 1).start()
        endpoint = server.endpoint
        print(f"hybrimoe bench: RPC stand-in at {endpoint} (the same CPU: no speed claim)", file=sys.stderr)
    device = endpoint
    if not endpoint:
        from . import _ggml

        gpu = _ggml.accelerator([])
        device = _ggml.device_label(gpu) if gpu else None
        if not device:
            print("hybrimoe bench: error: no GPU found: give --rpc HOST:PORT (a ggml-rpc-server) or --stand-in",
                  file=sys.stderr)
            return 1
    common = dict(rpc_servers=endpoint, moe_replay=replay, threads=args.threads or os.cpu_count() or 1)
    modes: list[tuple[str, dict, int]] = []
    for label, kw, gpu_bytes in upstream_modes(args.model, budget, facts.n_layer):
        key = "exps" if "exps" in label else "ncmoe" if "n-cpu-moe" in label else "ngl"
        if key in up:
            kw = dict(kw)
            kw.setdefault("n_gpu_layers", args.n_gpu_layers)
            modes.append((label, kw, gpu_bytes))
    for pol in pols:
        modes.append((f"hybrimoe {pol}", dict(n_gpu_layers=args.n_gpu_layers, moe_cache=budget, moe_policy=pol,
                                              moe_cost_model=args.moe_cost_model, moe_profile=args.moe_profile),
                      budget))
    rows = []
    bar = tqdm(total=len(modes) * (args.repetitions + 1), desc="bench", unit="run", file=sys.stderr,
               disable=not progress_on())
    ref_tokens = None
    try:
        for label, kw, gpu_bytes in modes:
            try:
                cfg = Config(label, Path(args.model), n_ctx=args.n_prompt + args.n_gen + 8, **common, **kw)
            except (ValueError, RuntimeError) as e:
                print(f"hybrimoe bench: {label}: cannot load: {e}", file=sys.stderr)
                rows.append(dict(mode=label, error=str(e)))
                bar.update(args.repetitions + 1)
                continue
            try:
                ps = prompts(cfg.llm, args.repetitions + 1, args.n_prompt)
                for i in range(-1, args.repetitions):
                    cfg.start(ps[i])
                    for _ in range(args.n_gen if i >= 0 else min(8, args.n_gen)):
                        cfg.step()
                    cfg.finish(keep=i >= 0)
                    bar.update(1)
                checked = cfg.replay() if cfg.llm.moe_engine is not None else {}
            finally:
                cfg.close()
            pp = [r["n_prompt"] / r["prompt_perf_s"] for r in cfg.reps if r["prompt_perf_s"] > 0]
            tg = [r["n_decode"] / r["decode_perf_s"] for r in cfg.reps if r["decode_perf_s"] > 0]
            row = dict(mode=label, gpu_expert_bytes=gpu_bytes, n_prompt=args.n_prompt, n_gen=args.n_gen,
                       repetitions=args.repetitions)
            row["pp_tps"], row["pp_tps_sd"] = _mean_sd(pp)
            row["tg_tps"], row["tg_tps_sd"] = _mean_sd(tg)
            e = cfg.engine_acc
            if e:
                row["hit_rate"] = e["hits"] / e["accesses"] if e["accesses"] else 0.0
                n_tok = sum(r["n_decode"] for r in cfg.reps)
                row["h2d_bytes_per_token"] = e["bytes"] / n_tok if n_tok else 0.0
                row["gpu_expert_share"] = e["gpu_experts"] / max(1, e["gpu_experts"] + e["cpu_experts"])
            toks = [r["tokens"] for r in cfg.reps]
            if ref_tokens is None:
                ref_tokens = toks
            row["same_tokens_as_first"] = sum(a == b for a, b in zip(toks, ref_tokens))
            row.update(checked)
            rows.append(row)
    finally:
        bar.close()
        if server is not None:
            server.stop()
    print(format_table(rows, args))
    for line in noise_warnings(rows):
        print(line)
    checked = [r for r in rows if "decisions_agree" in r]
    if checked:
        bad = [r["mode"] for r in checked if not r["decisions_agree"]]
        print(f"simulator replay of the engine's decisions: {len(checked) - len(bad)}/{len(checked)} policies agree "
              "exactly" + (f"; differ: {', '.join(bad)}" if bad else ""))
    doc = dict(model=os.fspath(args.model), moe_cache=str(args.moe_cache), budget_bytes=budget,
               slot_bytes=facts.slot_bytes, n_slots=n_slots, device=device,
               stand_in=bool(server), replay_trace=args.replay_trace, moe_profile=args.moe_profile, rows=rows)
    from .outputs import atomic_open, write_text

    if args.json:
        write_text(args.json, json.dumps(doc, indent=2))
    if args.csv:
        keys = sorted({k for r in rows for k in r}, key=lambda k: (k != "mode", k))
        with atomic_open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    if args.plot:
        _plot(rows, args)
    return 0 if all("error" not in r for r in rows) else 1


def format_table(rows: Sequence[dict], args) -> str:
    """llama-bench-style Markdown table."""
    head = (f"| mode | GPU experts MiB | pp{args.n_prompt} t/s | tg{args.n_gen} t/s | hit rate | "
            "H2D MiB/token | same tokens | MoE ms/prompt predicted / measured | MoE ms/token predicted / measured |")
    out = [head, "|" + "---|" * 9]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['mode']} | error: {r['error']} | | | | | | | |")
            continue
        hr = f"{r['hit_rate']:.3f}" if "hit_rate" in r else "-"
        h2d = f"{r['h2d_bytes_per_token'] / 2**20:.2f}" if "h2d_bytes_per_token" in r else "-"
        sp = (f"{r['predicted_moe_ms_per_prompt']:.1f} / {r['measured_moe_ms_per_prompt']:.1f}"
              if "predicted_moe_ms_per_prompt" in r else "-")
        sm = (f"{r['predicted_moe_ms_per_token']:.2f} / {r['measured_moe_ms_per_token']:.2f}"
              if "predicted_moe_ms_per_token" in r else "-")
        out.append(f"| {r['mode']} | {r['gpu_expert_bytes'] / 2**20:.1f} | {r['pp_tps']:.1f} ± {r['pp_tps_sd']:.1f} | "
                   f"{r['tg_tps']:.2f} ± {r['tg_tps_sd']:.2f} | {hr} | {h2d} | "
                   f"{r['same_tokens_as_first']}/{r['repetitions']} | {sp} | {sm} |")
    return "\n".join(out)


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


def _plot(rows: Sequence[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(ok) + 2))
    for ax, key, title in ((axes[0], "pp_tps", f"pp{args.n_prompt}"), (axes[1], "tg_tps", f"tg{args.n_gen}")):
        ax.barh([r["mode"] for r in ok], [r[key] for r in ok], xerr=[r[key + "_sd"] for r in ok])
        ax.set_xlabel("tokens/s")
        ax.set_title(title)
        ax.invert_yaxis()
    fig.tight_layout()
    from .outputs import savefig

    savefig(fig, args.plot, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="hybrimoe bench", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))
