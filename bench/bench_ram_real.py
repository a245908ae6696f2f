"""The RAM tier on this machine, for real: a model larger than RAM, upstream llama.cpp's mmap against hybrimoe's RAM
tier at the same memory, CPU only.

Model: a synthetic DeepSeek-V2-Lite-shaped GGUF (``hybrimoe.tiny.make_synthetic_model``: Q4_K_M types, random
weights) with enough layers to be ``--size-factor`` x this machine's RAM on disk (MemTotal; 1.5 by default), written
once to ``$HYBRIMOE_CACHE_DIR/models``. Routing: replayed (``moe_replay``) from a synthetic trace of the model's own
shape (``hybrimoe.traces.synthetic.synthetic_trace``, ``--locality``), so both sides route alike whatever the random
router says, with the trace's router scores (``moe_replay_scores``) for hybrimoe's cache policies; the text is
meaningless.

Same memory: every run is a child process in a memory cgroup of its own (cgroup v1 or v2, made under this process's
one) whose limit (``--limit``) covers everything the process holds, page cache included: upstream's mmap keeps in the
page cache what fits under it; hybrimoe gets ``moe_ram_cache="auto"`` (what the cgroup has left after the load, less
the other weights and a margin: ``hybrimoe.runtime.ram_tier.auto_ram_slots``) or ``--budget``. Before each run the
file is dropped from the page cache (fsync, POSIX_FADV_DONTNEED).

Per run: prefill tokens/s (one ``--pp``-token prompt, ubatch 512), decode tokens/s (``--tg`` tokens after it) and
the prefill of a follow-up turn (``pp2``: another ``--pp`` tokens appended to the same context after the decode, as
a chat's next message or a server's next request: the RAM, or upstream's page cache, then holds what the first turn
left, where the first prefill started from nothing), bytes read from the disk per token (``/proc/self/io``
read_bytes: what reached the block device, read-ahead included) and major page faults per token (getrusage), the
read bandwidth that gives, the share of the stage the disk was busy (its ``io_ticks``: near 1, the stage waited for
the disk), and for hybrimoe the RAM tier's counters.
Modes (``--modes``): upstream (mmap, ``--no-repack``: with its default repacking the load would read every expert
into RAM, which a model larger than RAM does not allow), hybrimoe (as users run it: MRS, prefetch by the router
look-ahead, slots in the file's layout, the other CPU weights repacked where upstream repacks them), hybrimoe with
LRU, hybrimoe with the reuse-predicting cache (``moe_ram_policy="reuse"``), hybrimoe without prefetch, hybrimoe with every CPU weight in the file's layout (``no_repack``, as upstream's mmap
run), hybrimoe with its slots repacked after each read (``HYBRIMOE_RAM_REPACK=1``: ``hybrimoe.envs.ram_repack``), and
hybrimoe with its CPU share in one pass per layer after every read (``HYBRIMOE_RAM_TWO_PASS=0``; two passes, resident
experts first, by default: ``hybrimoe.envs.ram_two_pass``).

Read-ahead: the block device's ``read_ahead_kb`` decides how much upstream's mmap reads per fault (Linux gives an
NVMe drive 128 KiB; this project's disk has 8 MiB), so every mode runs at each ``--read-ahead`` value (default
128, 512, 2048 and 8192), set through sysfs where the process may (``hybrimoe.runtime.readahead``; put back at the
end; the value in force is recorded either way). ``-r`` interleaved repetitions: per repetition every read-ahead,
and at each every mode in a rotating order, the load average read before each run. Prints per (mode, read-ahead) the
median (min..max) of each figure, then hybrimoe against upstream at 128 KiB and against upstream at its best
read-ahead per stage; ``--json`` writes every run, the summary and the read-ahead attempts.

Disk calibration during the runs (``--calibrate-disk DIR``): this disk's throughput drifts over a day (cold reads
1.3-2.4 GB/s on this machine), so a calibration taken before or after the runs may not be the disk they ran on. With
the flag, at each repetition and read-ahead, before its modes, ``hybrimoe calibrate --disk --memory-limit`` (the
runs' ``--limit``) measures the disk at that read-ahead into ``DIR/disk_KB_rREP.json``; the JSON lists them
(``disk_calibrations``), and bench/predict_ram_real.py ``--disk from-run`` predicts with their median.

    python3 bench/bench_ram_real.py --limit 3GiB --json ram_real.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

MODES = {
    "upstream-mmap": {},
    "hybrimoe": {"moe_ram_cache": "auto"},
    "hybrimoe-no-prefetch": {"moe_ram_cache": "auto", "moe_prefetch_layers": 0},
    "hybrimoe-lru": {"moe_ram_cache": "auto", "moe_ram_policy": "lru"},
    "hybrimoe-reuse": {"moe_ram_cache": "auto", "moe_ram_policy": "reuse"},
    "hybrimoe-no-repack": {"moe_ram_cache": "auto", "no_repack": True},
    "hybrimoe-one-pass": {"moe_ram_cache": "auto", "_env": {"HYBRIMOE_RAM_TWO_PASS": "0"}},
    "hybrimoe-repack": {"moe_ram_cache": "auto", "_env": {"HYBRIMOE_RAM_REPACK": "1"}},
}


def model_path(size_factor: float, layers: int | None = None) -> Path:
    """The benchmark model (written when absent): DeepSeek-V2-Lite's shape with ``layers`` blocks, or as many as make
    it ``size_factor`` x MemTotal."""
    from hybrimoe.runtime.ram_tier import machine_memory
    from hybrimoe.tiny.synthetic import make_synthetic_model

    root = Path(os.environ.get("HYBRIMOE_CACHE_DIR", Path.home() / ".cache" / "hybrimoe")) / "models"
    if layers:
        path = root / f"ram-bench-{layers}.gguf"
        if not path.exists():
            print(f"writing {path} ({layers} layers)...", file=sys.stderr)
            make_synthetic_model(path, n_layer=layers)
        return path
    total = machine_memory()["total"]
    # one MoE layer of this shape is 384.6 MB on disk (364 MB of experts), the rest about 190 MB: a layer is added
    # so the file is not under the factor
    n_layer = int((size_factor * total - 190e6) / 384e6) + 2
    # one written before with at least as many layers does (tens of GB: not written twice)
    for old in sorted(root.glob("ram-bench-*.gguf")):
        if old.stat().st_size >= size_factor * total:
            return old
    path = root / f"ram-bench-{n_layer}.gguf"
    if not path.exists():
        print(f"writing {path} ({n_layer} layers)...", file=sys.stderr)
        make_synthetic_model(path, n_layer=n_layer)
    return path


def child(args) -> dict:
    """One mode in this (cgroup-limited) process: the figures as a dict."""
    import numpy as np

    from hybrimoe import Llama
    from hybrimoe.model.facts import facts_from_gguf
    from hybrimoe.runtime.benchmark import io_counters
    from hybrimoe.runtime.disk_calibration import drop_from_page_cache
    from hybrimoe.runtime.ram_tier import machine_memory
    from hybrimoe.runtime.readahead import disk_busy_ms
    from hybrimoe.traces.routing_replay import routing_replay_table
    from hybrimoe.traces.synthetic import synthetic_trace

    kw = json.loads(args.child_kw)
    os.environ.update(kw.pop("_env", {}))  # a mode's environment (read when the engine is made)
    # a synthetic trace with router scores: the engine's MRS ranks by the replayed routing's scores, as it would on
    # the model's own routing (the random router's would not match the replayed ids)
    tr = synthetic_trace(facts_from_gguf(args.model), 2 * args.pp + args.tg + 8, locality=args.locality, seed=0,
                         scores=True, n_prompts=1)
    table, scores = routing_replay_table(tr, args.model, scores=True)
    del tr
    drop_from_page_cache(args.model)
    t_load = time.perf_counter()
    no_repack = kw.pop("no_repack", not kw)  # upstream's mmap runs --no-repack (see the module's docstring)
    llm = Llama(str(args.model), n_ctx=2 * args.pp + args.tg + 16, n_batch=512, n_ubatch=512, n_threads=args.threads,
                n_threads_batch=args.threads, n_gpu_layers=0, verbose=False, no_repack=no_repack, moe_replay=table,
                moe_replay_scores=scores, flash_attn=args.flash_attn,
                **({"moe_cost_model": "rtx4090-desktop"} if kw else {}), **kw)
    load_s = time.perf_counter() - t_load
    mem = machine_memory()
    row = {"load_s": load_s, "cgroup_total": mem["total"], "memory_source": mem["source"]}
    toks = list(np.random.default_rng(0).integers(5, 500, size=args.pp))
    (io0, f0), t0, b0 = io_counters(), time.perf_counter(), disk_busy_ms(args.model)
    llm.eval(toks)
    (io1, f1), t1, b1 = io_counters(), time.perf_counter(), disk_busy_ms(args.model)
    if llm.moe_engine is not None:
        row["ram_prefill"] = llm.moe_stats()["engine"]["ram"]
        llm.moe_engine.reset_stats()
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    for _ in range(args.tg):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    (io2, f2), t2, b2 = io_counters(), time.perf_counter(), disk_busy_ms(args.model)
    if llm.moe_engine is not None:
        row["ram_decode"] = llm.moe_stats()["engine"]["ram"]
        llm.moe_engine.reset_stats()
    # the follow-up turn: another prompt after the decode, in the same context (its own rows of the trace)
    llm.eval(list(np.random.default_rng(1).integers(5, 500, size=args.pp)))
    (io3, f3), t3, b3 = io_counters(), time.perf_counter(), disk_busy_ms(args.model)
    row.update(pp2_tps=args.pp / (t3 - t2), pp2_read_per_token=(io3 - io2) / args.pp,
               pp2_majflt_per_token=(f3 - f2) / args.pp)
    row.update(pp_tps=args.pp / (t1 - t0), tg_tps=args.tg / (t2 - t1),
               pp_read_per_token=(io1 - io0) / args.pp, tg_read_per_token=(io2 - io1) / args.tg,
               pp_majflt_per_token=(f1 - f0) / args.pp, tg_majflt_per_token=(f2 - f1) / args.tg,
               pp_read_bw=(io1 - io0) / (t1 - t0), tg_read_bw=(io2 - io1) / (t2 - t1))
    if b0 is not None and b2 is not None:  # the share of each stage the disk had reads in flight
        row.update(pp_disk_busy=(b1 - b0) / 1e3 / (t1 - t0), tg_disk_busy=(b2 - b1) / 1e3 / (t2 - t1),
                   pp2_disk_busy=(b3 - b2) / 1e3 / (t3 - t2))
    if llm.moe_engine is not None:
        ram = llm.moe_stats()["engine"]["ram"]
        row["ram_prefill2"] = ram
        row["ram_budget"] = ram["moe_ram_cache"]
    # the process's peak resident memory (VmHWM): what the cgroup's limit had to hold besides the page cache
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            row["rss_peak"] = int(line.split()[1]) * 1024
    llm.close()
    return row


def summarize(rows: list[dict]) -> list[dict]:
    """Per (mode, read-ahead asked): the median and range over the repetitions of each figure."""
    import statistics

    out = []
    keys = sorted({(r["mode"], r["asked_kb"]) for r in rows}, key=lambda k: (list(MODES).index(k[0]), k[1]))
    for mode, kb in keys:
        runs = [r for r in rows if r["mode"] == mode and r["asked_kb"] == kb]
        ok = [r for r in runs if "error" not in r]
        s = {"mode": mode, "asked_kb": kb, "runs": len(runs), "errors": [r["error"] for r in runs if "error" in r],
             "in_force_kb": sorted({r["read_ahead_kb"] for r in runs}), "loadavg": [r["loadavg"] for r in runs]}
        for f in ("pp_tps", "tg_tps", "pp2_tps", "pp_read_per_token", "tg_read_per_token", "pp2_read_per_token",
                  "pp_majflt_per_token", "tg_majflt_per_token", "pp2_majflt_per_token", "pp_disk_busy",
                  "tg_disk_busy", "pp2_disk_busy"):
            xs = [r[f] for r in ok if f in r]
            if xs:
                s[f] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        for key, stage in (("ram_hit_rate", "ram_decode"), ("ram_hit_rate_pp2", "ram_prefill2")):
            hits = [r[stage]["hit_rate"] for r in ok if stage in r]
            if hits:
                s[key] = {"median": statistics.median(hits), "min": min(hits), "max": max(hits)}
        out.append(s)
    return out


def _fig(s: dict, key: str, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    v = s.get(key)
    if not v:
        return "-"
    return f"{fmt.format(v['median'] / scale)} ({fmt.format(v['min'] / scale)}..{fmt.format(v['max'] / scale)})"


def headline(summary: list[dict]) -> list[str]:
    """hybrimoe against upstream at 128 KiB (the usual read-ahead) and against upstream at its best read-ahead per
    stage: the lines that say so."""
    up = [s for s in summary if s["mode"] == "upstream-mmap" and "pp_tps" in s]
    hy = [s for s in summary if s["mode"] == "hybrimoe" and "pp_tps" in s]
    lines = []
    if not up or not hy:
        return lines
    for stage in ("pp_tps", "tg_tps", "pp2_tps"):
        if not all(stage in s for s in up + hy):
            continue
        best_up = max(up, key=lambda s: s[stage]["median"])
        best_hy = max(hy, key=lambda s: s[stage]["median"])
        at128 = [(u, h) for u in up for h in hy if u["asked_kb"] == h["asked_kb"] == 128]
        what = {"pp_tps": "prefill", "tg_tps": "decode", "pp2_tps": "follow-up prefill"}[stage]
        if at128:
            u, h = at128[0]
            hm, um = h[stage]["median"], u[stage]["median"]
            lines.append(f"{what}: hybrimoe {hm:.3f} t/s = {hm / um:.2f}x upstream's {um:.3f} at read_ahead_kb 128")
        hm, um = best_hy[stage]["median"], best_up[stage]["median"]
        lines.append(f"{what}: hybrimoe's best {hm:.3f} t/s (read_ahead_kb {best_hy['asked_kb']}) = {hm / um:.2f}x "
                     f"upstream's best {um:.3f} (read_ahead_kb {best_up['asked_kb']})")
    return lines


def calibrate_disk(model: Path, limit: int, out: Path, rep: int, kb: int) -> dict:
    """``hybrimoe calibrate --disk`` of ``model``'s disk at the read-ahead in force (``kb``), its decode faults under a
    memory cgroup of ``limit`` bytes, into ``out``: the record of it for the JSON (file, when, the cold-read and
    fault throughputs), or its error (the runs go on)."""
    # the installed package's CLI, wherever this runs from (python -m would put a checkout first on the path)
    cmd = [sys.executable, "-c", "import sys; from hybrimoe.commands import main; sys.exit(main())", "calibrate",
           "--disk", "-m", str(model), "-o", str(out), "--force", "--memory-limit", str(limit)]
    t0 = time.time()
    print(f"calibrate --disk at read_ahead_kb {kb} (repetition {rep + 1})...", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    rec = dict(rep=rep, read_ahead_kb=kb, file=str(out), started=time.strftime("%H:%M:%S", time.localtime(t0)),
               seconds=round(time.time() - t0, 1))
    if p.returncode != 0:
        rec["error"] = f"exit status {p.returncode}: " + (p.stderr or p.stdout)[-1500:]
    else:
        try:
            facts = json.loads(out.read_text())["facts"]
            rec.update({k: facts[k]["value"] for k in ("read_bandwidth_Bps", "tier_read_Bps", "buffered_read_Bps",
                                                       "mmap_fault_Bps") if k in facts})
        except (OSError, ValueError, KeyError, TypeError) as e:
            rec["error"] = f"{out}: not a disk file calibrate wrote ({e})"
    print(json.dumps(rec), file=sys.stderr, flush=True)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF to run (default: the synthetic benchmark model)")
    ap.add_argument("--size-factor", type=float, default=1.5, help="model size over MemTotal (default 1.5)")
    ap.add_argument("--layers", type=int, default=None,
                    help="blocks of the synthetic model instead (26: DeepSeek-V2-Lite's 9.1 GiB, 3x a 3 GiB --limit)")
    ap.add_argument("--limit", default="8GiB", help="memory cgroup limit of each run (default 8GiB)")
    ap.add_argument("--modes", default="upstream-mmap,hybrimoe,hybrimoe-lru",
                    help=f"modes to run, comma-separated ({', '.join(MODES)}; default %(default)s)")
    ap.add_argument("--read-ahead", default="128,512,2048,8192",
                    help="read_ahead_kb values of the model's block device to run every mode at (default %(default)s)")
    ap.add_argument("-r", "--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    ap.add_argument("--locality", default="high", help="synthetic routing locality preset (high, low)")
    ap.add_argument("--pp", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--tg", type=int, default=32, help="decode tokens (default 32)")
    ap.add_argument("--threads", type=int, default=2)
    from hybrimoe.commands.llama_args import add_flash_attn_argument

    add_flash_attn_argument(ap)  # upstream's -fa, its default (auto) included: every mode alike
    ap.add_argument("--json", default=None)
    ap.add_argument("--calibrate-disk", default=None, metavar="DIR",
                    help="calibrate the disk (hybrimoe calibrate --disk --memory-limit LIMIT) at each repetition and "
                         "read-ahead, before its modes, into DIR (root: the probe runs in a memory cgroup)")
    ap.add_argument("--child-kw", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_kw is not None:
        print("ROW " + json.dumps(child(args)), flush=True)
        return 0
    from hybrimoe.policy.budget import parse_budget
    from hybrimoe.runtime.cgroup import MemoryCgroup
    from hybrimoe.runtime.readahead import ReadAhead

    limit = int(parse_budget(args.limit, 1.0, 0.0))
    if limit < 256 << 20:  # a share ("50%") of 1 byte, or a typo: every child would be killed at once
        print(f"--limit {args.limit!r}: give the cgroup's limit in bytes (e.g. 3GiB), at least 256 MiB",
              file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for name in modes:
        if name not in MODES:
            print(f"unknown mode {name!r} (known: {', '.join(MODES)})", file=sys.stderr)
            return 2
    try:
        asked = [int(x) for x in args.read_ahead.split(",") if x.strip()]
    except ValueError:
        print(f"--read-ahead {args.read_ahead!r}: give read_ahead_kb values in KiB, e.g. 128,8192", file=sys.stderr)
        return 2
    cal_dir = Path(args.calibrate_disk) if args.calibrate_disk else None
    if cal_dir is not None:
        cal_dir.mkdir(parents=True, exist_ok=True)
    # the flags are checked before the model, which may have to be written (tens of GB)
    args.model = Path(args.model) if args.model else model_path(args.size_factor, args.layers)
    rows, calibrations = [], []
    # a SIGTERM (a timeout, a kill) still restores the read-ahead and removes the cgroup (the finally below): the
    # handler first, then the two things it must undo
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cg = MemoryCgroup(limit)
    try:
        ra = ReadAhead(args.model)
    except BaseException:
        cg.close()
        raise
    try:
        for rep in range(args.reps):
            for kb in asked:
                in_force = ra.set(kb)
                if not ra.log[-1]["set"]:
                    print(f"read_ahead_kb {kb}: could not set it ({ra.log[-1]['why']}); {in_force} in force",
                          file=sys.stderr, flush=True)
                if cal_dir is not None:
                    calibrations.append(calibrate_disk(args.model, limit, cal_dir / f"disk_{in_force}_r{rep}.json",
                                                       rep, in_force))
                k = rep % len(modes)
                for name in modes[k:] + modes[:k]:
                    cmd = [sys.executable, __file__, "--model", str(args.model), "--pp", str(args.pp), "--tg",
                           str(args.tg), "--threads", str(args.threads), "--locality", args.locality,
                           "--flash-attn", args.flash_attn, "--child-kw",
                           json.dumps(MODES[name])]
                    load = os.getloadavg()[0]
                    print(f"{name} at read_ahead_kb {in_force} (repetition {rep + 1}, load average {load:.2f})...",
                          file=sys.stderr, flush=True)
                    p = subprocess.run(cmd, preexec_fn=cg.enter, capture_output=True, text=True)
                    got = [ln[4:] for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
                    row = json.loads(got[0]) if got else {
                        "error": f"exit status {p.returncode}" + (" (killed: out of memory?)" if p.returncode < 0 else
                                                                 "") + ": " + (p.stderr or p.stdout)[-2000:]}
                    row.update(mode=name, rep=rep, asked_kb=kb, read_ahead_kb=in_force, loadavg=load)
                    rows.append(row)
                    print(json.dumps({k2: v for k2, v in row.items() if not k2.startswith("ram_")}), file=sys.stderr,
                          flush=True)
    finally:
        ra.close()
        cg.close()
    summary = summarize(rows)
    size = args.model.stat().st_size
    print(f"model {args.model.name}: {size / 2**30:.1f} GiB on disk; memory cgroup limit {limit / 2**30:.1f} GiB; "
          f"{args.threads} threads, CPU only; routing replayed ({args.locality} locality); {args.reps} interleaved "
          f"repetitions, median (min..max); read_ahead_kb found {ra.original}, put back after")
    print(f"| mode | read_ahead_kb | pp{args.pp} t/s | tg{args.tg} t/s | follow-up pp{args.pp} t/s | "
          "MB read/token pp | MB read/token tg | MB read/token pp2 | major faults/token pp | major faults/token tg | "
          "disk busy pp | disk busy tg | RAM hit rate (tg) | RAM hit rate (pp2) | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        if "pp_tps" not in s:
            err = s["errors"][-1].splitlines()[-1] if s["errors"] else "?"
            print(f"| {s['mode']} | {s['asked_kb']} | error: {err} |")
            continue
        kb = ",".join(str(x) for x in s["in_force_kb"])
        print(f"| {s['mode']} | {kb} | {_fig(s, 'pp_tps')} | {_fig(s, 'tg_tps', fmt='{:.3f}')} | "
              f"{_fig(s, 'pp2_tps')} | "
              f"{_fig(s, 'pp_read_per_token', 1e6, '{:.0f}')} | {_fig(s, 'tg_read_per_token', 1e6, '{:.0f}')} | "
              f"{_fig(s, 'pp2_read_per_token', 1e6, '{:.0f}')} | "
              f"{_fig(s, 'pp_majflt_per_token', 1, '{:.0f}')} | {_fig(s, 'tg_majflt_per_token', 1, '{:.0f}')} | "
              f"{_fig(s, 'pp_disk_busy')} | {_fig(s, 'tg_disk_busy')} | {_fig(s, 'ram_hit_rate', fmt='{:.3f}')} | "
              f"{_fig(s, 'ram_hit_rate_pp2', fmt='{:.3f}')} | {min(s['loadavg']):.2f}..{max(s['loadavg']):.2f} |")
    for line in headline(summary):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(args.model), "model_bytes": size, "limit": limit,
                                               "threads": args.threads, "pp": args.pp, "tg": args.tg,
                                               "flash_attn": args.flash_attn,
                                               "locality": args.locality, "reps": args.reps,
                                               "read_ahead": {"found_kb": ra.original, "attempts": ra.log},
                                               "disk_calibrations": calibrations,
                                               "summary": summary, "rows": rows}, indent=2))
    ok = all("error" not in r for r in rows) and all("error" not in c for c in calibrations)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
