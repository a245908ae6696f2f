"""One preset against another over the never-worse table's grid (simulation): is a candidate never slower?

For each trace of bench_never_worse.py (the shared DeepSeek-V2-Lite routing, and synthetic traces of the shapes of
Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 and gpt-oss-120b at low and high temporal locality), hardware preset,
cache size, stage and seed, on the first 2,000 tokens: tokens/s and hit rate of the candidate (default
``hybrimoe-reuse``) and of the base (default ``hybrimoe``, the MRS cache), their ratio, and a flag where the
candidate is more than 1% slower. A default preset changes only where no row is flagged. ``--halves`` adds the real
trace's even and odd prompts as two traces of their own (split by prompt, not by token: a candidate tuned on one
half is checked on the other). Prints a markdown table and a summary per stage; --json writes the rows.

    python3 bench/bench_preset_vs.py --seeds 0 --json reuse_vs_mrs.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench_never_worse import SHAPES, traces  # noqa: E402

from hybrimoe import policy as pol  # noqa: E402
from hybrimoe.sim.simulator import Setup  # noqa: E402


def prompt_half(tr, parity: int):
    """The trace's prompts of one parity (0: even, 1: odd) as a trace of their own (the other prompts left empty)."""
    prompt = np.repeat(np.arange(tr.n_prompts), np.diff(tr.prompt_offsets))
    return tr.select_tokens(prompt % 2 == parity)


