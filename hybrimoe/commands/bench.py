"""``hybrimoe bench``: hybrimoe against upstream llama.cpp offloading at the same GPU memory (llama-bench style;
the measuring machinery is :mod:`hybrimoe.runtime.benchmark`).

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

With ``--moe-ram-cache BUDGET`` (a model larger than RAM) the modes are CPU only and need no GPU: ``upstream mmap``
(``-ngl 0 --no-repack``: the routed experts read through llama.cpp's mapping, by page faults) and ``hybrimoe RAM
<policy>`` for each ``--ram-policies`` entry (``moe_ram_cache=BUDGET``: the engine's RAM tier). The file is dropped
from the page cache before each mode loads (the repetitions after the warm-up then run with what the mode kept in
RAM); the rows add the bytes read from the disk and the major page faults per token (``/proc/self/io``,
getrusage), prefill and decode, and the RAM tier's hit rate. Nothing limits upstream's page cache here: on a
machine with more free memory than the budget it keeps more of the model than hybrimoe does (bench/bench_ram_real.py
runs both under one memory cgroup limit).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from hybrimoe import _ggml
from hybrimoe.commands.args import POSITIVE, THREADS, int_in
from hybrimoe.commands.llama_args import add_flash_attn_argument, add_split_arguments, split_keywords
from hybrimoe.envs import progress_on
from hybrimoe.model.reader import open_gguf
from hybrimoe.outputs import atomic_open, check_output, savefig, write_text
from hybrimoe.policy.hardware import resolve_cost_model
from hybrimoe.policy.presets import ENGINE_PRESETS, OPT_IN_PRESETS, PROFILE_PRESETS
from hybrimoe.runtime.benchmark import Config, io_counters, mean_sd, noise_warnings, prompts, upstream_modes
from hybrimoe.runtime.disk_calibration import drop_from_page_cache
from hybrimoe.runtime.engine_facts import engine_facts
from hybrimoe.runtime.readahead import ReadAhead
from hybrimoe.runtime.rpc import RPCServer
from hybrimoe.runtime.setup import cache_slots, load_profile
from hybrimoe.traces.routing_replay import routing_replay_table

HELP = "hybrimoe against upstream offloading at the same GPU memory (pp/tg tokens/s, hit rate, bytes copied)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``bench`` flags."""
    p.add_argument("-m", "--model", required=True, help="GGUF model")
    p.add_argument("--moe-cache", default=None,
                   help="GPU memory for routed experts, every mode (default 25%%; 0 with --moe-ram-cache)")
    p.add_argument("--moe-ram-cache", default=None, metavar="BUDGET",
                   help="a model larger than RAM: upstream's mmap (CPU only, --no-repack) against hybrimoe's RAM tier "
                        "with this much RAM for routed experts ('40%%', '12GiB', bytes, 'auto'), CPU only (no GPU "
                        "needed); the figures add disk bytes and major page faults per token")
    p.add_argument("--cpu-only", action="store_true",
                   help="no GPU: compare the CPU paths, interleaved: upstream as users run it (CPU weights repacked "
                        "where ggml-cpu can), upstream --no-repack, and hybrimoe's engine with every expert on the "
                        "CPU on either layout and fused (medians and ranges, the load average before each run)")
    p.add_argument("--read-ahead", default=None, metavar="KB[,KB...]",
                   help="with --moe-ram-cache: run every mode at each of these read_ahead_kb values of the model's "
                        "block device (set through sysfs where the process may, put back after; the value in force "
                        "is in each row), e.g. 128,512,2048,8192 (default: leave it as it is)")
    p.add_argument("--ram-policies", default=None,
                   help="with --moe-ram-cache: the RAM tier's cache policies to run (moe_ram_policy: mrs, lru, lfu, "
                        "reuse; default mrs,lru)")
    p.add_argument("-p", "--n-prompt", type=POSITIVE, default=512, help="prompt tokens (pp; default %(default)s)")
    p.add_argument("-n", "--n-gen", type=POSITIVE, default=128, help="generated tokens (tg; default %(default)s)")
    p.add_argument("-r", "--repetitions", type=POSITIVE, default=3, help="repetitions per mode (default %(default)s)")
    p.add_argument("-t", "--threads", type=THREADS, default=None,
                   help=f"CPU threads of every mode (default: all {os.cpu_count() or 1} cores here; the --stand-in "
                        "server's: 1)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int_in(0, also=(-1,)), default=None,
                   help="layers on the GPU for the non-partial "
                   "modes (default 99)")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT,...",
                   help="ggml RPC servers as the GPUs (several: llama.cpp's layer split over them, -ts)")
    add_flash_attn_argument(p)
    add_split_arguments(p)
    p.add_argument("--stand-in", action="store_true",
                   help="start a ggml-rpc-server on 127.0.0.1 as the GPU (machines without one; no speed claim)")
    p.add_argument("--policies", default=None,
                   help=f"engine policies to run, comma-separated (default: "
                        f"{','.join(p for p in ENGINE_PRESETS if p not in OPT_IN_PRESETS)}; "
                        f"{', '.join(PROFILE_PRESETS)} only with --moe-profile; "
                        f"{', '.join(OPT_IN_PRESETS)} only when named)")
    p.add_argument("--moe-profile", default=None, metavar="TRACE.npz",
                   help="profile of expert frequencies for every hybrimoe mode: a routing trace (hybrimoe trace) of "
                        "this model; hot-set needs it")
    p.add_argument("--upstream", default=None, help="upstream modes to run: exps, ncmoe, ngl (default all three)")
    p.add_argument("--moe-cost-model", default=None,
                   help="planner cost model for hybrimoe (preset or JSON; default: as run's --moe-cost-model, the "
                        "model's stored calibration on this device, else one measured on first use)")
    p.add_argument("--replay-trace", default=None, metavar="TRACE.npz", help="route every mode by a trace")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--csv", default=None, metavar="FILE", help="write the table as CSV")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="bar chart of pp and tg tokens/s")
    p.add_argument("--force", action="store_true", help="replace existing --json, --csv and --plot files")


