"""The CPU share's kernels against upstream llama.cpp as users run it, on full-width synthetic MoE models in RAM.

Question: in hybrid decode the CPU computes most activated experts, so its kernels set the pace. Is hybrimoe's CPU
share at least as fast as upstream's default CPU path (CPU weights repacked where ggml-cpu has kernels for them:
ggml-cpu/repack.cpp), and how do both compare with ik_llama.cpp, the fork users pick for CPU-heavy MoE?

Models (``hybrimoe.tiny.make_synthetic_model``, random weights written as valid quantized blocks, ``--layers``
blocks, cached under ``$HYBRIMOE_CACHE_DIR/bench-models`` or ``~/.cache/hybrimoe/bench-models``): the shapes of
DeepSeek-V2-Lite, Qwen3-30B-A3B and gpt-oss-20b, each in the quant types ``--quants`` names for it (default
Q4_K_M and Q4_0 for the first two; Q4_0 and MXFP4 for gpt-oss, whose 2880-wide rows take no K-quant).

Modes, all loaded at once and run interleaved (``hybrimoe.runtime.benchmark.interleaved_runs``: per repetition
every mode in a rotating order, one prompt of ``-p`` tokens in one ubatch (pp), then ``-n`` greedy tokens (tg);
the load average is read before each run), CPU only, ``-t`` threads:

- ``upstream (default: repacked)``: llama.cpp with its default CPU buffers (the baseline);
- ``upstream --no-repack``: the file's layout (an exactness oracle, not a speed baseline);
- ``hybrimoe CPU share, --no-repack`` and ``hybrimoe CPU share (repacked)``: the engine with every routed expert in
  its CPU share (``moe_cache=0``); ``hybrimoe fused CPU share`` the same as one op per layer (``moe_cpu_fused``,
  upstream's numbers) and ``hybrimoe fused, fast`` with every repacked gemm kernel (not bit for bit);
- with ``--ik-bench PATH`` (ik_llama.cpp's llama-bench, built CPU-only outside this repository): ``ik_llama.cpp``
  with ``-fmoe 0 -rtr 0`` and ``-fmoe 1 -rtr 1`` (fused MoE, run-time repacking), one ``-r 1`` run per turn; its
  pp and tg are llama-bench's own (random prompt tokens, a fresh context per test, flash attention on by its
  default); ``--ik-lib-path`` is put on ``LD_LIBRARY_PATH`` for it (a patched libllama, say).

Printed per model: per mode the median and range over the repetitions of pp and tg tokens/s, each median against
upstream's default, the load average before the runs, and whether the greedy tokens equal upstream's default.

Usage::

    python3 bench/bench_cpu_kernels.py [--shapes deepseek-v2-lite,qwen3-30b-a3b,gpt-oss-20b] [--layers 8]
        [-p 512] [-n 64] [-r 3] [-t 2] [--ik-bench PATH] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import hybrimoe  # noqa: F401  (the installed package, before anything loads llama_cpp: one libllama per process)

DEFAULT_QUANTS = {"deepseek-v2-lite": ("Q4_K_M", "Q4_0"), "qwen3-30b-a3b": ("Q4_K_M", "Q4_0"),
                  "gpt-oss-20b": ("Q4_0", "MXFP4")}


def model_path(shape: str, quant: str, layers: int) -> Path:
    """The synthetic model of ``shape`` in ``quant`` with ``layers`` blocks, written once into the cache."""
    from hybrimoe.tiny import make_synthetic_model

    root = Path(os.environ.get("HYBRIMOE_CACHE_DIR") or Path.home() / ".cache" / "hybrimoe") / "bench-models"
    path = root / f"{shape}-{quant}-{layers}L.gguf"
    if not path.exists():
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        make_synthetic_model(path, shape=shape, quant=quant, n_layer=layers)
    return path


def ik_runner(binary: str, lib_path: str | None, model: Path, fmoe: int, rtr: int, n_prompt: int, n_gen: int,
              threads: int):
    """A ``run()`` for ``interleaved_runs``' external modes: one llama-bench run (``-r 1``) of ik_llama.cpp on
    ``model``, returning (pp tokens/s, tg tokens/s). Raises RuntimeError with its output when it fails."""
    env = dict(os.environ)
    if lib_path:
        env["LD_LIBRARY_PATH"] = lib_path + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    cmd = [binary, "-m", str(model), "-p", str(n_prompt), "-n", str(n_gen), "-t", str(threads), "-r", "1",
           "-fmoe", str(fmoe), "-rtr", str(rtr), "-o", "json"]

    def run() -> tuple[float, float]:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {(p.stderr or p.stdout)[-400:]}")
        recs = json.loads(p.stdout)
        pp = next(r["avg_ts"] for r in recs if r.get("n_prompt") == n_prompt and r.get("n_gen") == 0)
        tg = next(r["avg_ts"] for r in recs if r.get("n_gen") == n_gen and r.get("n_prompt") == 0)
        return float(pp), float(tg)

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(DEFAULT_QUANTS))
    ap.add_argument("--quants", default=None,
                    help="quant types for every shape (default per shape: " +
                         "; ".join(f"{s} {','.join(q)}" for s, q in DEFAULT_QUANTS.items()) + ")")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--modes", default=None, help="comma-separated subset of the hybrimoe/upstream mode labels")
    ap.add_argument("--ik-bench", default=None, help="ik_llama.cpp's llama-bench binary (CPU build)")
    ap.add_argument("--ik-lib-path", default=None, help="LD_LIBRARY_PATH for --ik-bench")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from hybrimoe.runtime.benchmark import CPU_MODES, cpu_table, interleaved_runs

    modes = [m for m in CPU_MODES if args.modes is None or m[0] in args.modes.split(",")]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.2f} at start", flush=True)
    results = []
    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        quants = args.quants.split(",") if args.quants else DEFAULT_QUANTS[shape]
        for quant in quants:
            path = model_path(shape, quant, args.layers)
            ext = []
            if args.ik_bench:
                for fmoe, rtr in ((0, 0), (1, 1)):
                    ext.append((f"ik_llama.cpp -fmoe {fmoe} -rtr {rtr}",
                                ik_runner(args.ik_bench, args.ik_lib_path, path, fmoe, rtr, args.n_prompt,
                                          args.n_gen, args.threads)))
            rows = interleaved_runs(path, modes, args.reps, args.n_prompt, args.n_gen, args.threads, external=ext)
            print(f"\n## {shape} {quant}, {args.layers} blocks ({path.stat().st_size / 2**30:.2f} GiB)\n")
            print(cpu_table(rows, args.n_prompt, args.n_gen), flush=True)
            results.append(dict(shape=shape, quant=quant, layers=args.layers, path=str(path), rows=rows))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(n_prompt=args.n_prompt, n_gen=args.n_gen, reps=args.reps,
                                                   threads=args.threads, results=results), indent=1))
    return 0 if all("error" not in r for res in results for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
