"""The never-worse table (simulation): hybrimoe against the best static placement and the oracle bound.

For each trace (the shared DeepSeek-V2-Lite routing, and synthetic traces of the shapes of Mixtral-8x7B,
Qwen3-30B-A3B, DeepSeek-V3 and gpt-oss-120b at low and high temporal locality: hybrimoe.traces.synthetic), hardware
preset, cache size, stage and seed, on the first 2,000 tokens: tokens/s of hybrimoe, of each static placement
(ktransformers, hot-set, upstream-ncmoe) and of the oracle, hybrimoe / best static, and flags where hybrimoe is more
than 1% slower than the best static placement or the oracle is not the fastest. Prints a markdown table; --json
writes the rows. The synthetic traces' router scores are an assumption (hybrimoe.traces.synthetic).

    python3 bench/bench_never_worse.py --seeds 0 --json never_worse.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hybrimoe import policy as pol
from hybrimoe.sim.simulator import TS_NCMOE, Setup

SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b")


def traces(args):
    """(name, seed -> RoutingTrace) for the real trace (when present) and every synthetic shape x locality."""
    from hybrimoe.traces.synthetic import synthetic_trace
    from hybrimoe.traces.format import load_trace

    real = Path(args.trace)
    if real.exists():
        tr = load_trace(real)
        yield "dsv2lite-real", lambda seed: tr
    else:
        print(f"note: {real} not found: the real trace is left out", file=sys.stderr)
    for shape in filter(None, args.shapes.split(",")):
        for loc in ("low", "high"):
            yield f"{shape}-{loc}", (lambda seed, shape=shape, loc=loc:
                                     synthetic_trace(shape, args.tokens * 5 // 4 + 200, locality=loc, seed=seed))


def three_tier(args, static: list) -> int:
    """The three-tier rows (``--ram-caches``): a GPU cache of ``--caches``' first budget above a RAM tier of each
    ``--ram-caches`` budget, over ``--disk``. Every GPU preset (hybrimoe and the static placements) runs with every
    RAM preset users run today (mmap, a hot set, reads at the layer of use) and with hybrimoe's RAM tier; hybrimoe
    is its GPU cache over its RAM tier, inclusive (the engine today) and exclusive (``hybrimoe-exclusive``)."""
    from hybrimoe.sim.simulator import total_times

    ram_names = list(pol.RAM_BASELINES) + ["hybrimoe", "hybrimoe-exclusive"]
    ours = [("hybrimoe", "hybrimoe-exclusive"), ("hybrimoe", "hybrimoe")]
    gpu_cache = args.caches.split(",")[0]
    rows = []
    print(f"GPU cache {gpu_cache}, disk {args.disk}; seconds of the first {args.tokens} tokens per GPU preset / RAM "
          "preset; 'best other' is the fastest combination other than hybrimoe's own two; 'exclusive over best "
          "other' above 1: hybrimoe (exclusive) is faster; flagged: more than 1% slower")
    print("| trace | seed | stage | hardware | RAM | hybrimoe / hybrimoe-exclusive | hybrimoe / hybrimoe (inclusive) | "
          "best other | its time | upstream-ncmoe / mmap | exclusive over best other | flags |")
    print("|" + "---|" * 12)
    for label, make in traces(args):
        for seed in (int(x) for x in args.seeds.split(",")):
            tr = make(seed)
            for stage in args.stages.split(","):
                for hw_name in args.hardware.split(","):
                    for ram in args.ram_caches.split(","):
                        t = {}
                        for g in ["hybrimoe"] + static:
                            names = [n for n in ram_names if g == "hybrimoe" or n != "hybrimoe-exclusive"]
                            for r, sec in total_times(tr, hw_name, gpu_cache, stage, names, max_tokens=args.tokens,
                                                      seed=seed + 1, ram_cache=ram, disk=args.disk,
                                                      gpu_preset=g).items():
                                t[(g, r)] = sec
                        others = {k: v for k, v in t.items() if k not in ours}
                        best = min(others, key=others.get)
                        ratio = others[best] / t[ours[0]]
                        flags = ["slower than another combination"] if ratio < 1 / 1.01 else []
                        rows.append(dict(trace=label, seed=seed, stage=stage, hardware=hw_name, ram_cache=ram,
                                         gpu_cache=gpu_cache, seconds={f"{g}/{r}": v for (g, r), v in t.items()},
                                         best_other=f"{best[0]}/{best[1]}", ratio=ratio, flags=flags))
                        print(f"| {label} | {seed} | {stage} | {hw_name} | {ram} | {t[ours[0]]:.4g} | "
                              f"{t[ours[1]]:.4g} | {best[0]} / {best[1]} | {others[best]:.4g} | "
                              f"{t[('upstream-ncmoe', 'mmap')]:.4g} | "
                              f"{ratio:.3f} | {', '.join(flags)} |", flush=True)
    bad = [r for r in rows if r["flags"]]
    if rows:
        print(f"\n{len(rows)} rows, {len(bad)} flagged; hybrimoe (exclusive) over the best other combination: min "
              f"{min(r['ratio'] for r in rows):.3f}, median {sorted(r['ratio'] for r in rows)[len(rows) // 2]:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=None,
                    help="the real routing trace (.npz); given, it must exist (default: $HYBRIMOE_TRACE or "
                         "../shared/traces/dsv2lite_dev.npz, left out with a note when absent)")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="synthetic trace shapes, each at low and high locality (default %(default)s)")
    ap.add_argument("--hardware", default="paper-a6000,rtx4090-desktop,h200",
                    help="hardware presets (default %(default)s)")
    ap.add_argument("--caches", default="10%,25%,50%,75%",
                    help="GPU cache budgets; with --ram-caches the first only (default %(default)s)")
    ap.add_argument("--stages", default="decode,prefill", help="decode, prefill or both (default %(default)s)")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of the synthetic traces (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens simulated per run (default %(default)s)")
    ap.add_argument("--json", default=None, help="write every row to this file")
    ap.add_argument("--ram-caches", default=None,
                    help="three-tier rows instead: RAM budgets (e.g. 25%%,50%%,75%%) under the first --caches GPU "
                         "budget")
    ap.add_argument("--disk", default="pcie4-nvme", help="the disk under the RAM tier (with --ram-caches)")
    args = ap.parse_args()
    if args.trace is None:
        # beside the checkout (or $HYBRIMOE_TRACE), wherever the bench is run from
        from hybrimoe.traces.format import default_trace_path

        args.trace = str(default_trace_path(Path(__file__).resolve().parent))
    elif not Path(args.trace).is_file():
        print(f"--trace {args.trace}: no such file", file=sys.stderr)
        return 2
    static = list(pol.STATIC_PRESETS)
    if args.ram_caches:
        return three_tier(args, static)
    # on a host with several GPUs (a hardware file's gpu_count), upstream's layer split with the best --n-cpu-moe
    # joins the static placements (ktransformers and upstream-ncmoe then keep each GPU's leading or last layers
    # that fit: the -ot rules users write per GPU)
    multi = any(pol.load_hardware(h).facts.get("gpu_count", 1) > 1 for h in args.hardware.split(","))
    names = ["hybrimoe"] + static + ([TS_NCMOE] if multi else []) + ["oracle"]
    rows = []
    print("| trace | seed | stage | hardware | cache | " + " | ".join(names) + " | hybrimoe / best static | flags |")
    print("|" + "---|" * (len(names) + 7))
    for label, make in traces(args):
        for seed in (int(s) for s in args.seeds.split(",")):
            tr = make(seed)
            for stage in args.stages.split(","):
                for hw_name in args.hardware.split(","):
                    hw = pol.load_hardware(hw_name)
                    here = [n for n in names if n != TS_NCMOE or hw.facts.get("gpu_count", 1) > 1]
                    baselines = [n for n in here if n not in ("hybrimoe", "oracle")]
                    for cache in args.caches.split(","):
                        t0 = time.perf_counter()
                        s = Setup(tr, hw, cache, stage, max_tokens=args.tokens, seed=seed + 1)
                        tps = {n: s.run(n)["tokens_per_s"] for n in here}
                        best = max(tps[n] for n in baselines)
                        flags = []
                        if tps["hybrimoe"] * 1.01 < best:
                            flags.append("slower than static")
                        if tps["oracle"] < max(tps[n] for n in here[:-1]):
                            flags.append("oracle not a bound")
                        row = dict(trace=label, seed=seed, stage=stage, hardware=hw_name, cache=cache, tokens_per_s=tps,
                                   ratio=tps["hybrimoe"] / best, flags=flags, seconds=time.perf_counter() - t0)
                        rows.append(row)
                        print(f"| {label} | {seed} | {stage} | {hw_name} | {cache} | " +
                              " | ".join(f"{tps[n]:.1f}" if n in tps else "-" for n in names) +
                              f" | {row['ratio']:.3f} | "
                              f"{', '.join(flags)} |", flush=True)
    bad = [r for r in rows if r["flags"]]
    print(f"\n{len(rows)} runs, {len(bad)} flagged; hybrimoe / best static: min "
          f"{min(r['ratio'] for r in rows):.3f}, median {sorted(r['ratio'] for r in rows)[len(rows) // 2]:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