def _check_outputs(args) -> None:
    """Every output path is checked before a long run (:func:`hybrimoe.outputs.check_output`: not an input, not an
    existing file without ``--force``, a writable folder), and the plot's format is one matplotlib writes.

    Raises:
        ValueError: naming the option and the problem.
    """
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
    profile = getattr(args, "moe_profile", None)
    if args.policies is None:
        pols = [p for p in ENGINE_PRESETS if p not in OPT_IN_PRESETS and (profile is not None or
                                                                          p not in PROFILE_PRESETS)]
    else:
        pols = [x.strip() for x in args.policies.split(",") if x.strip()]
    for p in pols:
        if p not in ENGINE_PRESETS:
            raise ValueError(f"--policies: unknown policy '{p}' (known: {', '.join(ENGINE_PRESETS)})")
        if p in PROFILE_PRESETS and profile is None:
            raise ValueError(f"--policies: '{p}' needs --moe-profile (a routing trace of this model, hybrimoe trace)")
    load_profile(profile, facts)  # a bad profile fails before anything runs
    if args.ram_policies is not None:
        raise ValueError("--ram-policies names the RAM tier's policies: it needs --moe-ram-cache")
    up = {m.strip() for m in (args.upstream if args.upstream is not None else ",".join(UPSTREAM_MODES)).split(",")
          if m.strip()}
    bad = up - set(UPSTREAM_MODES)
    if bad:
        raise ValueError(f"--upstream: unknown mode(s) {', '.join(sorted(bad))} (known: {', '.join(UPSTREAM_MODES)})")
    if not pols and not up:
        raise ValueError("nothing to run: --policies and --upstream are both empty")
    if args.rpc and args.stand_in:
        raise ValueError("give either --rpc or --stand-in, not both")
    if args.moe_cost_model is not None:
        resolve_cost_model(args.moe_cost_model, facts.model)
    return pols, up


def gpu_budget_spec(args) -> str:
    """``--moe-cache`` as given, else its default: 25% of the routed experts, 0 with ``--moe-ram-cache``."""
    if args.moe_cache is not None:
        return args.moe_cache
    return "0" if args.moe_ram_cache is not None else "25%"


