"""Several requests in one batch, for real: aggregate decode tokens/s and time per output token at 1, 2, 4 and 8
concurrent requests, generated together (``Llama.create_completions``: continuous batching, as llama-server's
slots) against one at a time (``create_completion`` after ``create_completion``, what ``hybrimoe serve`` does at
``--parallel 1``), CPU only.

Model: a synthetic DeepSeek-V2-Lite-shaped GGUF (random weights, Q4_K_M types: ``bench/bench_ram_real.py``'s models).
Routing (``--locality``): ``high`` (the default) or ``low`` replays a synthetic trace with router scores (the
simulator's generator, as ``bench_ram_real.py``), each request its own prompt of it (the replay's per-sequence
offsets: requests routed independently, sharing experts only as often as their popularity makes them), so that the
RAM tier's cache and the batch see a real routing's reuse; ``none`` keeps the random model's own router (its
tokens route nearly alike: the RAM tier then hits 0.92-0.96 of the lookups). Both modes replay the same rows.
Modes (``--modes``):
``hybrimoe`` (the engine with its RAM tier, ``moe_ram_cache="auto"``: the larger-than-RAM case; or ``moe_cache=0``
with ``--in-ram``), and ``upstream`` (the same generator on llama.cpp without the engine: mmap, ``--no-repack``
where the model does not fit, as ``bench_ram_real.py``). ``--limit``: each run in a memory cgroup of that size (a
model larger than RAM), the model file's block device at ``--read-ahead`` KiB (Linux's usual 128 by default; set
through sysfs where the process may, put back at the end, the value in force printed).

Per run and N: prompts of ``--pp`` tokens (different ones), ``--tg`` new tokens each (greedy, no end of
generation: the random model's text is meaningless); aggregate tokens/s = all requests' new tokens over the wall
time from the first decode to the last; TPOT per request = its decode time over its new tokens after the first;
median and p95 over the requests. The bound beside each N: the distinct experts N independent tokens route to per
layer, E (1 - (1 - k/E)^N), over N x k: the share of the expert weights a batched decode step reads per token.

    python3 bench/bench_batch.py --layers 26 --limit 3GiB --json batch.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def bound(n: int, k: int, e: int) -> float:
    """Distinct experts of ``n`` tokens routed independently and uniformly (top-``k`` of ``e``), per token routed:
    E (1 - (1 - k/E)^n) / (n k)."""
    return e * (1 - (1 - k / e) ** n) / (n * k)


def child(args) -> dict:
    """One (mode, N) in this process: the figures as a dict."""
    import numpy as np

    from hybrimoe import Llama
    from hybrimoe.runtime.batch import BatchGenerator
    from hybrimoe.runtime.disk_calibration import drop_from_page_cache

    mode, n, way = args.child.split(":")
    n = int(n)
    kw = {}
    if mode == "hybrimoe":
        kw = {"moe_cache": 0} if args.in_ram else {"moe_ram_cache": "auto"}
        kw["moe_cost_model"] = "rtx4090-desktop"
    per = args.pp + args.tg + 8
    offsets = [0] * n
    if args.locality != "none":  # request i replays prompt i of a synthetic trace (its rows from offsets[i] on)
        from hybrimoe.model.facts import facts_from_gguf
        from hybrimoe.traces.routing_replay import routing_replay_table
        from hybrimoe.traces.synthetic import synthetic_trace

        tr = synthetic_trace(facts_from_gguf(args.model), n * per, locality=args.locality, seed=0, scores=True,
                             n_prompts=n)
        kw["moe_replay"], kw["moe_replay_scores"] = routing_replay_table(tr, args.model, scores=True)
        offsets = [int(x) for x in tr.prompt_offsets[:n]]
        del tr
    drop_from_page_cache(args.model)
    slots = n if way == "batched" else 1
    llm = Llama(str(args.model), n_ctx=slots * per, n_batch=512, n_ubatch=512,
                n_threads=args.threads, n_threads_batch=args.threads, n_gpu_layers=0, verbose=False,
                no_repack=not args.in_ram and mode == "upstream", n_seq_max=slots, flash_attn=args.flash_attn, **kw)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(5, 500, size=args.pp)] for _ in range(n)]
    from hybrimoe._lib import llama_cpp_module

    lc = llama_cpp_module().llama_cpp
    eog = [t for t in range(llm.n_vocab()) if lc.llama_vocab_is_eog(llm._model.vocab, t)]
    bias = {t: -1e9 for t in eog}  # no end of generation: every request makes --tg tokens
    gen = BatchGenerator(llm, logit_bias=bias)
    t0 = time.perf_counter()
    stamps = []
    replay = llm.moe_replay
    if way == "batched":
        if replay is not None:
            replay.sequence_offsets = offsets  # request i takes slot i (sequence i)
        gen.run(prompts, max_tokens=args.tg, temperature=0.0)
        stamps = gen.token_times
    else:
        for i, p in enumerate(prompts):
            if replay is not None:
                replay.sequence_offsets = [offsets[i]]
            gen.run([p], max_tokens=args.tg, temperature=0.0)
            stamps += gen.token_times
    t1 = time.perf_counter()
    first = min(s[0] for s in stamps)
    new = sum(len(s) for s in stamps)
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
    row = {"mode": mode, "n": n, "way": way, "wall_s": t1 - t0, "tokens": new,
           "decode_tps": new / (max(s[-1] for s in stamps) - first + 1e-9) if way == "batched" else
           new / sum(s[-1] - s[0] for s in stamps),
           "tpot_p50_s": statistics.median(tpot), "tpot_p95_s": float(np.percentile(tpot, 95)),
           "batch_sizes": gen.batch_sizes[:4]}
    ram = llm.moe_stats()["engine"].get("ram") if llm.moe_engine is not None else None
    if ram:
        row["ram_hit_rate"] = ram["hit_rate"]
        row["ram_bytes_read"] = ram["bytes_read"]
    llm.close()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=26, help="blocks of the synthetic model (bench_ram_real's)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--in-ram", action="store_true", help="the model fits: no RAM tier, no cgroup")
    ap.add_argument("--limit", default="3GiB", help="memory cgroup limit of each run (not with --in-ram)")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--modes", default="hybrimoe,upstream")
    ap.add_argument("--ways", default="batched,one-at-a-time")
    ap.add_argument("--read-ahead", type=int, default=128, help="read_ahead_kb of the model's disk (default 128)")
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--locality", choices=("high", "low", "none"), default="high",
                    help="routing: a synthetic trace of this locality replayed, each request its own prompt; none: "
                         "the random model's router (default %(default)s)")
    from hybrimoe.commands.llama_args import add_flash_attn_argument

    add_flash_attn_argument(ap)  # upstream's -fa, its default (auto) included: every mode alike
    ap.add_argument("-r", "--reps", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from bench_ram_real import model_path

        args.model = model_path(1.5, args.layers)
    args.model = Path(args.model)
    if args.child:
        print("ROW " + json.dumps(child(args)), flush=True)
        return 0
    from hybrimoe.model.facts import facts_from_gguf
    from hybrimoe.policy.budget import parse_budget
    from hybrimoe.runtime.cgroup import MemoryCgroup
    from hybrimoe.runtime.readahead import ReadAhead

    f = facts_from_gguf(args.model)
    cg = None if args.in_ram else MemoryCgroup(int(parse_budget(args.limit, 1.0, 0.0)))
    rows = []
    ra = ReadAhead(args.model)
    in_force = ra.set(args.read_ahead)
    try:
        for rep in range(args.reps):
            for n in [int(x) for x in args.clients.split(",")]:
                for mode in args.modes.split(","):
                    for way in args.ways.split(","):
                        if way == "one-at-a-time" and n == 1:
                            continue
                        load = os.getloadavg()[0]
                        cmd = [sys.executable, __file__, "--model", str(args.model), "--pp", str(args.pp), "--tg",
                               str(args.tg), "--threads", str(args.threads), "--flash-attn", args.flash_attn,
                               "--locality", args.locality,
                               "--child", f"{mode}:{n}:{way}"]
                        if args.in_ram:
                            cmd.append("--in-ram")
                        print(f"{mode} {way} N={n} (rep {rep + 1}, load {load:.2f})...", file=sys.stderr, flush=True)
                        p = subprocess.run(cmd, preexec_fn=cg.enter if cg else None, capture_output=True, text=True)
                        got = [ln[4:] for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
                        row = json.loads(got[0]) if got else {"mode": mode, "n": n, "way": way,
                                                             "error": (p.stderr or p.stdout)[-1500:]}
                        row.update(rep=rep, loadavg=load)
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        ra.close()
        if cg:
            cg.close()
    k, e = f.top_k, f.n_experts
    routing = ("the model's random router" if args.locality == "none" else
               f"{args.locality}-locality synthetic routing replayed, each request its own prompt")
    print(f"model {args.model.name} ({args.model.stat().st_size / 2**30:.1f} GiB), "
          f"{'in RAM' if args.in_ram else f'memory cgroup {args.limit}'}; {args.threads} threads, CPU only; "
          f"prompts of {args.pp} tokens, {args.tg} new tokens each; {routing}; read_ahead_kb {in_force} (found "
          f"{ra.original}, put back); {args.reps} repetition(s), median (min..max)")
    print("| mode | N | way | decode t/s (aggregate) | TPOT p50 ms | TPOT p95 ms | RAM hit rate | distinct experts "
          "per token routed, independent routing (bound) | load avg |")
    print("|---|---|---|---|---|---|---|---|---|")
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["mode"], r["n"], r["way"]), []).append(r)

    def fig(xs, fmt):
        return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}..{fmt.format(max(xs))})"

    for (mode, n, way), rs in groups.items():
        bad = [r for r in rs if "error" in r]
        if bad:
            print(f"| {mode} | {n} | {way} | error: {bad[0]['error'].splitlines()[-1]} |")
            continue
        b = bound(n, k, e) if way == "batched" else 1.0
        hit = fig([r["ram_hit_rate"] for r in rs], "{:.3f}") if "ram_hit_rate" in rs[0] else "-"
        load = f"{min(r['loadavg'] for r in rs):.2f}..{max(r['loadavg'] for r in rs):.2f}"
        print(f"| {mode} | {n} | {way} | {fig([r['decode_tps'] for r in rs], '{:.2f}')} | "
              f"{fig([1e3 * r['tpot_p50_s'] for r in rs], '{:.0f}')} | "
              f"{fig([1e3 * r['tpot_p95_s'] for r in rs], '{:.0f}')} | {hit} | {b:.2f} | {load} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(args.model), "flash_attn": args.flash_attn,
                                                "locality": args.locality, "rows": rows},
                                                indent=2))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
