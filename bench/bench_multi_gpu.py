"""Several GPUs (simulation): big MoE models on 2x and 4x RTX 3090 with 128 GB of DDR4, hybrimoe against the
placements users run today at the same VRAM per GPU.

For Qwen3-235B-A22B-, GLM-4.5-Air- and DeepSeek-V3-shaped synthetic traces (hybrimoe.traces.synthetic; low and high
temporal locality, seed 0), hardware files 2x-rtx3090 and 4x-rtx3090 (each GPU on its own link), a GPU budget per GPU
for the routed experts (--gpu-cache, default 18 GB: 24 GB less the layers' other weights, the KV cache and compute
buffers, an assumption) and both stages: tokens/s of

- hybrimoe: a cache per GPU, each layer's GPU share on its own GPU (docs/design.md §19);
- upstream-ts-ncmoe: llama.cpp's layer split with the best --n-cpu-moe N (every MoE layer from N on, on its GPU);
- upstream-ncmoe and ktransformers: each GPU's last, or leading, MoE layers that fit (the per-GPU -ot rules users
  write);
- hot-set: each GPU's most frequently routed experts of a profile.

A model whose routed experts do not fit in --ram (default 100 GB of the 128: the rest for the system, the other
weights and the page cache; an assumption) runs over a RAM tier on a PCIe 4.0 NVMe disk (--disk): hybrimoe with its
own RAM tier, inclusive (the default) and exclusive (``--moe-ram-exclusive``: an expert on a GPU gives up its RAM
slot, so the tiers add up), the others over upstream's mmap; "hybrimoe / best other" takes the better of hybrimoe's
two. Prints a markdown table; --json writes the rows.

    python3 bench/bench_multi_gpu.py --json multi_gpu.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hybrimoe import policy as pol
from hybrimoe.sim.simulator import TS_NCMOE, Setup
from hybrimoe.traces.synthetic import synthetic_trace

SHAPES = ("qwen3-235b-a22b", "glm-4.5-air", "deepseek-v3")
BASELINES = (TS_NCMOE, "upstream-ncmoe", "ktransformers", "hot-set")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="model shapes (default %(default)s)")
    ap.add_argument("--hardware", default="2x-rtx3090,4x-rtx3090", help="hardware files (default %(default)s)")
    ap.add_argument("--gpu-cache", default="18GB", help="routed-expert budget per GPU (default %(default)s)")
    ap.add_argument("--ram", default="100GB", help="host RAM for routed experts (default %(default)s)")
    ap.add_argument("--disk", default="pcie4-nvme", help="the disk under a RAM tier (default %(default)s)")
    ap.add_argument("--stages", default="decode,prefill", help="decode, prefill or both (default %(default)s)")
    ap.add_argument("--localities", default="low,high", help="synthetic trace localities (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=1000, help="tokens simulated per run (default %(default)s)")
    ap.add_argument("--json", default=None, help="write every row to this file")
    args = ap.parse_args()
    names = ["hybrimoe", "hybrimoe-exclusive"] + list(BASELINES)
    ram_bytes = pol.parse_budget(args.ram, 1.0, 0.0)
    print(f"GPU budget {args.gpu_cache} per GPU for routed experts; host RAM for them {args.ram}; disk {args.disk} "
          "(only where the experts do not fit in RAM); tokens/s")
    print("| shape | locality | stage | hardware | experts GB | tier below | " + " | ".join(names) +
          " | hybrimoe / best other | flags |")
    print("|" + "---|" * (len(names) + 8))
    rows = []
    for shape in args.shapes.split(","):
        for loc in args.localities.split(","):
            tr = synthetic_trace(shape, args.tokens * 5 // 4 + 200, locality=loc, seed=0)
            total = float(sum(tr.expert_bytes) * tr.num_experts)
            big = total > ram_bytes
            for stage in args.stages.split(","):
                for hw_name in args.hardware.split(","):
                    t0 = time.perf_counter()
                    hw = pol.load_hardware(hw_name)
                    s = Setup(tr, hw, args.gpu_cache, stage, max_tokens=args.tokens, seed=1,
                              ram_cache=args.ram if big else None, disk=args.disk if big else None)
                    tps = {}
                    for n in names:
                        if n == "hybrimoe-exclusive":
                            if big:
                                tps[n] = s.run("hybrimoe", ram="hybrimoe-exclusive")["tokens_per_s"]
                        elif big:
                            tps[n] = s.run(n, ram="hybrimoe" if n == "hybrimoe" else "mmap")["tokens_per_s"]
                        else:
                            tps[n] = s.run(n)["tokens_per_s"]
                    best = max(tps[n] for n in BASELINES)
                    ratio = max(tps["hybrimoe"], tps.get("hybrimoe-exclusive", 0.0)) / best
                    flags = ["slower than another placement"] if ratio < 1 / 1.01 else []
                    below = f"RAM {args.ram} + {args.disk}" if big else "all in RAM"
                    rows.append(dict(shape=shape, locality=loc, stage=stage, hardware=hw_name,
                                     gpu_cache_per_gpu=args.gpu_cache, expert_gb=total / 1e9, tier_below=below,
                                     tokens_per_s=tps, ratio=ratio, flags=flags,
                                     seconds=time.perf_counter() - t0))
                    print(f"| {shape} | {loc} | {stage} | {hw_name} | {total / 1e9:.0f} | {below} | " +
                          " | ".join(f"{tps[n]:.2f}" if n in tps else "-" for n in names) +
                          f" | {ratio:.3f} | {', '.join(flags)} |",
                          flush=True)
    if rows:
        print(f"\n{len(rows)} rows, {sum(1 for r in rows if r['flags'])} flagged; hybrimoe / best other: min "
              f"{min(r['ratio'] for r in rows):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