def _check_ram_modes(args, facts) -> tuple[list[str], set]:
    """With ``--moe-ram-cache``: the RAM policies asked for (checked by building each) and the budget (checked
    against the model, and the machine's memory unless ``auto``), before anything loads."""
    from hybrimoe.runtime.ram_tier import ram_slots
    from hybrimoe.runtime.setup import ram_cache_policy

    pols = [x.strip().lower() for x in (args.ram_policies if args.ram_policies is not None else "mrs,lru").split(",")
            if x.strip()]
    if not pols:
        raise ValueError("--ram-policies is empty")
    twice = sorted({p for p in pols if pols.count(p) > 1})
    if twice:
        raise ValueError(f"--ram-policies names {', '.join(twice)} twice: each policy runs once")
    for p in pols:
        try:
            ram_cache_policy(p)
        except ValueError as e:
            raise ValueError(f"--ram-policies: {e}") from None
    if args.rpc or args.stand_in:
        raise ValueError("--moe-ram-cache runs CPU only: --rpc and --stand-in do not apply")
    if args.policies is not None:
        raise ValueError("--moe-ram-cache compares RAM tiers: give its cache policies with --ram-policies, not "
                         "--policies")
    for flag, value in (("--upstream", args.upstream), ("-ngl", args.n_gpu_layers)):
        if value is not None:
            raise ValueError(f"{flag} does not apply with --moe-ram-cache (CPU only: upstream's mmap against the RAM "
                             "tier)")
    if args.moe_cost_model is not None:
        resolve_cost_model(args.moe_cost_model, facts.model)
    if str(args.moe_ram_cache).strip().lower() != "auto":
        try:  # the engine's own check: parsable, at least a ubatch's experts, at most the machine's memory
            ram_slots(args.moe_ram_cache, facts, 512, ubatch_hint=False)
        except ValueError as e:
            raise ValueError(f"--moe-ram-cache: {str(e).removeprefix('moe_ram_cache: ')}") from None
    load_profile(getattr(args, "moe_profile", None), facts)
    return pols, {"mmap"}


def _inputs(args) -> tuple:
    """Everything checked before a mode runs: ``(facts, policies, upstream modes, slots, budget bytes, replay table
    or None)``. Raises ValueError or OSError naming the flag."""
    _check_outputs(args)
    facts = engine_facts(args.model)
    if args.moe_ram_cache is not None:
        pols, up = _check_ram_modes(args, facts)
    else:
        pols, up = _check_modes(args, facts)
    n_slots = cache_slots(gpu_budget_spec(args), facts)
    if args.moe_ram_cache is not None and n_slots > 0:
        raise ValueError(f"--moe-cache {args.moe_cache}: bench --moe-ram-cache compares CPU-only runs (upstream's "
                         "mmap against the RAM tier) and has no GPU mode; a GPU cache above the RAM tier runs with "
                         "`hybrimoe run`/`serve` (--moe-cache with --moe-ram-cache); here leave --moe-cache out or "
                         "give 0")
    routing_table = routing_scores = None
    if args.replay_trace:
        # a recorded trace (with phases): prefill routing for the prompt, decode routing for the generated tokens
        # with the trace's router scores where it has them (the engine's cache policies rank by them)
        routing_table, routing_scores = routing_replay_table(args.replay_trace, args.model,
                                                             layout=(args.n_prompt, args.n_gen), scores=True)
    if args.read_ahead is not None:
        parts = [x.strip() for x in args.read_ahead.split(",") if x.strip()]
        if not parts or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise ValueError(f"--read-ahead {args.read_ahead}: give read_ahead_kb values, whole numbers > 0 "
                             "separated by commas (e.g. 128,512,2048,8192)")
    if args.read_ahead is not None and args.moe_ram_cache is None:
        raise ValueError("--read-ahead sets how much a page fault reads from the disk: it applies with "
                         "--moe-ram-cache (a model larger than RAM)")
    return facts, pols, up, n_slots, n_slots * facts.slot_bytes, (routing_table, routing_scores)


def _modes(args, facts, pols: list, up: set, budget: int) -> list[tuple[str, dict, int]]:
    """(label, Llama keywords, GPU expert bytes) of every mode to run: the upstream ones asked for, then hybrimoe's."""
    modes = []
    if args.moe_ram_cache is not None:
        # CPU only: upstream reads the experts through its mapping (--no-repack: its default repacking would read
        # every expert into RAM at load, which a model larger than RAM does not allow), hybrimoe through its RAM
        # tier, also in the file's layout, so that both compute with the same kernels and give the same tokens
        # (the comparison is of the disk tier; the kernels are bench --cpu-only's)
        modes.append(("upstream mmap (CPU, --no-repack)", dict(n_gpu_layers=0, no_repack=True), 0))
        for pol in pols:
            modes.append((f"hybrimoe RAM {pol}", dict(n_gpu_layers=0, moe_ram_cache=args.moe_ram_cache,
                                                      moe_ram_policy=pol, moe_cost_model=args.moe_cost_model,
                                                      moe_profile=args.moe_profile, no_repack=True), 0))
        return modes
    ngl = args.n_gpu_layers if args.n_gpu_layers is not None else 99
    for label, kw, gpu_bytes in upstream_modes(args.model, budget, facts.n_layer):
        key = "exps" if "exps" in label else "ncmoe" if "n-cpu-moe" in label else "ngl"
        if key in up:
            kw = dict(kw)
            kw.setdefault("n_gpu_layers", ngl)
            modes.append((label, kw, gpu_bytes))
    # several devices: each takes its share of its own layers' experts, the same share of the whole as the byte
    # budget the upstream modes get (one size would be each device's)
    several = bool(args.tensor_split) or "," in (args.rpc or "")
    slots_all = facts.slot_bytes * len(facts.moe_layers) * facts.n_expert
    cache = f"{100.0 * budget / slots_all:.9g}%" if several else budget
    for pol in pols:
        modes.append((f"hybrimoe {pol}", dict(n_gpu_layers=ngl, moe_cache=cache, moe_policy=pol,
                                              moe_cost_model=args.moe_cost_model, moe_profile=args.moe_profile),
                      budget))
    return modes


