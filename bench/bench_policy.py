"""Decision-time benchmark of the HybriMoE policy core.

Measures, per MoE layer, the HybriMoE split (HybriMoE §IV.B) plus the MRS cache update (§IV.D: observe, look up,
pin, admit the copies and every CPU-computed miss, unpin) for
  - decode: 64 experts, top-6, one token (target < 5 us),
  - prefill: one 512-token ubatch over 160 experts, top-6 (target < 50 us),
and, separately, impact-driven prefetch planning over the next 3 layers (§IV.C).

Wall-clock: the C++ executable ``bench_policy`` (CMake option HYBRIMOE_BENCH, built here into build/bench).
Instructions: the same executable under ``valgrind --tool=callgrind`` at two iteration counts; the difference
divided by the extra iterations removes set-up cost. Usage::

    python3 bench/bench_policy.py [--callgrind] [--build-dir build/bench] [--cache reuse] [--decode-experts 64,256]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {"decode": (200_000, 5.0), "prefill": (4_000, 50.0), "prefetch": (50_000, None)}


def build(build_dir: Path) -> Path:
    """Configures and builds the bench_policy target; returns the executable path."""
    import pybind11

    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja", "-DHYBRIMOE_ENGINE=OFF",
                    "-DHYBRIMOE_BENCH=ON", "-DCMAKE_BUILD_TYPE=Release", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "bench_policy"], check=True,
                   stdout=subprocess.DEVNULL)
    exe = build_dir / "bench" / "bench_policy"
    if not exe.is_file():
        raise FileNotFoundError(f"bench_policy was not built at {exe}")
    return exe


def wall_clock(exe: Path, mode: str, iters: int, extra: tuple = ()) -> float:
    """Nanoseconds per layer decision (best of 3 runs); ``extra``: the cache policy and experts per layer."""
    best = float("inf")
    for _ in range(3):
        out = subprocess.run([str(exe), mode, str(iters), *extra], check=True, capture_output=True, text=True).stdout
        best = min(best, float(out.split()[2]))
    return best


def instructions(exe: Path, mode: str, iters: int, extra: tuple = ()) -> float:
    """Instructions per layer decision: callgrind at iters and 2*iters, difference / iters."""
    counts = []
    for n in (iters, 2 * iters):
        r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", str(exe), mode,
                            str(n), *extra], capture_output=True, text=True, check=True)
        m = re.search(r"Collected\s*:\s*(\d+)", r.stderr)
        if not m:
            raise RuntimeError(f"no instruction count in callgrind output:\n{r.stderr[-2000:]}")
        counts.append(int(m.group(1)))
    return (counts[1] - counts[0]) / iters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=str(ROOT / "build" / "bench"))
    ap.add_argument("--callgrind", action="store_true", help="also count instructions with callgrind")
    ap.add_argument("--cache", default="mrs",
                    help="the cache policy of the split + update rows (hybrimoe._core.make_cache_policy's names: mrs, "
                         "reuse, lru, lfu; default %(default)s)")
    ap.add_argument("--decode-experts", default="64",
                    help="routed experts per layer of the decode rows, comma-separated (default %(default)s; the "
                         "target applies at 64)")
    args = ap.parse_args(argv)
    exe = build(Path(args.build_dir))
    print("| decision (per MoE layer) | wall-clock us | target us | instructions |")
    print("|---|---|---|---|")
    rows = [(m, None) for m in MODES if m != "decode"]
    rows[0:0] = [("decode", int(e)) for e in args.decode_experts.split(",")]
    cache = args.cache.upper() if args.cache == "mrs" else args.cache
    for mode, experts in rows:
        iters, target = MODES[mode]
        extra = (args.cache,) + ((str(experts),) if experts is not None else ())
        us = wall_clock(exe, mode, iters, extra) / 1e3
        ir = f"{instructions(exe, mode, max(1, iters // 50), extra):.0f}" if args.callgrind else "-"
        label = {"decode": f"decode split + {cache} update ({experts} experts, top-6)",
                 "prefill": f"prefill split + {cache} update (512 tokens, 160 experts, top-6)",
                 "prefetch": "impact prefetch plan, D=3 (decode)"}[mode]
        print(f"| {label} | {us:.2f} | {target if target and experts in (None, 64) else '-'} | {ir} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
