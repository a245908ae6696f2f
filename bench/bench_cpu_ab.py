"""Two builds of hybrimoe's CPU path against each other, each beside upstream's default, in alternating processes.

Question: what does a change to the CPU kernels (hybrimoe's ggml-cpu or the engine's fused op) give, measured where
it runs: pp (one prompt of ``-p`` tokens in one ubatch) and tg (``-n`` greedy tokens) of a full-width synthetic model
in RAM, CPU only. The installed build is "new"; ``--other PATH`` is put first on ``PYTHONPATH`` for the "old" runs: a
copy of the ``hybrimoe`` package from another build (for a ggml-cpu change, the installed package with
``lib/libggml-cpu.so.0`` replaced by the other build's). Each repetition runs one process per build, their order
alternating (new, old; then old, new; ...), and each process measures upstream's default (repacked CPU weights: the
baseline) and the fused CPU share (``moe_cache=0, moe_cpu_fused=True``) interleaved
(``hybrimoe.runtime.benchmark.interleaved_runs``, one repetition each, the load average before each run).

Printed: per model, build and mode the median (min..max) of pp and tg tokens/s over the repetitions.

Usage::

    python3 bench/bench_cpu_ab.py --other /tmp/old_build ~/.cache/hybrimoe/bench-models/deepseek-v2-lite-Q4_K_M-8L.gguf
        [-r 3] [-p 512] [-n 64] [-t 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MODES = (("upstream (default: repacked)", dict(n_gpu_layers=0)),
         ("hybrimoe fused CPU share", dict(n_gpu_layers=0, moe_cache=0, moe_cpu_fused=True)))


def one_process(path: str, n_prompt: int, n_gen: int, threads: int) -> None:
    """The child: one repetition of every mode, printed as one JSON line {mode: [pp, tg, load average]}."""
    from hybrimoe.runtime.benchmark import interleaved_runs

    rows = interleaved_runs(path, MODES, 1, n_prompt, n_gen, threads)
    bad = [r for r in rows if "error" in r]
    if bad:
        raise SystemExit(f"a mode failed: {bad}")
    print(json.dumps({r["mode"]: [r["pp_tps"][0], r["tg_tps"][0], r["loadavg"][0]] for r in rows}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="GGUF files (e.g. bench_cpu_kernels.py's synthetic models)")
    ap.add_argument("--other", help="required: the other build's package folder, put first on PYTHONPATH for the old "
                    "runs")
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions per build (default 3)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens, one ubatch (default 512)")
    ap.add_argument("-n", "--n-gen", type=int, default=64, help="greedy tokens generated (default 64)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        one_process(args.models[0], args.n_prompt, args.n_gen, args.threads)
        return 0
    if not args.other or not Path(args.other, "hybrimoe").is_dir():
        ap.error("--other must be a folder holding another build's hybrimoe package")
    # the children run in the home folder: absolute paths
    args.other = str(Path(args.other).resolve())
    args.models = [str(Path(m).resolve()) for m in args.models]
    if min(args.reps, args.n_prompt, args.n_gen, args.threads) < 1:
        ap.error("-r, -p, -n and -t must be at least 1")
    missing = [m for m in args.models if not Path(m).is_file()]
    if missing:
        ap.error(f"no such model file: {', '.join(missing)}")
    failed = 0
    print(f"# load average {os.getloadavg()[0]:.2f} at start; {args.threads} threads; pp{args.n_prompt}, "
          f"tg{args.n_gen}; {args.reps} repetitions")
    results: dict = {}
    for model in args.models:
        for rep in range(args.reps):
            for build in (("new", "old") if rep % 2 == 0 else ("old", "new")):
                env = dict(os.environ)
                if build == "old":
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.other, env.get("PYTHONPATH")]))
                cmd = [sys.executable, __file__, "--child", model, "-p", str(args.n_prompt), "-n", str(args.n_gen),
                       "-t", str(args.threads)]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path.home())
                lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
                if out.returncode != 0 or not lines:
                    print(f"{Path(model).name} {build} rep {rep}: failed\n{out.stderr[-2000:]}")
                    failed += 1
                    continue
                for mode, v in json.loads(lines[-1]).items():
                    results.setdefault((Path(model).name, build, mode), []).append(v)
                print(f"{Path(model).name} rep {rep} {build}: {lines[-1]}", flush=True)
    print("\n| model | build | mode | pp t/s | tg t/s | load avg |\n|---|---|---|---|---|---|")
    for (model, build, mode), v in sorted(results.items()):
        pp, tg, la = ([x[i] for x in v] for i in range(3))
        print(f"| {model} | {build} | {mode} | {statistics.median(pp):.1f} ({min(pp):.1f}..{max(pp):.1f}) | "
              f"{statistics.median(tg):.2f} ({min(tg):.2f}..{max(tg):.2f}) | {min(la):.2f}..{max(la):.2f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