def _measure_mode(args, label: str, kw: dict, gpu_bytes: int, common: dict, bar, ref: list) -> dict:
    """One mode loaded, warmed up, measured over ``-r`` repetitions and closed: its table row. ``ref``: the first
    mode's tokens per repetition (filled by the first mode that runs)."""
    ram = args.moe_ram_cache is not None
    try:
        if ram:  # every mode starts from a cold page cache: what it reads, it reads from the disk
            for f in open_gguf(args.model).files:
                drop_from_page_cache(f)
        cfg = Config(label, Path(args.model), n_ctx=args.n_prompt + args.n_gen + 8, **common, **kw)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"hybrimoe bench: {label}: cannot load: {e}", file=sys.stderr)
        bar.update(args.repetitions + 1)
        return dict(mode=label, error=str(e))
    try:
        ps = prompts(cfg.llm, args.repetitions + 1, args.n_prompt)
        disk = dict(pp_bytes=0, pp_faults=0, tg_bytes=0, tg_faults=0, ram_hits=0, ram_accesses=0, ram_bytes=0.0)
        for i in range(-1, args.repetitions):
            c0 = io_counters()
            cfg.start(ps[i])
            c1 = io_counters()
            for _ in range(args.n_gen if i >= 0 else min(8, args.n_gen)):
                cfg.step()
            c2 = io_counters()
            cfg.finish(keep=i >= 0)
            if i >= 0:
                disk["pp_bytes"] += c1[0] - c0[0]
                disk["pp_faults"] += c1[1] - c0[1]
                disk["tg_bytes"] += c2[0] - c1[0]
                disk["tg_faults"] += c2[1] - c1[1]
                r = cfg.llm.moe_stats().get("engine", {}).get("ram") or {}  # the decode's (reset after the prompt)
                if r:
                    disk["ram_hits"] += r["hits"]
                    disk["ram_accesses"] += r["accesses"]
                    disk["ram_bytes"] += r["bytes_read"]
            bar.update(1)
        checked = cfg.replay_decisions() if cfg.llm.moe_engine is not None else {}
    finally:
        cfg.close()
    pp = [r["n_prompt"] / r["prompt_perf_s"] for r in cfg.reps if r["prompt_perf_s"] > 0]
    tg = [r["n_decode"] / r["decode_perf_s"] for r in cfg.reps if r["decode_perf_s"] > 0]
    row = dict(mode=label, gpu_expert_bytes=gpu_bytes, n_prompt=args.n_prompt, n_gen=args.n_gen,
               repetitions=args.repetitions)
    row["pp_tps"], row["pp_tps_sd"] = mean_sd(pp)
    row["tg_tps"], row["tg_tps_sd"] = mean_sd(tg)
    e = cfg.engine_acc
    if e and not ram:  # the GPU cache's figures (none with the RAM tier: every expert on the CPU)
        row["hit_rate"] = e["hits"] / e["accesses"] if e["accesses"] else 0.0
        n_tok = sum(r["n_decode"] for r in cfg.reps)
        row["h2d_bytes_per_token"] = e["bytes"] / n_tok if n_tok else 0.0
        row["gpu_expert_share"] = e["gpu_experts"] / max(1, e["gpu_experts"] + e["cpu_experts"])
    if ram:
        n_pp, n_tg = args.n_prompt * args.repetitions, args.n_gen * args.repetitions
        row.update(pp_disk_bytes_per_token=disk["pp_bytes"] / n_pp, tg_disk_bytes_per_token=disk["tg_bytes"] / n_tg,
                   pp_major_faults_per_token=disk["pp_faults"] / n_pp,
                   tg_major_faults_per_token=disk["tg_faults"] / n_tg)
        if disk["ram_accesses"]:
            row.update(ram_hit_rate=disk["ram_hits"] / disk["ram_accesses"],
                       ram_bytes_read_per_token=disk["ram_bytes"] / n_tg)
    toks = [r["tokens"] for r in cfg.reps]
    if not ref:
        ref.extend(toks)
    row["same_tokens_as_first"] = sum(a == b for a, b in zip(toks, ref))
    row.update(checked)
    return row


