"""The RAM tier's table (simulation): hybrimoe's RAM tier against the ways users run a model larger than RAM today.

For each trace (the shared DeepSeek-V2-Lite routing when present, synthetic traces of the shapes of Mixtral-8x7B,
Qwen3-30B-A3B, DeepSeek-V3, Kimi-K2 and gpt-oss-120b at low and high temporal locality), RAM budget (a share of the
routed experts' bytes), stage, on the first --tokens tokens, CPU only (an empty GPU cache: only the RAM tier
differs), one hardware file and one disk file: tokens/s of each RAM preset (hybrimoe, upstream's mmap, a static hot
set, ik_llama.cpp-style reads at the layer of use, the oracle bound), hybrimoe / best baseline, MB read from disk
per token and page faults per token of mmap. Prints a markdown table; --json writes the rows. The synthetic
traces' router scores are an assumption (hybrimoe.traces.synthetic); so is the disk model (docs/design.md §17).

    python3 bench/bench_ram_tier.py --json ram_tier.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybrimoe import policy as pol
from hybrimoe.sim.simulator import Setup

SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "kimi-k2", "gpt-oss-120b")


def traces(args):
    """(name, RoutingTrace) for the real trace (when present) and every synthetic shape x locality (seed 0)."""
    from hybrimoe.traces.format import load_trace
    from hybrimoe.traces.synthetic import synthetic_trace

    real = Path(args.trace)
    if real.exists():
        yield "dsv2lite-real", load_trace(real)
    else:
        print(f"note: {real} not found: the real trace is left out", file=sys.stderr)
    for shape in (s for s in args.shapes.split(",") if s):
        for loc in ("low", "high"):
            yield f"{shape}-{loc}", synthetic_trace(shape, args.tokens * 5 // 4 + 200, locality=loc, seed=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from hybrimoe.traces.format import default_trace_path

    # beside the checkout (or $HYBRIMOE_TRACE), wherever the bench is run from
    ap.add_argument("--trace", default=str(default_trace_path(Path(__file__).resolve().parent)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--hardware", default="rtx4090-desktop")
    ap.add_argument("--disk", default="pcie4-nvme")
    ap.add_argument("--ram", default="25%,50%,75%", help="RAM budgets for routed experts")
    ap.add_argument("--stages", default="decode,prefill")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    hw = pol.load_hardware(args.hardware)
    names = ["hybrimoe", *pol.RAM_BASELINES, "oracle"]
    print(f"CPU only, {hw.name}, disk {args.disk}; tokens/s per RAM preset")
    print("| trace | stage | RAM | " + " | ".join(names) + " | hybrimoe / best baseline | MB disk/token (hybrimoe, "
          "mmap) | faults/token (mmap) |")
    print("|" + "---|" * (len(names) + 6))
    rows = []
    for label, tr in traces(args):
        for stage in args.stages.split(","):
            for ram in args.ram.split(","):
                s = Setup(tr, hw, "0", stage, max_tokens=args.tokens, seed=1, ram_cache=ram, disk=args.disk)
                recs = {n: s.run("hybrimoe", ram=n) for n in names}
                tps = {n: r["tokens_per_s"] for n, r in recs.items()}
                ratio = tps["hybrimoe"] / max(tps[n] for n in pol.RAM_BASELINES)
                rows.append(dict(trace=label, stage=stage, ram=ram, tokens_per_s=tps, ratio=ratio,
                                 bytes_disk_per_token={n: r["bytes_disk_per_token"] for n, r in recs.items()},
                                 page_faults_per_token=recs["mmap"]["page_faults_per_token"]))
                print(f"| {label} | {stage} | {ram} | " + " | ".join(f"{tps[n]:.3g}" for n in names) +
                      f" | {ratio:.2f}x | {recs['hybrimoe']['bytes_disk_per_token'] / 1e6:.0f}, "
                      f"{recs['mmap']['bytes_disk_per_token'] / 1e6:.0f} | "
                      f"{recs['mmap']['page_faults_per_token']:.0f} |", flush=True)
    if rows:
        worst = min(rows, key=lambda r: r["ratio"])
        print(f"\nworst hybrimoe / best baseline: {worst['ratio']:.3f} ({worst['trace']} {worst['stage']} "
              f"RAM {worst['ram']}); median {sorted(r['ratio'] for r in rows)[len(rows) // 2]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
