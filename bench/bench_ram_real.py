"""The RAM tier on this machine, for real: a model larger than RAM, upstream llama.cpp's mmap against hybrimoe's RAM
tier at the same memory, CPU only.

Model: a synthetic DeepSeek-V2-Lite-shaped GGUF (``hybrimoe.tiny.make_synthetic_model``: Q4_K_M types, random
weights) with enough layers to be ``--size-factor`` x this machine's RAM on disk (MemTotal; 1.5 by default), written
once to ``$HYBRIMOE_CACHE_DIR/models``. Routing: replayed (``moe_replay``) from a synthetic trace of the model's own
shape (``hybrimoe.traces.synthetic.synthetic_trace``, ``--locality``), so both sides route alike whatever the random
router says; the text is meaningless.

Same memory: every run is a child process in a memory cgroup of its own (cgroup v1 or v2, made under this process's
one) whose limit (``--limit``) covers everything the process holds, page cache included: upstream's mmap keeps in the
page cache what fits under it; hybrimoe gets ``moe_ram_cache="auto"`` (what the cgroup has left after the load, less
the other weights and a margin: ``hybrimoe.runtime.ram_tier.auto_ram_slots``) or ``--budget``. Before each run the
file is dropped from the page cache (fsync, POSIX_FADV_DONTNEED).

Per run: prefill tokens/s (one ``--pp``-token prompt, ubatch 512) and decode tokens/s (``--tg`` tokens after it),
bytes read from the disk per token (``/proc/self/io`` read_bytes: what reached the block device, read-ahead
included) and major page faults per token (getrusage), the read bandwidth that gives, and for hybrimoe the RAM
tier's counters. Modes: upstream (mmap, ``--no-repack``), hybrimoe (MRS, prefetch by the router look-ahead),
hybrimoe without prefetch, hybrimoe with LRU. Prints a markdown table; ``--json`` writes the rows.

    python3 bench/bench_ram_real.py --json ram_real.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = {
    "upstream-mmap": {},
    "hybrimoe": {"moe_ram_cache": "auto"},
    "hybrimoe-no-prefetch": {"moe_ram_cache": "auto", "moe_prefetch_layers": 0},
    "hybrimoe-lru": {"moe_ram_cache": "auto", "moe_ram_policy": "lru"},
}


def model_path(size_factor: float) -> Path:
    """The benchmark model (written when absent): DeepSeek-V2-Lite's shape with as many layers as make it
    ``size_factor`` x MemTotal."""
    from hybrimoe.runtime.ram_tier import machine_memory
    from hybrimoe.tiny.synthetic import make_synthetic_model

    total = machine_memory()["total"]
    # one MoE layer of this shape is 384.6 MB on disk (364 MB of experts), the rest about 190 MB: a layer is added
    # so the file is not under the factor
    n_layer = int((size_factor * total - 190e6) / 384e6) + 2
    root = Path(os.environ.get("HYBRIMOE_CACHE_DIR", Path.home() / ".cache" / "hybrimoe")) / "models"
    # one written before with at least as many layers does (tens of GB: not written twice)
    for old in sorted(root.glob("ram-bench-*.gguf")):
        if old.stat().st_size >= size_factor * total:
            return old
    path = root / f"ram-bench-{n_layer}.gguf"
    if not path.exists():
        print(f"writing {path} ({n_layer} layers)...", file=sys.stderr)
        make_synthetic_model(path, n_layer=n_layer)
    return path


class MemoryCgroup:
    """A memory cgroup under this process's own (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``) with a limit
    in bytes; ``enter()`` moves the calling process into it (a child's preexec_fn)."""

    def __init__(self, limit: int):
        rel_v1 = rel_v2 = None
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hier, ctrls, rel = line.split(":", 2)
            if hier == "0":
                rel_v2 = rel
            elif "memory" in ctrls.split(","):
                rel_v1 = rel
        if rel_v1 is not None and Path(f"/sys/fs/cgroup/memory{rel_v1}").is_dir():
            self.dir, knob = Path(f"/sys/fs/cgroup/memory{rel_v1}") / f"hybrimoe-bench-{os.getpid()}", \
                "memory.limit_in_bytes"
        elif rel_v2 is not None:
            # v2: the limit file exists only where the parent enables the memory controller for its children
            self.dir, knob = Path(f"/sys/fs/cgroup{rel_v2}") / f"hybrimoe-bench-{os.getpid()}", "memory.max"
        else:
            raise OSError("no memory cgroup to make a child of")
        self.dir.mkdir()
        try:
            (self.dir / knob).write_text(str(limit))
        except OSError:
            self.close()  # no limit could be set: leave no empty cgroup behind
            raise
        self.limit = limit

    def enter(self) -> None:
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        try:
            self.dir.rmdir()
        except OSError:
            pass


def child(args) -> dict:
    """One mode in this (cgroup-limited) process: the figures as a dict."""
    import numpy as np

    from hybrimoe import Llama
    from hybrimoe.model.facts import facts_from_gguf
    from hybrimoe.runtime.disk_calibration import drop_from_page_cache
    from hybrimoe.runtime.benchmark import io_counters
    from hybrimoe.runtime.ram_tier import machine_memory
    from hybrimoe.traces.routing_replay import routing_replay_table
    from hybrimoe.traces.synthetic import synthetic_trace

    kw = json.loads(args.child_kw)
    tr = synthetic_trace(facts_from_gguf(args.model), args.pp + args.tg + 8, locality=args.locality, seed=0,
                         scores=False, n_prompts=1)
    table = routing_replay_table(tr, args.model)
    del tr
    drop_from_page_cache(args.model)
    t_load = time.perf_counter()
    llm = Llama(str(args.model), n_ctx=args.pp + args.tg + 16, n_batch=512, n_ubatch=512, n_threads=args.threads,
                n_threads_batch=args.threads, n_gpu_layers=0, verbose=False, no_repack=True, moe_replay=table,
                **({"moe_cost_model": "rtx4090-desktop"} if kw else {}), **kw)
    load_s = time.perf_counter() - t_load
    mem = machine_memory()
    row = {"load_s": load_s, "cgroup_total": mem["total"], "memory_source": mem["source"]}
    toks = list(np.random.default_rng(0).integers(5, 500, size=args.pp))
    (io0, f0), t0 = io_counters(), time.perf_counter()
    llm.eval(toks)
    (io1, f1), t1 = io_counters(), time.perf_counter()
    if llm.moe_engine is not None:
        row["ram_prefill"] = llm.moe_stats()["engine"]["ram"]
        llm.moe_engine.reset_stats()
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    for _ in range(args.tg):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    (io2, f2), t2 = io_counters(), time.perf_counter()
    row.update(pp_tps=args.pp / (t1 - t0), tg_tps=args.tg / (t2 - t1),
               pp_read_per_token=(io1 - io0) / args.pp, tg_read_per_token=(io2 - io1) / args.tg,
               pp_majflt_per_token=(f1 - f0) / args.pp, tg_majflt_per_token=(f2 - f1) / args.tg,
               pp_read_bw=(io1 - io0) / (t1 - t0), tg_read_bw=(io2 - io1) / (t2 - t1))
    if llm.moe_engine is not None:
        ram = llm.moe_stats()["engine"]["ram"]
        row["ram_decode"] = ram
        row["ram_budget"] = ram["moe_ram_cache"]
    llm.close()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF to run (default: the synthetic benchmark model)")
    ap.add_argument("--size-factor", type=float, default=1.5, help="model size over MemTotal (default 1.5)")
    ap.add_argument("--limit", default="8GiB", help="memory cgroup limit of each run (default 8GiB)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"modes to run, comma-separated ({', '.join(MODES)})")
    ap.add_argument("--locality", default="high", help="synthetic routing locality preset (high, low)")
    ap.add_argument("--pp", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--tg", type=int, default=32, help="decode tokens (default 32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child-kw", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_kw is not None:
        print("ROW " + json.dumps(child(args)), flush=True)
        return 0
    from hybrimoe.policy.budget import parse_budget

    args.model = Path(args.model) if args.model else model_path(args.size_factor)
    limit = int(parse_budget(args.limit, 1.0, 0.0))
    cg = MemoryCgroup(limit)
    rows = []
    try:
        for name in [m.strip() for m in args.modes.split(",") if m.strip()]:
            if name not in MODES:
                print(f"unknown mode {name!r} (known: {', '.join(MODES)})", file=sys.stderr)
                return 2
            cmd = [sys.executable, __file__, "--model", str(args.model), "--pp", str(args.pp), "--tg", str(args.tg),
                   "--threads", str(args.threads), "--locality", args.locality, "--child-kw", json.dumps(MODES[name])]
            print(f"{name}...", file=sys.stderr, flush=True)
            p = subprocess.run(cmd, preexec_fn=cg.enter, capture_output=True, text=True)
            got = [ln[4:] for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
            row = json.loads(got[0]) if got else {
                "error": f"exit status {p.returncode}" + (" (killed: out of memory?)" if p.returncode < 0 else "") +
                         ": " + (p.stderr or p.stdout)[-2000:]}
            row["mode"] = name
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("ram_")}), file=sys.stderr, flush=True)
    finally:
        cg.close()
    size = args.model.stat().st_size
    print(f"model {args.model.name}: {size / 2**30:.1f} GiB on disk; memory cgroup limit {limit / 2**30:.1f} GiB; "
          f"{args.threads} threads, CPU only; routing replayed ({args.locality} locality)")
    print(f"| mode | pp{args.pp} t/s | tg{args.tg} t/s | MB read/token (pp, tg) | major faults/token (pp, tg) | "
          "read MB/s (pp, tg) | RAM hit rate (tg) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | error: {r['error'].splitlines()[-1] if r['error'] else '?'} |")
            continue
        hit = f"{r['ram_decode']['hit_rate']:.3f}" if "ram_decode" in r else "-"
        print(f"| {r['mode']} | {r['pp_tps']:.2f} | {r['tg_tps']:.3f} | {r['pp_read_per_token'] / 1e6:.1f}, "
              f"{r['tg_read_per_token'] / 1e6:.1f} | {r['pp_majflt_per_token']:.0f}, {r['tg_majflt_per_token']:.0f} | "
              f"{r['pp_read_bw'] / 1e6:.0f}, {r['tg_read_bw'] / 1e6:.0f} | {hit} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(args.model), "model_bytes": size, "limit": limit,
                                               "threads": args.threads, "pp": args.pp, "tg": args.tg,
                                               "locality": args.locality, "rows": rows}, indent=2))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