def _write_outputs(args, doc: dict, rows: list) -> None:
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


def _run_cpu_only(args: argparse.Namespace) -> int:
    """``hybrimoe bench --cpu-only``: :data:`hybrimoe.runtime.benchmark.CPU_MODES`, interleaved
    (:func:`hybrimoe.runtime.benchmark.interleaved_runs`). 0 when every mode ran, 1 otherwise (or on bad input)."""
    from hybrimoe.runtime.benchmark import CPU_MODES, cpu_table, interleaved_runs

    try:
        _check_outputs(args)
        given = [flag for flag, v in (("--moe-ram-cache", args.moe_ram_cache), ("--rpc", args.rpc),
                                      ("--policies", args.policies), ("--upstream", args.upstream),
                                      ("-ngl", args.n_gpu_layers), ("--replay-trace", args.replay_trace),
                                      ("--moe-profile", args.moe_profile), ("--ram-policies", args.ram_policies),
                                      ("--read-ahead", args.read_ahead))
                 if v is not None] + (["--stand-in"] if args.stand_in else [])
        if args.moe_cache not in (None, "0"):
            given.append("--moe-cache")
        if given:
            raise ValueError(f"{', '.join(given)} do(es) not apply with --cpu-only (CPU paths only, no GPU, no "
                             "routing replay)")
        facts = engine_facts(args.model)
    except (OSError, ValueError) as e:
        print(f"hybrimoe bench: error: {e}", file=sys.stderr)
        return 1
    modes = [(label, dict(kw, moe_cost_model=args.moe_cost_model) if "moe_cache" in kw else kw)
             for label, kw in CPU_MODES]
    threads = args.threads or os.cpu_count() or 1
    bar = tqdm(total=len(modes) * (args.repetitions + 1), desc="bench", unit="run", file=sys.stderr,
               disable=not progress_on())
    try:
        rows = interleaved_runs(args.model, modes, args.repetitions, args.n_prompt, args.n_gen, threads,
                                tick=lambda: bar.update(1), flash_attn=args.flash_attn)
    finally:
        bar.close()
    print(cpu_table(rows, args.n_prompt, args.n_gen))
    _write_outputs(args, dict(model=os.fspath(args.model), device="CPU", threads=threads, arch=facts.arch,
                              flash_attn=args.flash_attn, rows=rows), rows)
    return 0 if all("error" not in r for r in rows) else 1