def check_args(ap: argparse.ArgumentParser, args) -> None:
    """Every argument checked before the first run (ap.error: a usage message, exit 2), the trace resolved."""
    from hybrimoe.policy.budget import parse_budget
    from hybrimoe.traces.format import default_trace_path, load_trace
    from hybrimoe.traces.synthetic import SHAPES as KNOWN_SHAPES

    for name in (args.candidate, args.base):
        if name not in pol.SYSTEM_PRESETS:
            ap.error(f"unknown preset {name!r} (known: {', '.join(sorted(pol.SYSTEM_PRESETS))})")
    stages = args.stages.split(",")
    if not set(stages) <= {"decode", "prefill"} or "" in stages:
        ap.error(f"--stages {args.stages!r}: decode, prefill or both, comma-separated")
    for hw in args.hardware.split(","):
        try:
            pol.load_hardware(hw)
        except (ValueError, OSError) as e:
            ap.error(f"--hardware {hw!r}: {e}")
    for cache in args.caches.split(","):
        try:
            parse_budget(cache, 100.0, 0.0)  # the form only: sizes are checked per trace
        except ValueError as e:
            ap.error(f"--caches: {e}")
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        seeds = [-1]
    if min(seeds) < 0:
        ap.error(f"--seeds {args.seeds!r}: integers >= 0, comma-separated")
    args.shapes = ",".join(filter(None, args.shapes.split(",")))
    for shape in filter(None, args.shapes.split(",")):
        if shape not in KNOWN_SHAPES:
            ap.error(f"--shapes: unknown shape {shape!r} (known: {', '.join(KNOWN_SHAPES)})")
    if args.tokens < 1:
        ap.error(f"--tokens {args.tokens}: at least 1 token per run")
    if args.json:
        out = Path(args.json).resolve()
        if not out.parent.is_dir():
            ap.error(f"--json {args.json}: no folder {out.parent}")
        if out.exists() and not out.is_file():
            ap.error(f"--json {args.json}: not a file")
    if args.trace is None:
        # beside the checkout (or $HYBRIMOE_TRACE), wherever the bench is run from
        args.trace = str(default_trace_path(Path(__file__).resolve().parent))
    elif not Path(args.trace).is_file():
        ap.error(f"--trace {args.trace}: no such file")
    else:
        try:
            load_trace(args.trace)
        except (ValueError, OSError) as e:
            ap.error(f"--trace {args.trace}: {e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--candidate", default="hybrimoe-reuse", help="the preset tried (default %(default)s)")
    ap.add_argument("--base", default="hybrimoe", help="the preset it must not fall behind (default %(default)s)")
    ap.add_argument("--trace", default=None,
                    help="the real routing trace (default: $HYBRIMOE_TRACE, else ../shared/traces/dsv2lite_dev.npz "
                         "beside the checkout)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="synthetic shapes (default %(default)s)")
    ap.add_argument("--hardware", default="paper-a6000,rtx4090-desktop,h200", help="(default %(default)s)")
    ap.add_argument("--caches", default="10%,25%,50%,75%", help="(default %(default)s)")
    ap.add_argument("--stages", default="decode,prefill", help="(default %(default)s)")
    ap.add_argument("--seeds", default="0", help="seeds of the synthetic traces (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens simulated per run, >= 1 (default %(default)s)")
    ap.add_argument("--halves", action="store_true", help="add the real trace's even and odd prompts as traces")
    ap.add_argument("--json", default=None, help="write every row to this file")
    args = ap.parse_args(argv)
    check_args(ap, args)
    sources = list(traces(args))
    if args.halves:
        if sources and sources[0][0] == "dsv2lite-real":
            real = sources[0][1](0)
            sources[1:1] = [(f"dsv2lite-{n}", lambda seed, h=prompt_half(real, i): h)
                            for i, n in enumerate(("even", "odd"))]
        else:
            print("note: no real trace, so no prompt halves either (--halves)", file=sys.stderr)
    c, b = args.candidate, args.base
    print(f"| trace | seed | stage | hardware | cache | {b} t/s | {c} t/s | {c} / {b} | hit rate {b} | hit rate {c} | "
          "flags |")
    print("|" + "---|" * 11)
    rows = []
    for label, make in sources:
        for seed in (int(s) for s in args.seeds.split(",")):
            tr = make(seed)
            for stage in args.stages.split(","):
                for hw_name in args.hardware.split(","):
                    hw = pol.load_hardware(hw_name)
                    for cache in args.caches.split(","):
                        t0 = time.perf_counter()
                        try:
                            s = Setup(tr, hw, cache, stage, max_tokens=args.tokens, seed=seed + 1)
                        except ValueError as e:  # a budget this trace cannot take (below one of its experts)
                            ap.error(f"{label}, {hw_name}, cache {cache}: {e}")
                        rb, rc = s.run(b), s.run(c)
                        ratio = rc["tokens_per_s"] / rb["tokens_per_s"]
                        flags = ["slower"] if ratio < 0.99 else []
                        row = dict(trace=label, seed=seed, stage=stage, hardware=hw_name, cache=cache,
                                   base=rb["tokens_per_s"], candidate=rc["tokens_per_s"], ratio=ratio,
                                   hit_base=rb["hit_rate"], hit_candidate=rc["hit_rate"], flags=flags,
                                   seconds=time.perf_counter() - t0)
                        rows.append(row)
                        if args.json:  # after every run: an interrupted grid keeps what it ran
                            Path(args.json).write_text(json.dumps(rows, indent=1))
                        print(f"| {label} | {seed} | {stage} | {hw_name} | {cache} | {row['base']:.1f} | "
                              f"{row['candidate']:.1f} | {ratio:.3f} | {row['hit_base']:.3f} | "
                              f"{row['hit_candidate']:.3f} | {', '.join(flags)} |", flush=True)
    if not rows:
        print("no runs", file=sys.stderr)
        return 2
    bad = [r for r in rows if r["flags"]]
    print(f"\n{len(rows)} runs, {len(bad)} with {c} more than 1% slower than {b}")
    for stage in args.stages.split(","):
        ratios = sorted(r["ratio"] for r in rows if r["stage"] == stage)
        if ratios:
            print(f"{stage}: {len(ratios)} runs, {c} / {b} min {ratios[0]:.3f}, median "
                  f"{float(np.median(ratios)):.3f}, max {ratios[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
