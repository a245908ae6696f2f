"""Speculative decoding plus the expert cache, simulated: decode tokens/s with K drafted tokens verified per step
(hybrimoe.sim.speculative) against plain decode, for hybrimoe and the static placements users run, on the
DeepSeek-V2-Lite development trace (when present) and synthetic traces of the large shapes, per hardware preset.

Each row: one trace, hardware preset and acceptance rate; the columns give tokens/s (tokens emitted per second) of
each preset with and without drafting, and hybrimoe's speed-up over the fastest static placement in each case.
The drafter's own time is not counted unless ``--draft-cost-ms`` says what a drafted token costs.

    python3 bench/bench_speculative.py --draft 3 --acceptance 0.5,0.7,0.9
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hybrimoe.policy.hardware import load_hardware
from hybrimoe.sim.simulator import Setup
from hybrimoe.traces.format import default_trace_path, load_trace
from hybrimoe.traces.synthetic import synthetic_trace

PRESETS = ("hybrimoe", "upstream-ncmoe", "hot-set")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(default_trace_path()), help="the real trace (default %(default)s)")
    ap.add_argument("--shapes", default="deepseek-v3,qwen3-30b-a3b,mixtral-8x7b",
                    help="synthetic shapes, high locality (default %(default)s)")
    ap.add_argument("--hardware", default="paper-a6000,rtx4090-desktop,h200")
    ap.add_argument("--cache", default="25%", help="GPU expert cache (default %(default)s)")
    ap.add_argument("--draft", type=int, default=3, help="drafted tokens per step (default %(default)s)")
    ap.add_argument("--acceptance", default="0.5,0.7,0.9", help="acceptance rates (default %(default)s)")
    ap.add_argument("--draft-cost-ms", type=float, default=0.0, help="the drafter's ms per drafted token")
    ap.add_argument("--tokens", type=int, default=2000, help="decode tokens (rows verified) per run")
    args = ap.parse_args(argv)
    if args.draft < 1 or args.tokens < 1 or args.draft_cost_ms < 0:
        ap.error("--draft and --tokens must be >= 1, --draft-cost-ms >= 0")
    traces = []
    if Path(args.trace).exists():
        traces.append(("dsv2lite-real", load_trace(args.trace)))
    else:
        print(f"note: {args.trace} not found: the real trace is left out", file=sys.stderr)
    for shape in (s for s in args.shapes.split(",") if s):
        traces.append((f"{shape}-high", synthetic_trace(shape, args.tokens * 5 // 4 + 200, locality="high", seed=0)))
    accs = [float(a) for a in args.acceptance.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f}; GPU cache {args.cache}; draft {args.draft}; drafter "
          f"{args.draft_cost_ms:g} ms per drafted token; tokens/s of tokens emitted, first {args.tokens} decode rows")
    cols = " | ".join(f"{p} plain | {p} drafted" for p in PRESETS)
    print(f"| trace | hardware | acceptance | tokens per step | {cols} | hybrimoe over best static, plain | "
          "drafted | drafting's gain for hybrimoe |")
    print("|" + "---|" * (5 + 2 * len(PRESETS) + 2))
    for label, tr in traces:
        for hw_name in args.hardware.split(","):
            hw = load_hardware(hw_name)
            plain_setup = Setup(tr, hw, args.cache, "decode", max_tokens=args.tokens)
            plain = {p: plain_setup.run(p)["tokens_per_s"] for p in PRESETS}
            for a in accs:
                s = Setup(tr, hw, args.cache, "decode", max_tokens=args.tokens, draft=args.draft, acceptance=a,
                          draft_cost_s=args.draft_cost_ms / 1e3)
                recs = {p: s.run(p) for p in PRESETS}
                drafted = {p: r["tokens_per_s"] for p, r in recs.items()}
                best_plain = max(v for p, v in plain.items() if p != "hybrimoe")
                best_drafted = max(v for p, v in drafted.items() if p != "hybrimoe")
                cells = " | ".join(f"{plain[p]:.2f} | {drafted[p]:.2f}" for p in PRESETS)
                print(f"| {label} | {hw_name} | {a:g} | {recs['hybrimoe']['tokens_per_step']:.2f} | {cells} | "
                      f"{plain['hybrimoe'] / best_plain:.2f}x | {drafted['hybrimoe'] / best_drafted:.2f}x | "
                      f"{drafted['hybrimoe'] / plain['hybrimoe']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