def run(args: argparse.Namespace) -> int:
    """Runs ``hybrimoe bench``: 0 when every mode ran, 1 otherwise (or on bad input)."""
    if getattr(args, "cpu_only", False):
        return _run_cpu_only(args)
    try:
        facts, pols, up, n_slots, budget, (routing_table, routing_scores) = _inputs(args)
        read_aheads = [int(x) for x in args.read_ahead.split(",") if x.strip()] if args.read_ahead else [None]
    except (OSError, ValueError) as e:
        print(f"hybrimoe bench: error: {e}", file=sys.stderr)
        return 1
    if routing_table is not None:
        print(f"hybrimoe bench: routing replayed from {args.replay_trace}: the generated text is meaningless",
              file=sys.stderr)
    server, endpoint = None, args.rpc
    if args.stand_in and not endpoint:
        server = RPCServer(threads=args.threads or 1).start()
        endpoint = server.endpoint
        print(f"hybrimoe bench: RPC stand-in at {endpoint} (the same CPU: no speed claim)", file=sys.stderr)
    device = endpoint
    if args.moe_ram_cache is not None:
        device = "CPU"
    elif not endpoint:
        gpu = _ggml.accelerator([])
        device = _ggml.device_label(gpu) if gpu else None
        if not device:
            print(f"hybrimoe bench: error: no GPU found ({_ggml.ACCELERATOR_KINDS}): give --rpc HOST:PORT (a "
                  "ggml-rpc-server) or --stand-in, or --cpu-only to compare the CPU paths", file=sys.stderr)
            return 1
    common = dict(rpc_servers=endpoint, moe_replay=routing_table, moe_replay_scores=routing_scores,
                  threads=args.threads or os.cpu_count() or 1, flash_attn=args.flash_attn, **split_keywords(args))
    modes = _modes(args, facts, pols, up, budget)
    bar = tqdm(total=len(read_aheads) * len(modes) * (args.repetitions + 1), desc="bench", unit="run",
               file=sys.stderr, disable=not progress_on())
    ref: list = []
    ra = ReadAhead(args.model) if read_aheads != [None] else None
    rows = []
    try:
        for kb in read_aheads:
            suffix = ""
            if ra is not None:
                in_force = ra.set(kb)
                suffix = f" @ read_ahead_kb {in_force}"
                if not ra.log[-1]["set"]:
                    print(f"hybrimoe bench: read_ahead_kb {kb}: could not set it ({ra.log[-1]['why']}); "
                          f"{in_force} in force", file=sys.stderr)
            for label, kw, gpu_bytes in modes:
                row = _measure_mode(args, label + suffix, kw, gpu_bytes, common, bar, ref)
                if ra is not None:
                    row.update(read_ahead_kb=ra.log[-1]["in_force_kb"], read_ahead_asked_kb=kb)
                rows.append(row)
    finally:
        bar.close()
        if ra is not None:
            ra.close()
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
    _write_outputs(args, dict(model=os.fspath(args.model), moe_cache=gpu_budget_spec(args),
                              moe_ram_cache=args.moe_ram_cache, budget_bytes=budget,
                              slot_bytes=facts.slot_bytes, n_slots=n_slots, device=device, stand_in=bool(server),
                              read_ahead=None if ra is None else {"found_kb": ra.original, "attempts": ra.log},
                              replay_trace=args.replay_trace, moe_profile=args.moe_profile,
                              flash_attn=args.flash_attn, rows=rows), rows)
    return 0 if all("error" not in r for r in rows) else 1


def format_table(rows: Sequence[dict], args) -> str:
    """llama-bench-style Markdown table (with ``--moe-ram-cache``, :func:`format_ram_table`'s)."""
    if getattr(args, "moe_ram_cache", None) is not None:
        return format_ram_table(rows, args)
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


def format_ram_table(rows: Sequence[dict], args) -> str:
    """The ``--moe-ram-cache`` table: tokens/s, disk bytes and major faults per token, the RAM tier's hit rate."""
    out = [f"| mode | pp{args.n_prompt} t/s | tg{args.n_gen} t/s | disk MiB/token pp, tg | major faults/token pp, tg | "
           "RAM hit rate (tg) | same tokens |", "|" + "---|" * 7]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['mode']} | error: {r['error']} | | | | | |")
            continue
        hr = f"{r['ram_hit_rate']:.3f}" if "ram_hit_rate" in r else "-"
        out.append(f"| {r['mode']} | {r['pp_tps']:.2f} ± {r['pp_tps_sd']:.2f} | "
                   f"{r['tg_tps']:.3f} ± {r['tg_tps_sd']:.3f} | "
                   f"{r['pp_disk_bytes_per_token'] / 2**20:.1f}, {r['tg_disk_bytes_per_token'] / 2**20:.1f} | "
                   f"{r['pp_major_faults_per_token']:.2f}, {r['tg_major_faults_per_token']:.2f} | {hr} | "
                   f"{r['same_tokens_as_first']}/{r['repetitions']} |")
    return "\n".join(out)


def _plot(rows: Sequence[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(ok) + 2))
    for ax, key, title in ((axes[0], "pp_tps", f"pp{args.n_prompt}"), (axes[1], "tg_tps", f"tg{args.n_gen}")):
        if ok and key.replace("_tps", "_median") in ok[0]:  # --cpu-only: medians, the bars span min..max
            k = key.replace("_tps", "")
            mid = [r[k + "_median"] for r in ok]
            err = [[m - r[k + "_min"] for m, r in zip(mid, ok)], [r[k + "_max"] - m for m, r in zip(mid, ok)]]
            ax.barh([r["mode"] for r in ok], mid, xerr=err)
        else:
            ax.barh([r["mode"] for r in ok], [r[key] for r in ok], xerr=[r[key + "_sd"] for r in ok])
        ax.set_xlabel("tokens/s")
        ax.set_title(title)
        ax.invert_yaxis()
    fig.tight_layout()
    savefig(fig, args.plot, dpi=120)
    plt.close(fig)
